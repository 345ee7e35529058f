"""The Envelope (one remote invocation) and function transport with its worker-side gates.

An :class:`Envelope` is packed as a plain msgpack map: ``args`` and ``kwargs`` stay pre-packed
``bin`` values (``wire.pack(list(args))`` / ``wire.pack(dict(kwargs))``), so :meth:`Envelope.header`
can read the routing fields without touching user values. Unknown top-level keys and unknown ``cfg``
keys survive a round trip, so additive changes do not need a version bump; a ``v`` newer than
:data:`WIRE_VERSION` is refused with the fix in the message. A ``prefix`` that is absent or nil (a
peer with no ``scope``) reads as ``""``, no prefix.

``fn`` is a tagged union: ``{"kind": "ref", module, qualname, src_hash}`` for importable functions,
``{"kind": "pickle", blob, hash, source, qualname, where, runtime}`` for everything else
(:func:`fn_for`). On the worker, :func:`resolve_fn` applies the gates in order: allow_pickled,
runtime policy (before any unpickle) plus the blob hash, then the ``src_hash`` staleness check.

cloudpickle is imported only to pickle or unpickle; ``inspect`` only to show source or to hash a
source the fast path below cannot; ``hashlib`` only where the small built-in sha256 is missing. No
``typing`` or ``dataclasses`` at runtime: every invocation's entry imports this module. This module
is part of the entry bundle, so it must stay importable on Python 3.9.
"""

from __future__ import annotations

import sys

