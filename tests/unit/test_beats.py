"""The daemons' one heartbeat cadence (protocol/beats.py): what nymph and ``lakeshore worker`` rely
on for their leases -- beats keep coming after one fails, a queued command brings the beat at
once, jitter never stretches a wait past the interval, and stop ends the thread."""

from __future__ import annotations

import threading

import pytest

from dreamlake.lakeshore.protocol.beats import Beats
from tests.stack.wait import until


def test_beats_keep_coming_after_one_raises_and_stop_ends_the_thread() -> None:
    calls: list[int] = []

    def beat() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the control plane said no")

    beats = Beats("test-beats", 0.02, beat).start()
    until(lambda: len(calls) >= 3, "beats after the failed one", 10)
    beats.stop(timeout_s=5)
    assert beats.stopped and beats._thread is not None and not beats._thread.is_alive()
    after = len(calls)
    threading.Event().wait(0.1)
    assert len(calls) == after  # no beat after stop


def test_a_wake_brings_the_beat_at_once_not_at_the_interval() -> None:
    woken = threading.Event()
    beat_done = threading.Event()

    def wake(timeout_s: float) -> bool:
        assert timeout_s <= 0.05 + 1e-9  # the stop flag is rechecked every slice
        return woken.wait(timeout_s)

    beats = Beats("test-wake", 3600.0, beat_done.set, wake=wake, slice_s=0.05).start()
    try:
        assert not beat_done.wait(0.2)  # an hour's interval: no beat on its own
        woken.set()  # a command is queued for the worker
        assert beat_done.wait(5.0)
    finally:
        beats.stop(timeout_s=5)
    assert not beats._thread.is_alive()  # type: ignore[union-attr]  # the slice let stop through


def test_jitter_shortens_waits_but_never_stretches_them() -> None:
    beats = Beats("test-jitter", 10.0, lambda: None, jitter=0.1)
    waits = [beats._next_wait_s() for _ in range(2000)]
    assert all(9.0 <= w <= 10.0 for w in waits)
    assert max(waits) - min(waits) > 0.5  # spread out, not one value
    assert Beats("test-none", 10.0, lambda: None)._next_wait_s() == 10.0
    with pytest.raises(ValueError, match="jitter"):
        Beats("test-bad", 10.0, lambda: None, jitter=1.0)
