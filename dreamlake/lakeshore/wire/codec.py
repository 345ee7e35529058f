"""The value codec: ``pack`` / ``unpack`` and the codec registry (the stdlib codecs: :mod:`.stdtypes`).

What travels and how (the ext code table, limits, lossy cases) is documented in
:mod:`dreamlake.lakeshore.wire`; import the names from there, not from here. This module needs
msgpack alone at import time (which itself imports datetime and struct): uuid, decimal and pathlib
codecs are registered on first use, numpy / torch / PIL ones by :mod:`.arrays`, imported (like the
library itself) when a value of theirs is packed or an ext code of theirs is unpacked. Runs on
Python >= 3.9 (the entry bundle).
"""

from __future__ import annotations

# Start-up matters (every invocation's entry imports this module): no typing, dataclasses or
# inspect at runtime; logging only to log.
import contextvars
import struct

import msgpack

from dreamlake.lakeshore.errors import DecodeError

from . import stdtypes
from .base import DEFAULT_LIMITS, Codec, Limits, MiB
from .base import why as _why
from .stdtypes import sorted_if_possible as _sorted_if_possible

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

USER_CODES = range(64, 128)
BUILTIN_CODES = range(1, 64)


def _logger() -> Any:
    import logging

    return logging.getLogger(__name__)


# ---------------------------------------------------------------- registry

_BY_CODE: dict[int, Codec] = {}
_BY_TYPE: dict[type, Codec] = {}
# type -> function returning something msgpack packs (an ExtType or a native value); a cache.
_ENCODERS: dict[type, Callable[[Any], Any]] = {}
# Codes whose codecs live in a module imported on first use (an optional library, or a stdlib
# module the entry should not pay for at start-up): code -> module.
_LAZY_CODES: dict[int, str] = {
    1: "numpy",
    2: "numpy",
    3: "torch",
    4: "PIL",
    13: "uuid",
    14: "decimal",
    15: "pathlib",
    16: "pathlib",
    17: "pathlib",
    18: "pathlib",
}
_LAZY_ROOTS = frozenset(_LAZY_CODES.values())
_LAZY_TYPES = {
    "numpy.ndarray",
    "numpy.generic",
    "torch.Tensor",
    "PIL.Image.Image",
    "uuid.UUID",
    "decimal.Decimal",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
}
_LOADED: dict[str, bool] = {}
# Ext codes whose decoders unpack nested wire values (they count towards Limits.max_depth).
_NESTED_CODES = {5, 6, 7}
_NATIVE: dict[type, Callable[[Any], Any]] = {
    dict: dict,
    list: list,
    str: str.__str__,
    bytes: bytes,
    bytearray: bytes,
    memoryview: bytes,
    int: lambda i: _bigint(int.__int__(i)),
    float: float.__float__,
}
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("lakeshore_wire_depth", default=0)


def _add(codec: Codec) -> None:
    _BY_CODE[codec.code] = codec
    _BY_TYPE[codec.type] = codec
    _ENCODERS.clear()


def register(codec: Codec) -> None:
    """Register a codec for a user type; codes 64..127. A taken code or type is refused."""
    if not isinstance(codec, Codec):
        raise TypeError(f"wire.register takes a wire.Codec, not {type(codec).__name__}")
    code = codec.code
    if isinstance(code, bool) or not isinstance(code, int) or code not in USER_CODES:
        raise ValueError(
            f"codec {codec.name!r}: code {code!r} is outside the user range 64..127 "
            "(1..63 are built-in); pick a free code in 64..127"
        )
    if not isinstance(codec.type, type):
        raise TypeError(f"codec {codec.name!r}: type must be a class, not {codec.type!r}")
    if not (callable(codec.encode) and callable(codec.decode)):
        raise TypeError(f"codec {codec.name!r}: encode and decode must be callables")
    if not isinstance(codec.name, str) or not codec.name:
        raise TypeError(f"codec name must be a non-empty str, not {codec.name!r}")
    if _BY_CODE.get(code) == codec:
        return  # the same codec again (a re-imported module): nothing to do
    if code in _BY_CODE:
        raise ValueError(
            f"codec {codec.name!r}: ext code {code} is already taken by {_BY_CODE[code].name!r}; "
            "pick another code in 64..127"
        )
    qual = _qualname(codec.type)
    if codec.type in _NATIVE or codec.type in (bool, type(None), msgpack.ExtType, msgpack.Timestamp):
        raise ValueError(f"codec {codec.name!r}: {qual} is msgpack-native and never reaches a codec")
    root = codec.type.__module__.partition(".")[0]
    if root in _LAZY_ROOTS:
        _load_optional(root)  # the type exists, so its module is imported already: this is cheap
    taken = _BY_TYPE.get(codec.type)
    if taken is not None or qual in _LAZY_TYPES:
        owner = taken.name if taken is not None else "a built-in codec"
        raise ValueError(f"codec {codec.name!r}: type {qual} is already packed by {owner!r}")
    _add(codec)