import msgpack

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import (
    EnvelopeError,
    PickleRefused,
    RuntimeMismatch,
    StaleSource,
    TransportError,
    VersionError,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Mapping, Sequence

    FnRecord = Dict[str, Any]

__all__ = [
    "INLINE_PICKLE_LIMIT",
    "RUNTIME_POLICIES",
    "TRANSPORTS",
    "WIRE_VERSION",
    "Envelope",
    "check_fn",
    "check_runtime",
    "fn_for",
    "is_pickled",
    "resolve_fn",
    "runtime_info",
    "src_hash",
]

WIRE_VERSION = 1
INLINE_PICKLE_LIMIT = 32 * 1024
RUNTIME_POLICIES = ("strict", "minor", "off")
TRANSPORTS = ("auto", "ref", "pickle")

_FIELDS = ("v", "id", "fn", "args", "kwargs", "prefix", "key", "cfg", "parent")
_USER_VALUES = frozenset(("args", "kwargs"))


class Envelope:
    """One remote invocation. ``extra`` holds top-level keys from a newer writer, kept verbatim.

    A plain class with what ``@dataclass`` gave it (``__init__``, ``__repr__`` without ``extra``,
    ``__eq__`` over every field): dataclasses imports inspect, which the entry should not pay for.
    ``cfg`` and ``extra`` default to a fresh dict each.
    """

    __match_args__ = ("id", "fn", "args", "kwargs", "prefix", "key", "cfg", "parent", "v", "extra")
    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value: as the dataclass was

    def __init__(
        self,
        id: str,
        fn: FnRecord,
        args: bytes,
        kwargs: bytes,
        prefix: str = "",
        key: str | None = None,
        cfg: Dict[str, Any] | None = None,
        parent: str | None = None,
        v: int = WIRE_VERSION,
        extra: Dict[str, Any] | None = None,
    ) -> None:
        self.id = id
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.prefix = prefix
        self.key = key
        self.cfg: Dict[str, Any] = {} if cfg is None else cfg
        self.parent = parent
        self.v = v
        self.extra: Dict[str, Any] = {} if extra is None else extra

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__match_args__)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Envelope)
        return self._values() == other._values()

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__match_args__[:-1])
        return f"{type(self).__qualname__}({shown})"

    @classmethod
    def create(
        cls,
        fn: FnRecord,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        prefix: str = "",
        key: str | None = None,
        cfg: Dict[str, Any] | None = None,
        parent: str | None = None,
    ) -> Envelope:
        """A new Envelope with a fresh ULID; ``args`` / ``kwargs`` are packed with ``wire.pack``."""
        from dreamlake.lakeshore import wire

        return cls(
            id=ids.new_ulid(),
            fn=check_fn(fn),
            args=wire.pack(list(args)),
            kwargs=wire.pack(dict(kwargs or {})),
            prefix=prefix,
            key=key,
            cfg=dict(cfg or {}),
            parent=parent,
        )

    def unpack_args(self) -> tuple[list[Any], dict[str, Any]]:
        """Decode ``args`` and ``kwargs`` with the value codec."""
        from dreamlake.lakeshore import wire

        # The Envelope's own size bounded these already (MAX_PAYLOAD_BYTES when it came by reference)
        args = wire.unpack(self.args, limits=wire.limits_for(self.args))
        kwargs = wire.unpack(self.kwargs, limits=wire.limits_for(self.kwargs))
        if not isinstance(args, list):
            raise EnvelopeError(f"envelope {self.id}: args must pack a list, got {type(args).__name__}")
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise EnvelopeError(f"envelope {self.id}: kwargs must pack a dict with str keys")
        return args, kwargs

    def to_bytes(self) -> bytes:
        """The Envelope as a msgpack map (args/kwargs as bin, extra keys after the known ones)."""
        if len(self.args) + len(self.kwargs) >= _PARTS_FROM:
            return b"".join(self.to_parts())
        return self._packed()

    def to_parts(self) -> list[bytes]:
        """:meth:`to_bytes` as pieces whose concatenation is those bytes, with ``args`` and
        ``kwargs`` themselves among them, not copied: a big Envelope streams to the payload store
        without a second copy of its arguments in memory."""
        body = self._body()
        parts: list[bytes] = [msgpack.Packer().pack_map_header(len(body))]
        try:
            for name, value in body.items():
                parts.append(msgpack.packb(name, use_bin_type=True))
                if name in _USER_VALUES:
                    parts += [_bin_header(len(value)), value]
                else:
                    parts.append(msgpack.packb(value, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as exc:
            raise EnvelopeError(
                f"envelope {self.id}: cannot pack ({exc}); fn and cfg must hold msgpack-native values"
            ) from exc
        return parts

    def _packed(self) -> bytes:
        body = self._body()
        try:
            return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]
        except (TypeError, ValueError, OverflowError) as exc:
            raise EnvelopeError(
                f"envelope {self.id}: cannot pack ({exc}); fn and cfg must hold msgpack-native values"
            ) from exc

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "v": self.v,
            "id": self.id,
            "fn": self.fn,
            "args": bytes(self.args),
            "kwargs": bytes(self.kwargs),
            "prefix": self.prefix,
            "key": self.key,
            "cfg": self.cfg,
            "parent": self.parent,
        }
        for name, value in self.extra.items():
            if name not in body:
                body[name] = value
        return body

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Envelope:
        """Decode and validate an Envelope; raises :class:`EnvelopeError` / :class:`VersionError`."""
        fields = _validate(_read_map(data, skip_user_values=False))
        extra = {k: v for k, v in fields.items() if k not in _FIELDS}
        return cls(
            id=fields["id"],
            fn=fields["fn"],
            args=fields["args"],
            kwargs=fields["kwargs"],
            prefix=fields["prefix"],
            key=fields["key"],
            cfg=fields["cfg"],
            parent=fields["parent"],
            v=fields["v"],
            extra=extra,
        )

    @staticmethod
    def header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """The validated Envelope without ``args`` / ``kwargs``, which are skipped, not decoded."""
        fields = _validate(_read_map(data, skip_user_values=True))
        for name in _USER_VALUES:
            fields.pop(name, None)
        return fields


_PARTS_FROM = 1 << 20  # arguments this large are joined from parts: one copy, not two


def _bin_header(n: int) -> bytes:
    """msgpack's (minimal) header of a bin of ``n`` bytes, as the packer writes it."""
    if n < 0x100:
        return bytes((0xC4, n))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


_BIN_HEADERS = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin 8/16/32: the width of the length
_MAP_HEADERS = {0xDE: 2, 0xDF: 4}  # map 16/32
_WINDOW = 64 * 1024


def _unpack_at(view: memoryview, pos: int) -> tuple[Any, int]:
    """One msgpack object at ``pos`` of ``view`` and the position after it, decoding only a window
    of the buffer (grown until the object fits), never the whole of it."""
    window = _WINDOW
    while True:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(window, 1))
        unpacker.feed(view[pos : pos + window])
        try:
            return unpacker.unpack(), pos + unpacker.tell()
        except msgpack.OutOfData:
            if pos + window >= len(view):
                raise
            window *= 4


