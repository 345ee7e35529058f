"""The heartbeat's cadence, one for both daemons that hold leases.

A worker renews the leases it holds by beating ``/v1/daemon/heartbeat`` (or ``Plane.heartbeat``
on the local plane) more often than a lease lasts. nymph (``nymph/heartbeat.py``: running
invocations, exec jobs, free slots, lost attempts) and ``lakeshore worker`` (``worker.py``: the
claims it holds, the cancels it is asked for) send different bodies, but the loop around them is
this one: a daemon thread that calls ``beat`` every ``interval_s`` until stopped.

* **Jitter**: each wait is drawn from ``[1 - jitter, 1] * interval_s``, so a fleet started at
  once spreads its beats instead of landing them on the control plane together. Never longer
  than ``interval_s``: the lease arithmetic (beat well inside a lease) holds for every beat.
* **Wake**: where the plane can say a command is queued for the worker (the local plane's
  ``wait_commands``), ``wake(s)`` waits up to ``s`` seconds and returns True on one; the beat
  then comes at once, so a cancel lands in milliseconds rather than at the next beat. The stop
  flag is rechecked every ``slice_s`` meanwhile.
* **Failures**: a beat that raises is logged and the next one tries again (a missed beat costs
  nothing a lease cannot absorb); what a failed beat means for the daemon is its ``beat``'s
  business (nymph counts an outage; the worker logs it).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WAKE_SLICE_S = 0.1  # how often a wait on the plane rechecks the stop flag


class Beats:
    """Call ``beat`` every ``interval_s`` (see the module docstring) on a daemon thread named
    ``name``, from :meth:`start` until :meth:`stop`."""

    def __init__(
        self,
        name: str,
        interval_s: float,
        beat: Callable[[], object],
        *,
        jitter: float = 0.0,
        wake: Callable[[float], bool] | None = None,
        slice_s: float = WAKE_SLICE_S,
    ) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
        self.name = name
        self.interval_s = interval_s
        self._beat = beat
        self._jitter = jitter
        self._wake = wake
        self._slice_s = slice_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Beats:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop beating; waits up to ``timeout_s`` for a beat in flight to finish."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _next_wait_s(self) -> float:
        return self.interval_s * random.uniform(1.0 - self._jitter, 1.0)

    def _wait(self) -> bool:
        """Wait for the next beat, or a wake; True: stop."""
        wait_s = self._next_wait_s()
        if self._wake is None:
            return self._stop.wait(wait_s)
        deadline = time.monotonic() + wait_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._wake(min(left, self._slice_s)):
                return False
        return True

    def _run(self) -> None:
        while not self._wait():
            try:
                self._beat()
            except Exception:
                log.exception("%s: a heartbeat failed; the next one tries again", self.name)
