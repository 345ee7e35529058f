"""The records the wire's modules share: :class:`Limits`, :class:`Codec` and the error wording.

Imports nothing of the wire's own (``codec``, ``arrays`` and ``frames`` import this), so every module
of the package loads on its own. Runs on Python >= 3.9 (the entry bundle).
"""

from __future__ import annotations

import builtins

from dreamlake.lakeshore.errors import DecodeError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

MiB = 1024 * 1024


class _Frozen:
    """A frozen record with ``__slots__`` (what ``@dataclass(frozen=True)`` gives, without importing
    dataclasses, which pulls in inspect): keyword or positional construction, ``==``, ``hash``,
    ``repr`` and pickling by field values; assigning a field raises ``AttributeError``."""

    __slots__: tuple[str, ...] = ()
    __match_args__: tuple[str, ...] = ()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__match_args__)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"cannot delete field {name!r}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__match_args__)
        return f"{type(self).__qualname__}({fields})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._values())


class Limits(_Frozen):
    """Bounds on decoding untrusted bytes. Lengths count bytes (str/bin/ext) or items (array/map)."""

    __match_args__ = (
        "max_buffer_size",
        "max_str_len",
        "max_bin_len",
        "max_ext_len",
        "max_array_len",
        "max_map_len",
        "max_depth",
    )
    __slots__ = __match_args__

    max_buffer_size: int
    max_str_len: int
    max_bin_len: int
    max_ext_len: int
    max_array_len: int
    max_map_len: int
    max_depth: int  # ext values (tuple, set, user codecs) nested inside each other

    def __init__(
        self,
        max_buffer_size: int = 128 * MiB,
        max_str_len: int = 128 * MiB,
        max_bin_len: int = 128 * MiB,
        max_ext_len: int = 128 * MiB,
        max_array_len: int = 16 * MiB,
        max_map_len: int = 4 * MiB,
        max_depth: int = 64,
    ) -> None:
        init = object.__setattr__
        init(self, "max_buffer_size", max_buffer_size)
        init(self, "max_str_len", max_str_len)
        init(self, "max_bin_len", max_bin_len)
        init(self, "max_ext_len", max_ext_len)
        init(self, "max_array_len", max_array_len)
        init(self, "max_map_len", max_map_len)
        init(self, "max_depth", max_depth)


DEFAULT_LIMITS = Limits()


def limits_for(data: Any) -> Limits:
    """DEFAULT_LIMITS, with the byte bounds widened to ``len(data)`` when that is larger: for bytes
    whose size was already bounded and checked elsewhere (an argument or result that came by
    reference, under ``MAX_PAYLOAD_BYTES`` and its sha256). No str, bin or ext can be longer than
    its buffer, so this admits nothing bigger than what is held; item counts keep their bounds."""
    n = len(data)
    if n <= DEFAULT_LIMITS.max_buffer_size:
        return DEFAULT_LIMITS
    return Limits(max_buffer_size=n, max_str_len=n, max_bin_len=n, max_ext_len=n)


# Frames are small arrays and maps around one bin body.


class Codec(_Frozen):
    """How one type travels: ``encode(obj) -> bytes`` is the ext data, ``decode(bytes) -> obj``."""

    __match_args__ = ("code", "type", "encode", "decode", "name")
    __slots__ = __match_args__

    code: int
    type: type
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    name: str

    def __init__(
        self,
        code: int,
        type: builtins.type,
        encode: Callable[[Any], bytes],
        decode: Callable[[bytes], Any],
        name: str,
    ) -> None:
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "encode", encode)
        object.__setattr__(self, "decode", decode)
        object.__setattr__(self, "name", name)


def why(e: BaseException) -> str:
    """How an error reads inside a :class:`DecodeError` message: a DecodeError's text as is, any
    other exception as ``Type: message``."""
    return str(e) if isinstance(e, DecodeError) else f"{type(e).__name__}: {e}".rstrip(": ")