def _skip_bin(view: memoryview, pos: int) -> int | None:
    """The position after the bin object at ``pos`` (its length read off its header), or None when
    the object there is not a bin."""
    width = _BIN_HEADERS.get(view[pos]) if pos < len(view) else None
    if width is None:
        return None
    end = pos + 1 + width
    if end > len(view):
        raise msgpack.OutOfData
    length = int.from_bytes(view[pos + 1 : end], "big")
    if end + length > len(view):
        raise msgpack.OutOfData
    return end + length


def _read_header_map(
    data: bytes | bytearray | memoryview, *, keep_user_values: bool = False
) -> dict[str, Any]:
    """The Envelope's fields with ``args`` / ``kwargs`` skipped by their bin headers: a header of a
    big Envelope (a memory map of a staged file, say) costs its small fields, not a copy of it.
    With ``keep_user_values`` they are copied out once each (a full decode: no buffer copy)."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    if len(view) <= _WINDOW:  # small: one decode (of what a field-by-field read decodes anyway)
        small = _read_small_map(view, keep_user_values)
        if small is not None:
            return small
    out: dict[str, Any] = {}
    try:
        if not len(view):
            raise msgpack.OutOfData
        first = view[0]
        if 0x80 <= first <= 0x8F:
            size, pos = first & 0x0F, 1
        elif first in _MAP_HEADERS:
            pos = 1 + _MAP_HEADERS[first]
            if pos > len(view):
                raise msgpack.OutOfData
            size = int.from_bytes(view[1:pos], "big")
        else:
            raise EnvelopeError("not an Envelope (expected a msgpack map)")
        for _ in range(size):
            name, pos = _unpack_at(view, pos)
            if not isinstance(name, str):
                raise EnvelopeError(f"envelope keys are strings, got {type(name).__name__}")
            after = _skip_bin(view, pos) if name in _USER_VALUES else None
            if after is not None:
                start = pos + 1 + _BIN_HEADERS[view[pos]]  # the bin's bytes, past its header
                out[name] = bytes(view[start:after]) if keep_user_values else b""
                pos = after
            else:
                out[name], pos = _unpack_at(view, pos)
    except EnvelopeError:
        raise
    except msgpack.OutOfData as exc:
        raise EnvelopeError(f"truncated Envelope ({len(view)} bytes)") from exc
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise EnvelopeError(f"not an Envelope (expected a msgpack map): {exc}") from exc
    if pos != len(view):
        raise EnvelopeError(f"trailing bytes after the Envelope map ({len(view)} bytes in all)")
    return out


def _read_small_map(view: memoryview, keep_user_values: bool) -> dict[str, Any] | None:
    """:func:`_read_header_map` of an Envelope of at most :data:`_WINDOW` bytes, in one decode
    (one unpacker instead of one per field); None for anything but a well-formed map of string
    keys, whose error the field-by-field reader then names (the same words as for a big one)."""
    if not len(view) or not (0x80 <= view[0] <= 0x8F or view[0] in _MAP_HEADERS):
        return None
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(view))
    try:
        unpacker.feed(view)
        out: dict[str, Any] = unpacker.unpack()
    except Exception:  # msgpack raises several unrelated types on bad input
        return None
    if unpacker.tell() != len(view) or not all(isinstance(name, str) for name in out):
        return None
    if not keep_user_values:
        for name in _USER_VALUES:
            if type(out.get(name)) is bytes:
                out[name] = b""
    return out


def _read_map(data: bytes | bytearray | memoryview, *, skip_user_values: bool) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise EnvelopeError(f"an Envelope is bytes, got {type(data).__name__}")
    return _read_header_map(data, keep_user_values=not skip_user_values)


def _validate(fields: dict[str, Any]) -> dict[str, Any]:
    v = fields.get("v")
    if type(v) is not int or v < 1:
        raise EnvelopeError(f"envelope field 'v' must be a positive int, got {v!r}")
    if v > WIRE_VERSION:
        raise VersionError(
            f"Envelope wire version {v} is newer than this reader's ({WIRE_VERSION}): "
            "upgrade dreamlake-lakeshore on the reading side (worker or entry bundle)"
        )
    try:
        ids.validate(fields.get("id"), "envelope id")
    except ValueError as exc:
        raise EnvelopeError(str(exc)) from exc
    fn = fields.get("fn")
    if not isinstance(fn, dict):
        raise EnvelopeError(f"envelope field 'fn' must be a map, got {type(fn).__name__}")
    check_fn(fn)
    for name in ("args", "kwargs"):
        if not isinstance(fields.get(name), bytes):
            raise EnvelopeError(f"envelope field {name!r} must be bin (pre-packed by wire.pack)")
    if fields.get("prefix") is None:  # absent, or nil from a peer with no scope: no prefix
        fields["prefix"] = ""
    fields.setdefault("key", None)
    fields.setdefault("cfg", {})
    fields.setdefault("parent", None)
    _expect(fields, "prefix", (str,))
    _expect(fields, "key", (str, type(None)))
    _expect(fields, "cfg", (dict,))
    _expect(fields, "parent", (str, type(None)))
    return fields


def _expect(record: Mapping[str, Any], name: str, types: tuple[type, ...], what: str = "envelope") -> None:
    value = record.get(name)
    if not isinstance(value, types):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise EnvelopeError(f"{what} field {name!r} must be {names}, got {type(value).__name__}")


def check_fn(fn: Any) -> FnRecord:
    """Validate a ``fn`` record (either arm); unknown keys pass. Returns it unchanged."""
    if not isinstance(fn, dict):
        raise EnvelopeError(f"fn must be a map, got {type(fn).__name__}")
    kind = fn.get("kind")
    if kind == "ref":
        _expect(fn, "module", (str,), "fn")
        _expect(fn, "qualname", (str,), "fn")
        if not fn["module"] or not fn["qualname"]:
            raise EnvelopeError("fn 'module' and 'qualname' must not be empty")
        if fn.get("src_hash") is not None:
            _expect(fn, "src_hash", (str,), "fn")
    elif kind == "pickle":
        _expect(fn, "blob", (bytes,), "fn")
        _expect(fn, "hash", (str,), "fn")
        _expect(fn, "qualname", (str,), "fn")
        _expect(fn, "runtime", (dict,), "fn")
        if not fn["hash"].startswith("sha256:"):
            raise EnvelopeError("fn 'hash' must be 'sha256:<hex>'")
    else:
        raise EnvelopeError(f"fn 'kind' must be 'ref' or 'pickle', got {kind!r}")
    return fn


def is_pickled(fn: Mapping[str, Any]) -> bool:
    """True for the pickle arm of the ``fn`` union."""
    return fn.get("kind") == "pickle"


# --- submitter side -------------------------------------------------------------------------------


def _underlying(obj: Any) -> Any:
    """The user function behind an SDK wrapper (``__lakeshore_fn__``, else the ``__wrapped__`` chain)."""
    inner = getattr(obj, "__lakeshore_fn__", None)
    if inner is not None:
        return inner
    seen = 0
    while hasattr(obj, "__wrapped__") and seen < 100:
        obj = obj.__wrapped__
        seen += 1
    return obj


def _not_importable(obj: Any) -> str | None:
    """Why ``obj`` cannot be shipped by reference, or None when it can."""
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str):
        return f"{type(obj).__name__} instance has no __qualname__ of its own (a callable instance)"
    bound_to = getattr(obj, "__self__", None)
    if bound_to is not None and not isinstance(bound_to, type) and type(bound_to).__name__ != "module":
        return f"{qualname} is a method bound to a {type(bound_to).__name__} instance (it carries state)"
    if "<lambda>" in qualname:
        return f"{qualname} is a lambda"
    if "<locals>" in qualname:
        return f"{qualname} is defined inside a function (<locals> closure)"
    module = getattr(obj, "__module__", None)
    if module is None or module == "__main__":
        return f"{qualname} is defined in __main__, which the worker cannot import"
    return None


def _sha256_hex(data: bytes) -> str:
    """hashlib.sha256(data).hexdigest(), from the small built-in module when there is one: hashlib
    loads OpenSSL, which costs the entry more than the rest of its imports."""
    try:
        from _sha256 import sha256  # Python <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256  # Python >= 3.12
        except ImportError:
            from hashlib import sha256
    return sha256(data).hexdigest()  # type: ignore[no-any-return]


def src_hash(fn: Callable[..., Any]) -> str | None:
    """``"sha256:" + 16 hex`` of the function's source, or None when the source is unavailable."""
    import inspect

    try:
        source = inspect.getsource(_underlying(fn))
    except (OSError, TypeError):
        return None
    return "sha256:" + _sha256_hex(source.encode("utf-8"))[:16]


