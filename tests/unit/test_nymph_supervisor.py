"""The supervisor loop (nymph.supervisor): running tasks wait in one epoll, each handed back once.

Real fds throughout: a pidfd of a real child process, pipes; no fake clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from nymph.supervisor import Supervisor

LIMIT_S = 10.0


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    sup = Supervisor(pool_threads=4)
    yield sup
    sup.close()


class Calls:
    """Counts hand-backs and the thread each ran in."""

    def __init__(self) -> None:
        self.count = 0
        self.threads: list[str] = []
        self.event = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.count += 1
            self.threads.append(threading.current_thread().name)
        self.event.set()


def test_a_task_that_exits_is_handed_back_once_and_many_wait_in_one_thread(supervisor: Supervisor) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        for _ in range(8)
    ]
    fds = [os.pidfd_open(p.pid) for p in procs]
    calls = [Calls() for _ in procs]
    try:
        before = threading.active_count()
        for i, fd in enumerate(fds):
            supervisor.park(f"task-{i}", fd, None, calls[i])
        assert supervisor.parked == 8  # registered by park() itself
        assert threading.active_count() - before == 1  # eight waiting tasks, one loop thread
        assert all(c.count == 0 for c in calls)  # nothing ended: nothing handed back
        procs[3].stdin.close()  # type: ignore[union-attr]
        assert calls[3].event.wait(LIMIT_S)
        assert procs[3].wait(LIMIT_S) == 0
        # a job is taken off the loop before it is handed back: the seven others are still parked
        assert [c.count for c in calls] == [0, 0, 0, 1, 0, 0, 0, 0]
        assert calls[3].threads[0].startswith("nymph-job")  # on the pool, not the loop
        assert supervisor.parked == 7
    finally:
        for p in procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()
            p.wait(LIMIT_S)
        for fd in fds:
            os.close(fd)


def _one_more_pass(supervisor: Supervisor) -> None:
    """Return once the loop has made a pass after this call: a sentinel job is poked, and the loop
    serves pokes in order, so everything asked of it before has been dealt with."""
    r, w = os.pipe()
    done = Calls()
    try:
        supervisor.poke(supervisor.park("sentinel", r, None, done))
        assert done.event.wait(LIMIT_S), "the supervisor loop made no pass"
    finally:
        os.close(r)
        os.close(w)


def test_a_poke_hands_back_at_once_and_only_once(supervisor: Supervisor) -> None:
    r, w = os.pipe()
    calls = Calls()
    try:
        parked = supervisor.park("job", r, None, calls)
        supervisor.poke(parked)
        assert calls.event.wait(LIMIT_S)
        supervisor.poke(parked)  # a second stop request, then the fd: still handed back once
        os.write(w, b"x")
        _one_more_pass(supervisor)
        assert calls.count == 1
        assert supervisor.parked == 0
    finally:
        os.close(r)
        os.close(w)


def test_a_deadline_hands_back_without_the_fd(supervisor: Supervisor) -> None:
    r, w = os.pipe()
    calls = Calls()
    try:
        t0 = time.time()
        supervisor.park("job", r, t0 + 0.3, calls)
        assert calls.event.wait(LIMIT_S)
        assert time.time() - t0 >= 0.29
        assert calls.count == 1
    finally:
        os.close(r)
        os.close(w)


def test_an_fd_that_cannot_be_watched_is_handed_back_not_lost(supervisor: Supervisor) -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    calls = Calls()
    supervisor.park("job", r, None, calls)  # a closed fd: epoll refuses it
    assert calls.event.wait(LIMIT_S) and calls.count == 1


def test_close_hands_back_what_is_still_parked() -> None:
    sup = Supervisor(pool_threads=2)
    r, w = os.pipe()
    calls = Calls()
    try:
        sup.park("job", r, None, calls)
        sup.close()
        assert calls.event.wait(LIMIT_S) and calls.count == 1
        with pytest.raises(RuntimeError):
            sup.park("late", r, None, calls)
    finally:
        os.close(r)
        os.close(w)
    assert sup._thread is not None and not sup._thread.is_alive()  # the loop ended


def test_parking_without_a_deadline_wakes_no_loop_and_is_still_handed_back(supervisor: Supervisor) -> None:
    # the fd goes into epoll from the parking thread: the loop thread sleeps on until a task ends
    wakes: list[int] = []
    real_wake = supervisor._wake
    supervisor._wake = lambda: (wakes.append(1), real_wake())  # type: ignore[method-assign]
    pipes = [os.pipe() for _ in range(3)]
    calls = [Calls() for _ in pipes]
    try:
        for i, (r, _w) in enumerate(pipes):
            supervisor.park(f"task-{i}", r, None, calls[i])
        assert wakes == [] and supervisor.parked == 3
        os.write(pipes[1][1], b"x")  # the task behind the second fd ended
        assert calls[1].event.wait(LIMIT_S)  # taken off the loop before it was handed back
        assert [c.count for c in calls] == [0, 1, 0] and supervisor.parked == 2
        pipes.append(os.pipe())
        supervisor.park("timed", pipes[3][0], time.time() + 0.2, calls[2])
        assert wakes == [1]  # a deadline is the loop's to keep: it is told
        assert calls[2].event.wait(LIMIT_S)
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