def unregister(code: int) -> None:
    """Remove a user codec (codes 64..127); built-ins stay. Unknown codes are ignored."""
    if code not in USER_CODES:
        raise ValueError(f"code {code!r} is not a user code (64..127); built-in codecs cannot be removed")
    codec = _BY_CODE.pop(code, None)
    if codec is not None:
        _BY_TYPE.pop(codec.type, None)
        _ENCODERS.clear()


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


# ---------------------------------------------------------------- pack

# ExtType(code, data) without its Python-level __new__ checks (codes and data are checked here).
_ExtType = msgpack.ExtType
_new_tuple = tuple.__new__


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    return _new_tuple(_ExtType, (code, data))


def _encoder_for(t: type) -> Callable[[Any], Any]:
    for root in {b.__module__.partition(".")[0] for b in t.__mro__} & _LAZY_ROOTS:
        _load_optional(root)  # a user subclass of ndarray (or of PurePath) counts too
    for base in t.__mro__:
        codec = _BY_TYPE.get(base)
        if codec is not None:
            return _ext_encoder(codec)
        native = _NATIVE.get(base)
        if native is not None:
            return native
    raise TypeError(
        f"cannot pack a value of type {_qualname(t)}: it is not msgpack-native and no codec is "
        "registered for it. Convert it to str, bytes, int, float, bool, None, list, dict or a "
        "built-in type (see dreamlake.lakeshore.wire), or register one with "
        "wire.register(wire.Codec(code, type, encode, decode, name)) using a code in 64..127"
    )


def _ext_encoder(codec: Codec) -> Callable[[Any], Any]:
    code, encode = codec.code, codec.encode
    direct = _DIRECT.get(code)
    if direct is not None and _BY_CODE.get(code) is codec:
        return direct  # a built-in container: no wrapper, no checks on bytes it made itself

    def ext(obj: Any) -> msgpack.ExtType:
        data = encode(obj)
        if type(data) is not bytes:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"codec {codec.name!r} encode returned {type(data).__name__}, not bytes")
            data = bytes(data)
        return _ext(code, data)

    return ext


def _default(obj: Any) -> Any:
    t = type(obj)
    if t is tuple:  # by far the most common ext value: _tuple_ext inlined
        try:
            packer = _POOL.pop()
        except IndexError:
            packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
        out: bytes = packer.pack(list(obj))
        if len(out) <= _POOL_KEEP and len(_POOL) < _POOL_MAX:
            _POOL.append(packer)
        return _new_tuple(_ExtType, (5, out))
    enc = _ENCODERS.get(t)
    if enc is None:
        enc = _ENCODERS[t] = _encoder_for(t)
    return enc(obj)


# Packers are reused: a new one mallocs a fresh buffer each time, which dominates small values.
# A packer is taken off the pool for one call (codecs re-enter pack()), and one whose buffer grew
# past _POOL_KEEP is dropped rather than kept holding the memory.
_POOL: list[msgpack.Packer] = []
_POOL_MAX = 16
_POOL_KEEP = 1 * MiB


def _pack_items(items: list[Any]) -> bytes:
    """``pack(items)`` for the items of a built-in container: a pooled packer, no other checks."""
    try:
        packer = _POOL.pop()
    except IndexError:
        packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    out: bytes = packer.pack(items)
    if len(out) <= _POOL_KEEP and len(_POOL) < _POOL_MAX:
        _POOL.append(packer)
    return out


def _tuple_ext(t: Any) -> msgpack.ExtType:
    # _pack_items and _ext inlined (and this in _default for exact tuples): the most common ext value.
    try:
        packer = _POOL.pop()
    except IndexError:
        packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    out: bytes = packer.pack(list(t))
    if len(out) <= _POOL_KEEP and len(_POOL) < _POOL_MAX:
        _POOL.append(packer)
    return _new_tuple(_ExtType, (5, out))


def _set_ext(s: Any) -> msgpack.ExtType:
    return _ext(6, _pack_items(_sorted_if_possible(s)))


def _frozenset_ext(s: Any) -> msgpack.ExtType:
    return _ext(7, _pack_items(_sorted_if_possible(s)))


# Built-in codes whose encoders return the ExtType themselves (see _ext_encoder).
_DIRECT: dict[int, Callable[[Any], msgpack.ExtType]] = {5: _tuple_ext, 6: _set_ext, 7: _frozenset_ext}

_BIG = 1 * MiB  # a top-level ext value this large is framed by hand: one copy instead of three


def _is_big(value: Any) -> bool:
    return type(value).__module__ == "numpy" and getattr(value, "nbytes", 0) >= _BIG