def _local_src_hash(fn: Callable[..., Any], expected: str) -> str | None:
    """``src_hash(fn)`` for the staleness gate, trying first a slice of the source file that needs
    neither inspect nor tokenize (the entry's start-up): lines from the function's first line (its
    first decorator) to the last line any of its bytecode (nested code included) comes from.

    The slice is trusted only when it hashes to ``expected``; otherwise (it may differ from
    ``inspect.getsource``, e.g. on a trailing comment) ``src_hash`` decides, as it always did. A
    match is sound: the slice holds every line of the function that compiles to code, and equals the
    submitter's source.
    """
    code = getattr(_underlying(fn), "__code__", None)
    key = (code, expected) if code is not None else None
    if key is not None and key in _MATCHED:
        return expected
    local: str | None = None
    fast = _sliced_source(fn)
    if fast is not None:
        local = "sha256:" + _sha256_hex(fast.encode("utf-8"))[:16]
    if local != expected:
        local = src_hash(fn)
    if key is not None and local == expected:
        if len(_MATCHED) >= _MATCHED_MAX:
            _MATCHED.clear()
        _MATCHED.add(key)
    return local


# The loaded functions (by code object) whose source matched a submitter's hash: a long-lived
# worker (``lakeshore worker``, nymph's warm workers) runs the same functions again and again, and
# their loaded code does not change; without it each call read and hashed the file. Mismatches are
# not kept (each is read again: after the reload a StaleSource asks for, the file decides).
_MATCHED: set[tuple[Any, str]] = set()
_MATCHED_MAX = 4096


