"""Structural checks of what the entry leaves, before nymph acks it (issue 32, item 1).

The entry writes ``result.msgpack`` and ``error.json`` to a temporary name, fsyncs and renames
them, but a host that lost power, a disk that returned garbage or a task that wrote the files
itself can still leave a damaged one. An ack of such a file as ``succeeded`` would hand the
caller a ``DecodeError`` for ever (the call is never retried), so nymph checks first:

- :func:`result_damage`: the bytes are exactly one msgpack value (not truncated, no reserved
  byte, nothing after it). Only the structure is walked (headers, lengths); user values are not
  decoded, ext data (arrays, tensors) not looked at: C-fast for a result held in memory
  (``msgpack.Unpacker.skip``), a walk over a memory map for one left on disk.
- the result's digest: an entry that writes one leaves ``result.digest`` beside the result
  (``"blake2b-256 <hex> <size>"`` of its exact bytes, published before it); :func:`result_damage`
  and :func:`result_file_damage` given that record also compare the bytes with it, so a byte
  changed between the entry and nymph inside a value (an int's digit, a string no longer UTF-8:
  still well-formed msgpack) is caught too. An entry from before the digest writes none; nymph
  cannot tell which entry version a runner ran (its runtime and ``PYTHONPATH`` are the runner's),
  so a result with no ``result.digest`` gets the structural check alone, as before.
- :func:`error_damage`: ``error.json`` parses as a JSON object with a ``type``.

Each returns None for a sound output, else what is wrong, in words, for the ``DamagedOutput``
failure nymph reports instead (retried by default, as a crash is: store/retry.py ``CRASHES``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from typing import Any, BinaryIO

import msgpack

DAMAGED = "DamagedOutput"  # the error type of an ack whose output was damaged
# The entry's record of the result's bytes (dreamlake/lakeshore/daemon/entry_outputs.py)
RESULT_DIGEST = "result.digest"
DIGEST_KIND = "blake2b-256"
DIGEST_MAX_BYTES = 256  # the record is under 100 bytes; more is not one
_DIGEST_RECORD = re.compile(re.escape(DIGEST_KIND.encode()) + rb" ([0-9a-f]{64}) (0|[1-9][0-9]{0,19})\n")


def result_damage(data: bytes | bytearray | memoryview, digest: bytes | None = None) -> str | None:
    """None when ``data`` is one whole msgpack value (and matches ``digest``, the entry's
    ``result.digest`` record, when there is one), else what is wrong with it."""
    damage = _structure_damage(data)
    if damage is None and digest is not None:
        damage = digest_damage(digest, data)
    return damage


def _structure_damage(data: bytes | bytearray | memoryview) -> str | None:
    size = len(data)
    if size == 0:
        return "it is empty"
    unpacker = msgpack.Unpacker(max_buffer_size=size)
    unpacker.feed(data)
    try:
        unpacker.skip()
    except msgpack.OutOfData:
        return f"it is truncated (its {size} bytes end inside a value)"
    except (ValueError, msgpack.UnpackException) as exc:  # FormatError, StackError
        return f"it is not msgpack ({type(exc).__name__} {exc})".replace(" )", ")")
    end = unpacker.tell()
    if end != size:
        return f"it has {size - end} bytes of garbage after its value (of {end} bytes)"
    return None


def result_file_damage(fh: BinaryIO, digest: bytes | None = None) -> str | None:
    """:func:`result_damage` for a result left on disk (over the inline threshold): the structure
    is walked, and the digest computed, over a memory map, so the file never enters memory."""
    size = os.fstat(fh.fileno()).st_size
    if size == 0:
        return "it is empty"
    with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        damage = _walk(buf, size)
        if damage is None and digest is not None:
            damage = digest_damage(digest, buf)
        return damage


def digest_damage(record: bytes, data: Any) -> str | None:
    """None when ``data`` (a buffer) is what the entry's ``result.digest`` ``record`` says it
    wrote, else what differs: the bytes were changed after the entry wrote them."""
    match = _DIGEST_RECORD.fullmatch(record)
    if match is None:
        shown = record[:100].decode("ascii", "replace")
        return (
            f"its digest record ({RESULT_DIGEST}) is damaged ({shown!r} is not "
            f"'{DIGEST_KIND} <64 hex digits> <size>'), so its bytes cannot be checked"
        )
    hexdigest, expected = match.group(1).decode(), int(match.group(2))
    got = len(data)
    why = "it was changed between the entry writing it and nymph reading it"
    if got != expected:
        return f"it holds {got} bytes, not the {expected} the entry wrote ({RESULT_DIGEST}): {why}"
    if hashlib.blake2b(data, digest_size=32).hexdigest() != hexdigest:
        return f"its bytes do not match the {DIGEST_KIND} digest the entry wrote ({RESULT_DIGEST}): {why}"
    return None


# Bytes after a header byte, for the fixed-size kinds: floats, ints, fixext (type byte + data).
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_FIXED.update({0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17})
# Kinds with a length: header byte -> (length bytes, bytes before the payload after the length)
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}
_SIZED.update({0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)})
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # -> (count bytes, items per count)
_UINT = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


def _walk(buf: Any, size: int) -> str | None:
    """Skip one msgpack value from the start of ``buf`` reading headers only (see the module)."""
    pos = 0
    todo = 1  # values still to skip
    truncated = f"it is truncated (its {size} bytes end inside a value)"
    while todo:
        if pos >= size:
            return truncated
        b = buf[pos]
        pos += 1
        todo -= 1
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):  # fixint, nil, bool
            continue
        if b <= 0x8F:  # fixmap
            todo += 2 * (b & 0x0F)
        elif b <= 0x9F:  # fixarray
            todo += b & 0x0F
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED or b in _COUNTED:
            width, extra = _SIZED[b] if b in _SIZED else _COUNTED[b]
            if pos + width > size:
                return truncated
            (n,) = _UINT[width].unpack_from(buf, pos)
            pos += width
            if b in _SIZED:
                pos += extra + n
            else:
                todo += extra * n
        else:  # 0xC1: never used
            return f"it is not msgpack (reserved byte 0x{b:02x} at offset {pos - 1})"
    if pos > size:
        return truncated
    if pos != size:
        return f"it has {size - pos} bytes of garbage after its value (of {pos} bytes)"
    return None


def error_damage(data: bytes | None) -> tuple[dict[str, Any] | None, str | None]:
    """``(the error object, None)`` for a sound ``error.json``; ``(None, what is wrong)`` for a
    damaged one; ``(None, None)`` when there is none (``data`` None)."""
    if data is None:
        return None, None
    if not data:
        return None, "it is empty"
    try:
        err = json.loads(data)
    except ValueError as exc:
        return None, f"it is not JSON ({exc})"
    if not isinstance(err, dict) or "type" not in err:
        return None, "it is not an error object (a JSON object with a 'type')"
    return err, None
