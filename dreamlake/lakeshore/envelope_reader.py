"""Reading an Envelope's msgpack map without decoding its arguments.

An Envelope is a msgpack map whose ``args`` and ``kwargs`` are pre-packed ``bin`` values. A
header read (:func:`read_map` with ``skip_user_values``) skips them by their bin headers: a big
Envelope (a memory map of a staged file, say) costs its small fields, not a copy of it. An
Envelope of at most :data:`_WINDOW` bytes is decoded in one go; a bigger one field by field, each
field decoded from a window of the buffer (:func:`_unpack_at`). Every malformed input is an
:class:`~dreamlake.lakeshore.errors.EnvelopeError` with the same words either way.
"""

from __future__ import annotations

import msgpack

from dreamlake.lakeshore.errors import EnvelopeError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

USER_VALUES = frozenset(("args", "kwargs"))  # pre-packed bin values: the user's arguments

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
            after = _skip_bin(view, pos) if name in USER_VALUES else None
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


def _read_small_map(view: bytes | memoryview, keep_user_values: bool) -> dict[str, Any] | None:
    """:func:`_read_header_map` of an Envelope of at most :data:`_WINDOW` bytes, in one decode
    (one unpacker instead of one per field); None for anything but a well-formed map of string
    keys, whose error the field-by-field reader then names (the same words as for a big one)."""
    if not len(view) or not (0x80 <= view[0] <= 0x8F or view[0] in _MAP_HEADERS):
        return None
    try:  # every length bounded by the buffer's, as an Unpacker of max_buffer_size=len(view) does
        out: dict[str, Any] = msgpack.unpackb(view, raw=False, strict_map_key=True)
    except Exception:  # bad input, trailing bytes (ExtraData): msgpack raises several unrelated types
        return None
    for name in out:
        if type(name) is not str:  # a bin key (strict_map_key lets str and bytes through)
            return None
    if not keep_user_values:
        for name in USER_VALUES:
            if type(out.get(name)) is bytes:
                out[name] = b""
    return out


def read_map(data: bytes | bytearray | memoryview, *, skip_user_values: bool) -> dict[str, Any]:
    if type(data) is bytes and len(data) <= _WINDOW:  # small bytes (a warm worker's every call): as they are
        small = _read_small_map(data, not skip_user_values)
        if small is not None:
            return small
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        raise EnvelopeError(f"an Envelope is bytes, got {type(data).__name__}")
    return _read_header_map(data, keep_user_values=not skip_user_values)
