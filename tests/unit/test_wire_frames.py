"""Frames: encode/decode, shape validation, and FrameReader reassembly at every byte boundary."""

from __future__ import annotations

import msgpack
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import DecodeError

FRAMES = [
    wire.encode_frame(wire.FRAME_VALUE, 0, wire.pack({"i": 0}), {"ts": 1.5}),
    wire.encode_frame(wire.FRAME_LOG, 1, b"hello\n", {"stream": "stdout", "ts": 2.0}),
    wire.encode_frame(wire.FRAME_VALUE, 2, wire.pack(list(range(300))), {"ts": 3.0}),
    wire.encode_frame(wire.FRAME_ERROR, 3, {"type": "ValueError", "message": "bad", "traceback": "tb"}),
]


def test_frame_is_a_plain_msgpack_array() -> None:
    body = wire.pack((1, 2))
    data = wire.encode_frame(wire.FRAME_END, 7, body, {"ts": 0.5})
    assert msgpack.unpackb(data) == [2, 7, body, {"ts": 0.5}]
    frame = wire.decode_frame(data)
    assert frame == wire.Frame(wire.FRAME_END, 7, body, {"ts": 0.5})
    assert frame.final and wire.unpack(frame.body) == (1, 2)


def test_final_is_end_or_error() -> None:
    assert [wire.decode_frame(f).final for f in FRAMES] == [False, False, False, True]


@pytest.mark.parametrize(
    "bad",
    [
        [1, 0, b""],
        [9, 0, b"", None],
        [1, -1, b"", None],
        [1, "0", b"", None],
        [1, 0, "text", None],
        [1, 0, b"", [1]],
        {"kind": 1},
    ],
    ids=repr,
)
def test_decode_frame_refuses_bad_shapes(bad: object) -> None:
    with pytest.raises(DecodeError):
        wire.decode_frame(msgpack.packb(bad))


def test_decode_frame_refuses_trailing_and_truncated_bytes() -> None:
    with pytest.raises(DecodeError):
        wire.decode_frame(FRAMES[0] + b"\x00")
    with pytest.raises(DecodeError):
        wire.decode_frame(FRAMES[0][:-1])


def test_encode_frame_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kind"):
        wire.encode_frame(0, 0, b"")
    with pytest.raises(ValueError, match="body"):
        wire.encode_frame(wire.FRAME_VALUE, 0, [1])  # type: ignore[arg-type]


def test_reader_reassembles_at_every_split_point() -> None:
    stream = b"".join(FRAMES)
    expected = [wire.decode_frame(f) for f in FRAMES]
    for cut in range(len(stream) + 1):
        reader = wire.FrameReader()
        got = reader.feed(stream[:cut])
        assert reader.pending == cut - sum(len(f) for f in FRAMES[: len(got)])
        got += reader.feed(stream[cut:])
        assert got == expected and reader.pending == 0


def test_reader_byte_by_byte() -> None:
    reader = wire.FrameReader()
    got = [f for b in b"".join(FRAMES) for f in reader.feed(bytes([b]))]
    assert [f.seq for f in got] == [0, 1, 2, 3]


def test_reader_raises_on_a_malformed_frame_then_stays_failed() -> None:
    reader = wire.FrameReader()
    assert len(reader.feed(FRAMES[0])) == 1
    with pytest.raises(DecodeError):
        reader.feed(msgpack.packb([1, 2, 3]))
    with pytest.raises(DecodeError, match="start a new one"):
        reader.feed(FRAMES[1])


def test_reader_raises_on_garbage() -> None:
    with pytest.raises(DecodeError):
        wire.FrameReader().feed(b"\xc1" + FRAMES[0])


def test_reader_bounds_its_buffer() -> None:
    reader = wire.FrameReader(limits=wire.Limits(max_buffer_size=1024))
    with pytest.raises(DecodeError):
        reader.feed(wire.encode_frame(wire.FRAME_VALUE, 0, b"x" * 4096))