def _sliced_source(fn: Callable[..., Any]) -> str | None:
    try:
        target = _underlying(fn)
        code = getattr(target, "__code__", None)
        if type(target).__name__ != "function" or code is None:
            return None
        filename = code.co_filename
        if not filename.endswith(".py"):
            return None
        with open(filename, encoding="utf-8") as f:  # universal newlines, as linecache reads it
            lines = f.readlines()
        start = code.co_firstlineno - 1
        if not 0 <= start < len(lines) or not lines[start].lstrip().startswith(("def ", "async ", "@")):
            return None
        last, stack = 0, [code]
        while stack:
            c = stack.pop()
            for _, _, line in c.co_lines():
                if line is not None and line > last:
                    last = line
            for pos in getattr(c, "co_positions", lambda: ())():  # Python >= 3.11
                if pos[1] is not None and pos[1] > last:
                    last = pos[1]
            stack.extend(k for k in c.co_consts if type(k) is type(code))
        if last <= start:
            return None
        if not lines[-1].endswith("\n"):
            lines[-1] += "\n"  # as linecache does
        return "".join(lines[start:last])
    except Exception:  # anything odd: inspect decides
        return None


def fn_for(fn: Callable[..., Any], transport: str = "auto") -> FnRecord:
    """The ``fn`` record for ``fn``: ``auto`` pickles exactly what cannot travel by reference."""
    if transport not in TRANSPORTS:
        raise TransportError(f"unknown transport {transport!r}: use 'auto', 'ref' or 'pickle'")
    if not callable(fn):
        raise TransportError(f"cannot ship {type(fn).__name__} object: it is not callable")
    target = _underlying(fn)
    why = _not_importable(target)
    if transport == "pickle" or (transport == "auto" and why is not None):
        return _pickle_record(target)
    if why is not None:
        raise TransportError(
            f"cannot ship {why} by reference: the worker imports functions by module and qualname. "
            "Move it to module level in an importable module, or use transport='pickle' (or 'auto') "
            "on a worker started with --allow-pickled"
        )
    module, qualname = target.__module__, target.__qualname__
    loaded = sys.modules.get(module)
    if loaded is not None:
        try:
            _getattr_chain(loaded, qualname)
        except AttributeError as exc:
            raise TransportError(
                f"cannot ship {module}.{qualname} by reference: the module has no attribute at that "
                "qualname (was the name rebound or deleted?). Keep the function reachable under its "
                "own name, or use transport='pickle'"
            ) from exc
    return {"kind": "ref", "module": module, "qualname": qualname, "src_hash": src_hash(target)}


def runtime_info() -> dict[str, Any]:
    """The runtime record a pickle carries: python, impl, cloudpickle, pickle_protocol, platform."""
    import platform

    import cloudpickle

    return {
        "python": platform.python_version(),
        "impl": sys.implementation.name,
        "cloudpickle": cloudpickle.__version__,
        "pickle_protocol": cloudpickle.DEFAULT_PROTOCOL,
        "platform": f"{sys.platform}-{platform.machine()}",
    }


