"""The frame writer of the in-process planes: batches, order, the first frame alone, refusals."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from dreamlake.lakeshore.dispatch.batching import FrameWriter, Item
from dreamlake.lakeshore.errors import Conflict


class Store:
    """A write that blocks until released, recording each batch."""

    def __init__(self, refuse_from: int | None = None) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.refuse_from = refuse_from

    def write(self, invocation_id: str, attempt: int, frames: Sequence[Item]) -> None:
        self.entered.set()
        self.release.wait(10)
        seqs = [seq for seq, _data, _final in frames]
        if self.refuse_from is not None and seqs[-1] >= self.refuse_from:
            raise Conflict(f"frames of {invocation_id} refused", 409)
        self.batches.append((invocation_id, seqs))


def test_the_first_frame_goes_alone_and_what_built_up_goes_next_in_order() -> None:
    store = Store()
    writer = FrameWriter(store.write, max_frames=4)
    writer.append("a", 1, 0, b"f0", False)
    assert store.entered.wait(10)  # frame 0 is being written while the rest build up
    for seq in range(1, 10):
        writer.append("a", 1, seq, b"f", seq == 9)
    store.release.set()
    writer.flush("a")
    writer.close()
    assert store.batches == [("a", [0]), ("a", [1, 2, 3, 4]), ("a", [5, 6, 7, 8]), ("a", [9])]


def test_a_refused_write_is_raised_by_the_next_append_and_by_flush() -> None:
    store = Store(refuse_from=1)
    store.release.set()
    writer = FrameWriter(store.write)
    writer.append("a", 1, 0, b"f0", False)
    writer.flush("a")
    writer.append("a", 1, 1, b"f1", False)
    with pytest.raises(Conflict):
        writer.flush("a")
    writer.append("b", 1, 0, b"other", True)  # another invocation is not affected
    writer.flush("b")
    writer.close()
    assert store.batches == [("a", [0]), ("b", [0])]


def test_a_producer_far_ahead_waits_for_the_writer() -> None:
    store = Store()
    writer = FrameWriter(store.write, window=3)
    appended: list[int] = []

    def produce() -> None:
        for seq in range(6):
            writer.append("a", 1, seq, b"f", False)
            appended.append(seq)

    thread = threading.Thread(target=produce)
    thread.start()
    assert store.entered.wait(10)
    thread.join(0.5)
    assert thread.is_alive() and len(appended) <= 3  # the window is full until the write ends
    store.release.set()
    thread.join(10)
    writer.flush("a")
    writer.close()
    assert [seq for _inv, seqs in store.batches for seq in seqs] == list(range(6))