def pack(value: Any) -> bytes:
    """msgpack bytes of ``value``; ``TypeError`` (with the fix) for a type nothing can pack."""
    if _is_big(value):
        return _pack_big(value)
    if type(value) is list and any(_is_big(v) for v in value):  # an Envelope's args
        return _pack_list_big(value)
    try:
        packer = _POOL.pop()
    except IndexError:
        packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    out: bytes = packer.pack(value)  # raises before the packer goes back: a failed one is dropped
    if len(out) <= _POOL_KEEP and len(_POOL) < _POOL_MAX:
        _POOL.append(packer)
    return out


def _pack_big(value: Any) -> bytes:
    """What the packer writes for a big top-level ndarray (ext 32), joined in one copy, not three."""
    codec = _BY_TYPE.get(type(value)) if _load_optional("numpy") else None
    if codec is None or codec.code != 1 or _ARRAY_PARTS is None:
        return pack([value])[1:]  # a subclass or an odd value: the general path, minus the array
    parts = _ARRAY_PARTS(value)
    size = sum(memoryview(p).nbytes for p in parts)
    return b"".join((_EXT32.pack(0xC9, size, 1), *parts))


def _pack_list_big(items: list[Any]) -> bytes:
    """A list holding big ndarrays, joined in one copy: the arrays' bytes are read in place (the
    packer would copy each three times); the same bytes as the packer writes."""
    _load_optional("numpy")
    parts: list[Any] = [msgpack.Packer().pack_array_header(len(items))]
    for item in items:
        codec = _BY_TYPE.get(type(item)) if _is_big(item) else None
        if codec is not None and codec.code == 1 and _ARRAY_PARTS is not None:
            head, raw = _ARRAY_PARTS(item)
            parts += [_EXT32.pack(0xC9, len(head) + memoryview(raw).nbytes, 1), head, raw]
        else:
            parts.append(pack(item))
    return b"".join(parts)


_EXT32 = struct.Struct(">BIb")
# numpy's (header, raw) split of an array, set when the numpy codec loads.
_ARRAY_PARTS: Callable[[Any], tuple[bytes, Any]] | None = None


# ---------------------------------------------------------------- unpack

# Built-in nested codes decoded inline by _ext_hook (no codec call, no nested unpack() round trip).
_SEQ_TYPES: dict[int, Callable[[list[Any]], Any]] = {5: tuple, 6: set, 7: frozenset}


def _bounded_unpackb(data: Any, lim: Limits, n: int) -> Any:
    """msgpack.unpackb with every length also bounded by the ``n`` bytes at hand (min() inlined: hot)."""
    return msgpack.unpackb(
        data,
        ext_hook=_ext_hook,
        raw=False,
        strict_map_key=False,
        max_str_len=lim.max_str_len if lim.max_str_len < n else n,
        max_bin_len=lim.max_bin_len if lim.max_bin_len < n else n,
        max_ext_len=lim.max_ext_len if lim.max_ext_len < n else n,
        max_array_len=lim.max_array_len if lim.max_array_len < n else n,
        max_map_len=lim.max_map_len if lim.max_map_len < n // 2 else n // 2,
    )


def _ext_hook(code: int, data: bytes) -> Any:
    make = _SEQ_TYPES.get(code)
    if make is not None:  # tuple / set / frozenset, the common case: the codec's decode, inline
        depth = _DEPTH.get() + 1
        lim = _LIMITS.get()
        if depth > lim.max_depth:
            raise DecodeError(f"ext values nested deeper than max_depth={lim.max_depth}")
        token = _DEPTH.set(depth)
        try:
            n = len(data)
            try:
                items = _bounded_unpackb(data, lim, n)
            except DecodeError as e:  # from a value nested deeper
                raise _items_error(code, data, str(e)) from e
            except Exception as e:  # msgpack errors, RecursionError: all mean bad bytes
                raise _items_error(code, data, f"cannot decode wire value: {_why(e)}") from e
            if type(items) is not list:
                got = type(items).__name__
                raise _items_error(code, data, f"expected a msgpack array inside the ext value, got {got}")
            try:
                return make(items)
            except Exception as e:  # an unhashable set item
                raise _items_error(code, data, _why(e)) from e
        finally:
            _DEPTH.reset(token)
    codec = _BY_CODE.get(code)
    if codec is None:
        root = _LAZY_CODES.get(code)
        if root is None or not _load_optional(root):
            return msgpack.ExtType(code, data)
        codec = _BY_CODE[code]
    if code in USER_CODES:
        depth = _DEPTH.get() + 1
        limits = _LIMITS.get()
        if depth > limits.max_depth:
            raise DecodeError(f"ext values nested deeper than max_depth={limits.max_depth}")
        token = _DEPTH.set(depth)
        try:
            return _decode_with(codec, data)
        finally:
            _DEPTH.reset(token)
    return _decode_with(codec, data)