def _pickle_record(obj: Any) -> FnRecord:
    import inspect

    import cloudpickle

    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str):
        qualname = type(obj).__qualname__
    source: str | None = None
    where = f"{qualname} (<unknown>)"
    for candidate in (obj, type(obj)):
        try:
            source = inspect.getsource(candidate)
            lines = inspect.getsourcelines(candidate)[1]
            where = f"{qualname} ({inspect.getsourcefile(candidate)}:{lines})"
            break
        except (OSError, TypeError):
            continue
    runtime = runtime_info()
    try:
        blob = cloudpickle.dumps(obj, protocol=runtime["pickle_protocol"])
    except Exception as exc:
        raise TransportError(
            f"cannot pickle {where}: {exc}. Pass unpicklable state (locks, sockets, clients) as "
            "arguments or build it inside the function"
        ) from exc
    if len(blob) > INLINE_PICKLE_LIMIT:
        raise TransportError(
            f"pickled {where} is {len(blob)} bytes, over the {INLINE_PICKLE_LIMIT}-byte (32 KiB) inline "
            "limit: that is captured state (closure variables, globals or defaults the function drags "
            "along). Pass the data as arguments instead"
        )
    return {
        "kind": "pickle",
        "blob": blob,
        "hash": "sha256:" + _sha256_hex(blob),
        "source": source,
        "qualname": qualname,
        "where": where,
        "runtime": runtime,
    }


# --- worker side ----------------------------------------------------------------------------------


