"""The frame writer of the in-process planes: batches, order, the first frame at once, refusals."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from dreamlake.lakeshore.dispatch.batching import FrameWriter, Item
from dreamlake.lakeshore.errors import Conflict


class Store:
    """Records each batch; from the ``block_from``-th write on, a write waits until released."""

    def __init__(self, *, block_from: int = 1, refuse_from: int | None = None) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.writes = 0
        self.block_from = block_from
        self.release = threading.Event()
        self.entered = threading.Event()
        self.refuse_from = refuse_from
        self.threads: list[str] = []

    def write(self, invocation_id: str, attempt: int, worker_id: str, frames: Sequence[Item]) -> None:
        self.writes += 1
        self.threads.append(threading.current_thread().name)
        if self.writes > self.block_from:
            self.entered.set()
            self.release.wait(10)
        seqs = [seq for seq, _data, _final in frames]
        if self.refuse_from is not None and seqs[-1] >= self.refuse_from:
            raise Conflict(f"frames of {invocation_id} refused", 409)
        self.batches.append((invocation_id, seqs))


def test_the_first_frame_goes_at_once_and_what_built_up_goes_next_in_order() -> None:
    store = Store()
    writer = FrameWriter(store.write, max_frames=4)
    writer.append("a", 1, 0, b"f0", False, worker_id="w")
    assert store.batches == [("a", [0])]  # written in the caller's thread, before append returned
    writer.append("a", 1, 1, b"f1", False, worker_id="w")
    assert store.entered.wait(10)  # frame 1 is being written while the rest build up
    for seq in range(2, 10):
        writer.append("a", 1, seq, b"f", seq == 9, worker_id="w")
    store.release.set()
    writer.flush("a")
    writer.close()
    assert store.batches == [("a", [0]), ("a", [1]), ("a", [2, 3, 4, 5]), ("a", [6, 7, 8, 9])]
    assert store.threads[0] == threading.current_thread().name != store.threads[1]


def test_frames_out_of_order_are_refused_at_once_and_repeats_go_through() -> None:
    store = Store(block_from=100)
    writer = FrameWriter(store.write)
    writer.append("a", 1, 0, b"f0", False, worker_id="w")
    with pytest.raises(Conflict, match="skips ahead: the next frame is 1"):
        writer.append("a", 1, 2, b"f2", False, worker_id="w")
    writer.append("a", 1, 1, b"end", True, worker_id="w")
    writer.append("a", 1, 1, b"end", True, worker_id="w")  # a repeat: the journal says duplicate
    with pytest.raises(Conflict, match="ended with final frame 1"):
        writer.append("a", 1, 2, b"late", False, worker_id="w")
    writer.flush("a")
    writer.close()
    assert [seq for _inv, seqs in store.batches for seq in seqs] == [0, 1, 1]


def test_a_refused_write_is_raised_by_the_next_append_and_by_flush() -> None:
    store = Store(block_from=100, refuse_from=1)
    writer = FrameWriter(store.write)
    writer.append("a", 1, 0, b"f0", False, worker_id="w")
    writer.append("a", 1, 1, b"f1", False, worker_id="w")  # queued: refused by the writer thread
    with pytest.raises(Conflict):
        writer.flush("a")
    with pytest.raises(Conflict):  # a first frame of a stream is written at once: refused at once
        writer.append("b", 1, 3, b"other", False, worker_id="w")
    writer.append("c", 1, 0, b"fine", True, worker_id="w")  # another invocation is not affected
    writer.flush("c")
    writer.close()
    assert store.batches == [("a", [0]), ("c", [0])]


def test_a_producer_far_ahead_waits_for_the_writer() -> None:
    store = Store()
    writer = FrameWriter(store.write, window=3)
    appended: list[int] = []

    def produce() -> None:
        for seq in range(7):
            writer.append("a", 1, seq, b"f", False, worker_id="w")
            appended.append(seq)

    thread = threading.Thread(target=produce)
    thread.start()
    assert store.entered.wait(10)
    thread.join(0.5)
    assert thread.is_alive() and len(appended) <= 4  # the window is full until the write ends
    store.release.set()
    thread.join(10)
    writer.flush("a")
    writer.close()
    assert [seq for _inv, seqs in store.batches for seq in seqs] == list(range(7))