def _items_error(code: int, data: bytes, why: str) -> DecodeError:
    """The error the tuple / set / frozenset codec's decode (a nested ``unpack``) would raise."""
    codec = _BY_CODE[code]
    return DecodeError(f"corrupt ext data for {codec.name} (code {codec.code}): {why}", data)


def _decode_with(codec: Codec, data: bytes) -> Any:
    try:
        return codec.decode(data)
    except Exception as e:
        raise DecodeError(f"corrupt ext data for {codec.name} (code {codec.code}): {_why(e)}", data) from e


_LIMITS: contextvars.ContextVar[Limits] = contextvars.ContextVar(
    "lakeshore_wire_limits", default=DEFAULT_LIMITS
)


def unpack(data: bytes | bytearray | memoryview, *, limits: Limits | None = None) -> Any:
    """The value in ``data`` (exactly one msgpack object); ``DecodeError`` on bad or oversized bytes.

    ``limits`` defaults to those of the enclosing ``unpack`` (a codec's nested call) or DEFAULT_LIMITS.
    """
    current = _LIMITS.get()
    lim = current if limits is None else limits
    n = data.nbytes if type(data) is memoryview else len(data)
    if n > lim.max_buffer_size:
        raise DecodeError(
            f"wire value is {n} bytes, over max_buffer_size={lim.max_buffer_size}; "
            "pass larger limits=wire.Limits(...) if it is expected",
            bytes(data[:64]),
        )
    if n >= _BIG and type(data) is bytes and data[0] == 0xC9 and data[5] == 1 and n <= lim.max_ext_len + 6:
        value = _unpack_big_array(data)
        if value is not None:
            return value
    token = None if lim is current else _LIMITS.set(lim)
    try:
        return _bounded_unpackb(data, lim, n)
    except DecodeError:
        raise
    except Exception as e:  # msgpack errors, a hook's failure, RecursionError: all mean bad bytes
        raise DecodeError(f"cannot decode wire value: {_why(e)}", bytes(data[:64])) from e
    finally:
        if token is not None:
            _LIMITS.reset(token)


def _unpack_big_array(data: bytes) -> Any:
    """A top-level big ndarray as a zero-copy view of ``data`` itself (immutable bytes), or None.

    None (the general path: msgpack copies the ext data, which is 16-byte aligned) when the view
    would be misaligned for its dtype: the raw bytes sit 6 bytes past a 16-byte boundary here.
    """
    (size,) = _HDR_BE.unpack_from(data, 1)
    if size + 6 != len(data) or not _load_optional("numpy"):
        return None
    arr = _decode_with(_BY_CODE[1], memoryview(data)[6:])  # type: ignore[arg-type]
    return arr if arr.flags.aligned else None


_HDR_BE = struct.Struct(">I")


# ---------------------------------------------------------------- built-in codecs (stdlib)

for _codec in stdtypes.builtin_codecs(_pack_items, unpack):
    _add(_codec)
# Only ints beyond 64 bits reach the codec (msgpack packs the rest); the type slot is int's own.
_BY_CODE[19] = stdtypes.BIGINT


def _bigint(i: int) -> Any:
    """``i`` itself when msgpack packs it (an int subclass reaches here), else the ext of code 19."""
    return i if -(2**63) <= i < 2**64 else _ext(19, stdtypes.int_encode(i))


def _add_all(codecs: list[Codec]) -> None:
    for codec in codecs:
        _add(codec)


# ---------------------------------------------------------------- optional libraries


def _load_optional(root: str) -> bool:
    """Register the codecs of numpy / torch / PIL (and of uuid / decimal / pathlib) on first use;
    False when the library is not installed."""
    done = _LOADED.get(root)
    if done is not None:
        return done
    try:
        _LOADERS[root]()
        ok = True
    except ImportError:
        _logger().debug("%s is not installed: its ext codes pass through as msgpack.ExtType", root)
        ok = False
    _LOADED[root] = ok
    return ok


# numpy / torch / PIL live in .arrays, imported (like the library itself) on first use.
def _register_numpy() -> None:
    global _ARRAY_PARTS
    from . import arrays

    codecs, _ARRAY_PARTS = arrays.numpy_codecs()
    for codec in codecs:
        _add(codec)


def _register_torch() -> None:
    from . import arrays

    _add(arrays.torch_codec())


def _register_pil() -> None:
    from . import arrays

    _add(arrays.pil_codec())


_LOADERS: dict[str, Callable[[], None]] = {
    "numpy": _register_numpy,
    "torch": _register_torch,
    "PIL": _register_pil,
    "uuid": lambda: _add_all(stdtypes.uuid_codecs()),
    "decimal": lambda: _add_all(stdtypes.decimal_codecs()),
    "pathlib": lambda: _add_all(stdtypes.pathlib_codecs()),
}
