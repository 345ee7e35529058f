"""The Envelope: one remote invocation, as bytes.

An :class:`Envelope` is packed as a plain msgpack map: ``args`` and ``kwargs`` stay pre-packed
``bin`` values (``wire.pack(list(args))`` / ``wire.pack(dict(kwargs))``), so :meth:`Envelope.header`
can read the routing fields without touching user values (:mod:`dreamlake.lakeshore.envelope_reader`).
Unknown top-level keys and unknown ``cfg`` keys survive a round trip, so additive changes do not
need a version bump; a ``v`` newer than :data:`WIRE_VERSION` is refused with the fix in the
message. A ``prefix`` that is absent or nil (a peer with no ``scope``) reads as ``""``, no prefix.

``fn`` is a tagged union (:mod:`dreamlake.lakeshore.fn_record`): ``{"kind": "ref", module,
qualname, src_hash}`` for importable functions, ``{"kind": "pickle", blob, hash, source, qualname,
where, runtime}`` for everything else. The submitter makes it with :func:`fn_for`
(:mod:`dreamlake.lakeshore.fn_transport`); on the worker, :func:`resolve_fn` applies the gates in
order (:mod:`dreamlake.lakeshore.fn_gates`): allow_pickled, runtime policy (before any unpickle)
plus the blob hash, then the ``src_hash`` staleness check. Their public names are importable from
here too.

No ``typing`` or ``dataclasses`` at runtime: every invocation's entry imports this module. This
module is part of the entry bundle, so it must stay importable on Python 3.9.
"""

from __future__ import annotations

import msgpack

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.envelope_reader import USER_VALUES, read_map
from dreamlake.lakeshore.errors import EnvelopeError, VersionError
from dreamlake.lakeshore.fn_gates import RUNTIME_POLICIES, check_runtime, resolve_fn, unreadable_path
from dreamlake.lakeshore.fn_record import _expect, check_fn, is_pickled, src_hash
from dreamlake.lakeshore.fn_record import _underlying as _underlying  # codeship.py imports it from here
from dreamlake.lakeshore.fn_transport import INLINE_PICKLE_LIMIT, TRANSPORTS, fn_for, runtime_info

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Mapping, Sequence

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
    "unreadable_path",
]

WIRE_VERSION = 1

_FIELDS = ("v", "id", "fn", "args", "kwargs", "prefix", "key", "cfg", "parent")
_USER_VALUES = USER_VALUES


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
        # The Envelope's own size bounded these already (MAX_PAYLOAD_BYTES when it came by reference)
        # No arguments (an empty array, an empty map) are what the codec would decode them to.
        a, k = self.args, self.kwargs
        from dreamlake.lakeshore import wire

        args = [] if a == _NO_ARGS else wire.unpack(a, limits=wire.limits_for(a))
        kwargs = {} if k == _NO_KWARGS else wire.unpack(k, limits=wire.limits_for(k))
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

    def pieces(self) -> list[bytes]:
        """:meth:`to_bytes` as pieces to send or upload: a big Envelope's :meth:`to_parts` (its
        arguments not copied), a small one's bytes as one piece (one msgpack call, not one per field)."""
        if len(self.args) + len(self.kwargs) >= _PARTS_FROM:
            return self.to_parts()
        return [self._packed()]

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
        fields = _validate(read_map(data, skip_user_values=False))
        # _validate leaves every known field in ``fields``: any more are a newer writer's
        extra = {k: v for k, v in fields.items() if k not in _FIELDS} if len(fields) > len(_FIELDS) else {}
        # id, fn, args, kwargs, prefix, key, cfg, parent, v, extra (positional: one call, no keywords)
        return cls(
            fields["id"],
            fields["fn"],
            fields["args"],
            fields["kwargs"],
            fields["prefix"],
            fields["key"],
            fields["cfg"],
            fields["parent"],
            fields["v"],
            extra,
        )

    @staticmethod
    def header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """The validated Envelope without ``args`` / ``kwargs``, which are skipped, not decoded."""
        fields = _validate(read_map(data, skip_user_values=True))
        for name in _USER_VALUES:
            fields.pop(name, None)
        return fields


_PARTS_FROM = 1 << 20  # arguments this large are joined from parts: one copy, not two
_NO_ARGS = b"\x90"  # wire.pack([])
_NO_KWARGS = b"\x80"  # wire.pack({})


def _bin_header(n: int) -> bytes:
    """msgpack's (minimal) header of a bin of ``n`` bytes, as the packer writes it."""
    if n < 0x100:
        return bytes((0xC4, n))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _validate(fields: dict[str, Any]) -> dict[str, Any]:
    v = fields.get("v")
    if type(v) is not int or v < 1:
        raise EnvelopeError(f"envelope field 'v' must be a positive int, got {v!r}")
    if v > WIRE_VERSION:
        raise VersionError(
            f"Envelope wire version {v} is newer than this reader's ({WIRE_VERSION}): "
            "upgrade dreamlake-lakeshore on the reading side (worker or entry bundle)"
        )
    if not ids.is_ulid(fields.get("id")):
        try:
            ids.validate(fields.get("id"), "envelope id")
        except ValueError as exc:
            raise EnvelopeError(str(exc)) from exc
    fn = fields.get("fn")
    if not isinstance(fn, dict):
        raise EnvelopeError(f"envelope field 'fn' must be a map, got {type(fn).__name__}")
    check_fn(fn)
    if not (isinstance(fields.get("args"), bytes) and isinstance(fields.get("kwargs"), bytes)):
        for name in ("args", "kwargs"):
            if not isinstance(fields.get(name), bytes):
                raise EnvelopeError(f"envelope field {name!r} must be bin (pre-packed by wire.pack)")
    if fields.get("prefix") is None:  # absent, or nil from a peer with no scope: no prefix
        fields["prefix"] = ""
    key = fields.setdefault("key", None)
    cfg = fields.setdefault("cfg", {})
    parent = fields.setdefault("parent", None)
    if not (
        isinstance(fields["prefix"], str)
        and (key is None or isinstance(key, str))
        and isinstance(cfg, dict)
        and (parent is None or isinstance(parent, str))
    ):  # one of them is wrong: the checks in order, for the first one's error
        _expect(fields, "prefix", (str,))
        _expect(fields, "key", (str, type(None)))
        _expect(fields, "cfg", (dict,))
        _expect(fields, "parent", (str, type(None)))
    return fields