def _getattr_chain(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def check_runtime(runtime: Mapping[str, Any], policy: str = "minor") -> None:
    """Refuse a pickle whose runtime differs from this one beyond ``policy`` (strict | minor | off)."""
    if policy not in RUNTIME_POLICIES:
        raise ValueError(f"unknown runtime policy {policy!r}: use 'strict', 'minor' or 'off'")
    if policy == "off":
        return
    from collections.abc import Mapping

    if not isinstance(runtime, Mapping):
        raise RuntimeMismatch("the pickled function carries no runtime record; re-submit it")
    try:
        import cloudpickle
    except ImportError as exc:
        blocked = unreadable_path()
        if blocked:  # not a missing package: this process cannot read where it is
            raise RuntimeMismatch(
                f"cloudpickle cannot be imported: {blocked}; give the task user an interpreter and "
                "PYTHONPATH it can read (nymph start checks this: run `nymph doctor`)"
            ) from exc
        raise RuntimeMismatch(
            "cloudpickle is not installed in this runtime, so a pickled function cannot run here: "
            "install cloudpickle or put the lakeshore entry bundle on PYTHONPATH"
        ) from exc
    theirs_py, theirs_cp = str(runtime.get("python", "?")), str(runtime.get("cloudpickle", "?"))
    theirs_impl = str(runtime.get("impl", sys.implementation.name))
    mine_py = ".".join(str(n) for n in sys.version_info[:3])
    mine_cp = str(cloudpickle.__version__)
    if policy == "strict":
        same = theirs_py == mine_py and theirs_cp == mine_cp
        need = "the exact python and cloudpickle versions"
    else:
        same = _parts(theirs_py, 2) == _parts(mine_py, 2) and _parts(theirs_cp, 1) == _parts(mine_cp, 1)
        need = "the same python major.minor and cloudpickle major version"
    if not same or theirs_impl != sys.implementation.name:
        raise RuntimeMismatch(
            f"function pickled under {theirs_impl} {theirs_py} / cloudpickle {theirs_cp}, but this worker "
            f"runs {sys.implementation.name} {mine_py} / cloudpickle {mine_cp}; runtime policy {policy!r} "
            f"requires {need}. Run a matching runtime, ship the function by ref, or relax the policy "
            "(LAKESHORE_RUNTIME_POLICY=minor|off)"
        )


def _parts(version: str, n: int) -> tuple[str, ...]:
    return tuple(version.split(".")[:n])


def resolve_fn(
    fn: Mapping[str, Any], *, allow_pickled: bool, runtime_policy: str = "minor"
) -> Callable[..., Any]:
    """The callable for ``fn`` after the gates: allow_pickled, runtime + hash, src_hash staleness."""
    if runtime_policy not in RUNTIME_POLICIES:
        raise ValueError(f"unknown runtime policy {runtime_policy!r}: use 'strict', 'minor' or 'off'")
    record = check_fn(dict(fn))
    if record["kind"] == "pickle":
        return _unpickle(record, allow_pickled=allow_pickled, policy=runtime_policy)
    return _resolve_ref(record, policy=runtime_policy)


def _unpickle(record: FnRecord, *, allow_pickled: bool, policy: str) -> Callable[..., Any]:
    where = record.get("where") or record["qualname"]
    if not allow_pickled:
        raise PickleRefused(
            f"refusing pickled function {where}: unpickling runs arbitrary code from the submitter. "
            "Start the worker with --allow-pickled (LAKESHORE_ALLOW_PICKLED=1) if it trusts the "
            "submitter, or ship the function by ref (an importable module-level function)"
        )
    check_runtime(record["runtime"], policy)
    digest = "sha256:" + _sha256_hex(record["blob"])
    if digest != record["hash"]:
        raise EnvelopeError(f"pickled function {where}: blob hash {digest} does not match {record['hash']}")
    import cloudpickle

    try:
        obj = cloudpickle.loads(record["blob"])
    except Exception as exc:
        raise EnvelopeError(f"cannot unpickle {where}: {type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise EnvelopeError(f"pickled function {where} unpickled to a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


def unreadable_path() -> str | None:
    """What of this process's ``sys.path`` it cannot read (a directory its user may not enter or
    list, e.g. an interpreter under a 0700 home run by another user), said as a sentence; None when
    all of it is readable. An import that fails for that reason is not a missing package."""
    import os

    for entry in sys.path:
        if not entry:
            continue
        try:
            st = os.stat(entry)
        except FileNotFoundError:
            continue
        except PermissionError:
            return (
                f"uid {os.getuid()} cannot reach {entry} on sys.path (a directory on the way is closed to it)"
            )
        except OSError:
            continue
        import stat as _stat

        need = os.R_OK | os.X_OK if _stat.S_ISDIR(st.st_mode) else os.R_OK
        if not os.access(entry, need):
            return f"uid {os.getuid()} cannot read {entry} on sys.path"
    return None


def _shipped(module: Any) -> bool:
    """Whether ``module`` was imported from a code archive shipped with the call (LAKESHORE_CODE_PATH)."""
    import os

    from dreamlake.lakeshore import envvars

    file = getattr(module, "__file__", None) or ""
    dirs = [d for d in (envvars.string("LAKESHORE_CODE_PATH") or "").split(os.pathsep) if d]
    return any(file.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def _resolve_ref(record: FnRecord, *, policy: str) -> Callable[..., Any]:
    import importlib

    module_name, qualname = record["module"], record["qualname"]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise
        blocked = unreadable_path()
        why = (
            f"{blocked}, so the module may be there and unreadable; give the task user an interpreter "
            "and PYTHONPATH it can read (nymph start checks this: run `nymph doctor`)"
            if blocked
            else "the function's module must be importable in the worker's runtime (install it or add "
            "it to PYTHONPATH)"
        )
        raise EnvelopeError(
            f"cannot import module {module_name!r} for {module_name}.{qualname}: {why}"
        ) from exc
    try:
        obj = _getattr_chain(module, qualname)
    except AttributeError as exc:
        raise EnvelopeError(
            f"module {module_name!r} has no attribute {qualname!r}: deploy the same code on the worker "
            "as on the submitter"
        ) from exc
    inner = getattr(obj, "__lakeshore_fn__", None)
    if inner is not None:
        obj = inner
    if not callable(obj):
        raise EnvelopeError(f"{module_name}.{qualname} is a {type(obj).__name__}, not a callable")
    expected = record.get("src_hash")
    if expected and policy != "off":
        local = _local_src_hash(obj, expected)
        if local is not None and local != expected:
            if _shipped(module):
                raise StaleSource(
                    f"{module_name}.{qualname}: the code shipped with the call hashes to {local} but the "
                    f"function the submitter had loaded to {expected}: the file changed after it was "
                    "imported. Reload the module (importlib.reload, or restart the kernel) after editing it"
                )
            raise StaleSource(
                f"{module_name}.{qualname}: the worker's source hashes to {local} but the submitter's "
                f"to {expected}, so the worker would run different code. Deploy the same code on both "
                "sides (or set the runtime policy to 'off' to skip this check)"
            )
    return obj  # type: ignore[no-any-return]
