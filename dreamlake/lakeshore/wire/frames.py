"""The frame format of result streams, re-exported by :mod:`dreamlake.lakeshore.wire`.

``[kind, seq, body, meta]`` as plain msgpack (no codec: the control plane reads frames without one):
the kinds ``FRAME_VALUE`` / ``END`` / ``ERROR`` / ``LOG``, :class:`Frame`, :func:`encode_frame`,
:func:`decode_frame` and :class:`FrameReader`. Import these from ``dreamlake.lakeshore.wire``, not
from here. Runs on Python >= 3.9 (the entry bundle).
"""

from __future__ import annotations

from collections import namedtuple

import msgpack

from dreamlake.lakeshore.errors import DecodeError

from .base import Limits
from .base import why as _why

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NamedTuple

FRAME_VALUE, FRAME_END, FRAME_ERROR, FRAME_LOG = 1, 2, 3, 4
FRAME_KINDS = frozenset({FRAME_VALUE, FRAME_END, FRAME_ERROR, FRAME_LOG})
# Frames are small arrays and maps around one bin body.
DEFAULT_FRAME_LIMITS = Limits(max_array_len=1024, max_map_len=1024)

if TYPE_CHECKING:

    class _FrameFields(NamedTuple):
        kind: int
        seq: int
        body: bytes | dict[str, Any]
        meta: dict[str, Any] | None

else:  # the same class without importing typing (msgpack has imported collections already)
    _FrameFields = namedtuple("Frame", ("kind", "seq", "body", "meta"), module="dreamlake.lakeshore.wire")


class Frame(_FrameFields):
    """One frame of a result stream: ``[kind, seq, body, meta]`` on the wire."""

    __slots__ = ()
    __module__ = "dreamlake.lakeshore.wire"  # where it is imported from (and pickled by)

    @property
    def final(self) -> bool:
        """END and ERROR close the stream."""
        return self.kind in (FRAME_END, FRAME_ERROR)


def encode_frame(
    kind: int, seq: int, body: bytes | dict[str, Any], meta: dict[str, Any] | None = None
) -> bytes:
    """The msgpack bytes of one frame; ``body`` is ``bytes`` (a packed value, raw log) or a small dict."""
    _check_frame(kind, seq, body, meta, ValueError)
    return msgpack.packb([kind, seq, body, meta], use_bin_type=True)  # type: ignore[no-any-return]


def _check_frame(kind: Any, seq: Any, body: Any, meta: Any, exc: type[Exception]) -> None:
    if type(kind) is not int or kind not in FRAME_KINDS:
        raise exc(f"frame kind must be one of FRAME_VALUE/END/ERROR/LOG (1..4), not {kind!r}")
    if type(seq) is not int or seq < 0:
        raise exc(f"frame seq must be an int >= 0, not {seq!r}")
    if not isinstance(body, (bytes, dict)):
        raise exc(f"frame body must be bytes or a dict, not {type(body).__name__}")
    if meta is not None and not isinstance(meta, dict):
        raise exc(f"frame meta must be a dict or None, not {type(meta).__name__}")


def _to_frame(obj: Any) -> Frame:
    if type(obj) is not list or len(obj) != 4:
        raise DecodeError(f"a frame is a 4-element array [kind, seq, body, meta], got {type(obj).__name__}")
    kind, seq, body, meta = obj
    _check_frame(kind, seq, body, meta, DecodeError)
    return Frame(kind, seq, body, meta)


def _frame_unpacker_kwargs(limits: Limits) -> dict[str, int]:
    return {
        "max_str_len": limits.max_str_len,
        "max_bin_len": limits.max_bin_len,
        "max_ext_len": limits.max_ext_len,
        "max_array_len": limits.max_array_len,
        "max_map_len": limits.max_map_len,
    }


def decode_frame(data: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_FRAME_LIMITS) -> Frame:
    """The one frame in ``data``; ``DecodeError`` for anything else (garbage, trailing bytes, bad shape)."""
    if len(data) > limits.max_buffer_size:
        raise DecodeError(f"frame is {len(data)} bytes, over max_buffer_size={limits.max_buffer_size}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, **_frame_unpacker_kwargs(limits))
    except Exception as e:
        raise DecodeError(f"cannot decode frame: {_why(e)}", bytes(data[:64])) from e
    return _to_frame(obj)


class FrameReader:
    """Reassembles frames fed in chunks split at any byte boundary (a journal tail, an HTTP stream).

    ``feed`` returns the frames completed by the chunk; a partial frame waits for the next chunk
    (``pending`` says how many bytes wait). After a :class:`DecodeError` the reader is unusable.
    """

    __module__ = "dreamlake.lakeshore.wire"

    def __init__(self, *, limits: Limits = DEFAULT_FRAME_LIMITS) -> None:
        self._unpacker = msgpack.Unpacker(
            raw=False, max_buffer_size=limits.max_buffer_size, **_frame_unpacker_kwargs(limits)
        )
        self._fed = 0
        self._done = 0  # stream offset just past the last complete frame
        self._broken = False

    @property
    def pending(self) -> int:
        """Bytes fed but not yet part of a complete frame."""
        return self._fed - self._done

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[Frame]:
        if self._broken:
            raise DecodeError("this FrameReader already failed on a malformed frame; start a new one")
        try:
            self._unpacker.feed(chunk)
            self._fed += len(chunk)
            frames = []
            for obj in self._unpacker:
                frames.append(_to_frame(obj))
                self._done = self._unpacker.tell()
            return frames
        except Exception as e:
            self._broken = True
            if isinstance(e, DecodeError):
                raise
            raise DecodeError(f"malformed frame stream: {_why(e)}") from e
