"""One supervisor loop for every running invocation: no thread of its own while a task runs.

A job whose runner can say when its task ended by an fd (:class:`nymph.runner.Watching`: the
process runner's pidfd of a spawned entry, a pipe its zygote reader writes when a forked child
exits) is *parked* here once started (:meth:`Supervisor.park`): its thread ends, and this loop,
one thread with one ``epoll`` (:mod:`selectors`) over every parked task's fd, a wake-up pipe and
the timeouts' deadlines, hands the job back (``on_ready``, on a small pool of threads) once

- its fd is readable (the task ended),
- a stop was requested (:meth:`Supervisor.poke`: cancel, a lost lease, shutdown, a stream overflow),
- or its deadline passed (the invocation's timeout).

Each parked job is handed back exactly once. What happens then is the job's ordinary wait
(:meth:`nymph.lifecycle.SupervisedJob.wait_or_stop`), which returns at once (the exit status, or a
stop with the ladder) in all three cases; so the loop only decides *when* a job needs a thread
again, never *what* its outcome is, and a spurious wake-up costs a wait, not a wrong verdict.
Runners without an exit fd (docker, gVisor, Slurm, Kubernetes) keep the job's thread blocked in
that wait, as before.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

# threads that run handed-back jobs (the ladder, collect, deliver, ack), at least: the agent gives
# twice its concurrency, so that a shutdown's ladders all run at once; idle ones cost nothing
POOL_THREADS = 32


class Parked:
    """One parked job: its fd, its deadline (``time.time()``), what to run when it is handed back."""

    __slots__ = ("deadline", "fd", "fired", "name", "on_ready")

    def __init__(self, name: str, fd: int, deadline: float | None, on_ready: Callable[[], None]) -> None:
        self.name = name
        self.fd = fd
        self.deadline = deadline
        self.on_ready = on_ready
        self.fired = False


class Supervisor:
    """The loop (started on the first :meth:`park`); thread-safe."""

    def __init__(self, pool_threads: int = POOL_THREADS) -> None:
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: list[Parked] = []  # parked with a deadline the loop has not taken yet
        self._poked: list[Parked] = []
        self._deadlines: list[tuple[float, int, Parked]] = []
        self._order = itertools.count()
        self._pool = ThreadPoolExecutor(pool_threads, thread_name_prefix="nymph-job")
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def parked(self) -> int:
        """How many jobs wait here now."""
        with self._lock:
            return len(self._selector.get_map()) - 1

    def park(self, name: str, fd: int, deadline: float | None, on_ready: Callable[[], None]) -> Parked:
        """Wait for ``fd`` (or a poke, or ``deadline``), then run ``on_ready()`` on the pool, once."""
        parked = Parked(name, fd, deadline, on_ready)
        with self._lock:
            if self._closed:
                raise RuntimeError("the supervisor is closed")
            try:  # registered here: epoll takes an fd from any thread, and the loop need not wake
                self._selector.register(fd, selectors.EVENT_READ, parked)
                failed = None
            except (OSError, ValueError, KeyError) as exc:  # a bad or duplicate fd
                failed = exc
            if failed is None and deadline is not None:
                self._incoming.append(parked)  # the loop keeps the deadlines (and wakes for them)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nymph-supervisor", daemon=True)
                self._thread.start()
        if failed is not None:  # its job waits in a thread instead
            log.warning("supervisor: cannot watch %s (fd %d): %s", name, fd, failed)
            self._fire(parked)
        elif deadline is not None:
            self._wake()
        return parked

    def poke(self, parked: Parked) -> None:
        """Hand ``parked`` back now (a stop was requested); a no-op once it was handed back."""
        with self._lock:
            if parked.fired:
                return
            self._poked.append(parked)
        self._wake()

    def close(self) -> None:
        """Stop the loop; jobs still parked are handed back at once (they then wait in their thread)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(10.0)
        with self._lock:
            left = [k.data for k in self._selector.get_map().values() if k.data is not None]
            left += self._incoming
            self._incoming = []
        for parked in left:
            self._fire(parked)
        self._pool.shutdown(wait=False)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- the loop ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                incoming, self._incoming = self._incoming, []
                poked, self._poked = self._poked, []
            for parked in incoming:
                self._add_deadline(parked)
            for parked in poked:
                self._fire(parked)
            timeout = None
            if self._deadlines:
                timeout = max(0.0, self._deadlines[0][0] - time.time())
            try:
                events = self._selector.select(timeout)
            except OSError as exc:  # never: a closed fd is unregistered by its job first
                log.error("supervisor: select failed: %s", exc)
                time.sleep(0.1)
                continue
            for key, _mask in events:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 512):
                            pass
                else:
                    self._fire(key.data)
            now = time.time()
            while self._deadlines and self._deadlines[0][0] <= now:
                self._fire(heapq.heappop(self._deadlines)[2])

    def _add_deadline(self, parked: Parked) -> None:
        if parked.fired or parked.deadline is None:
            return
        heapq.heappush(self._deadlines, (parked.deadline, next(self._order), parked))
        if len(self._deadlines) > 64:  # drop the deadlines of jobs handed back meanwhile
            live = [d for d in self._deadlines if not d[2].fired]
            if len(live) * 2 < len(self._deadlines):
                heapq.heapify(live)
                self._deadlines = live

    def _fire(self, parked: Parked) -> None:
        with self._lock:
            if parked.fired:
                return
            parked.fired = True
            key = self._selector.get_map().get(parked.fd)
            if key is not None and key.data is parked:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(parked.fd)
        on_ready, parked.on_ready = parked.on_ready, _nothing  # a stale deadline holds no job
        try:
            self._pool.submit(on_ready)
        except RuntimeError:  # the pool is shut down (nymph stops): a thread of its own
            threading.Thread(target=on_ready, name=f"nymph-{parked.name}", daemon=True).start()


def _nothing() -> None:
    pass
