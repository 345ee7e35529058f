"""What the agent knows about its own health: can the runner work, and does the outbox deliver.

- :class:`RunnerHealth`: ``runner.check()`` at start and while the runner is unavailable; a job
  that meets an unavailable runner reports it here (``JobContext.on_unavailable``). While the
  runner is unavailable nymph claims nothing, ``/healthz`` answers 503 with the problem, and
  systemd's status line says what is wrong; claims resume once ``check()`` passes again.
- :class:`DiskHealth`: free space on the workdir's and the state dir's filesystems, checked before
  each claim against a floor (``min_free_mb``), and told at once when a job or the outbox meets a
  full disk (``ENOSPC``, ``EDQUOT``). While space is short nymph claims nothing and ``/healthz``
  answers 503 with the problem; one line says so when it starts and one when space is back, and
  claims resume by themselves.
- :class:`Watchdog`: systemd's watchdog is petted after each successful poll or heartbeat and
  each confirmed outbox send, but only while the outbox delivers: an agent whose acks cannot get
  through is restarted by systemd rather than claiming more work it cannot report.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from nymph import observability as obs
from nymph.lifecycle import backoff_s
from nymph.runner import Runner
from nymph.sdnotify import SdNotify

log = logging.getLogger(__name__)


class RunnerHealth:
    """Whether the runner can work now (``ok``), and if not, why (``problem``)."""

    def __init__(self, runner: Runner, notify: SdNotify) -> None:
        self._runner = runner
        self._notify = notify
        self.ok = threading.Event()
        self.problem: str | None = None
        self._checking = threading.Lock()

    def check(self) -> bool:
        """Run ``runner.check()``; True when it passes. Never raises: nymph keeps running."""
        with self._checking:
            try:
                self._runner.check()
            except Exception as exc:
                self.unavailable(exc)
                return False
            if not self.ok.is_set():
                if self.problem is not None:
                    log.warning("runner %s is available again; claiming work", self._runner.name)
                self.problem = None
                self.ok.set()
                self._notify.status(f"runner {self._runner.name} ok")
            return True

    def unavailable(self, exc: BaseException) -> None:
        """The runner cannot work: stop claiming and report not-ready until check() passes again."""
        problem = f"{type(exc).__name__}: {exc}"
        was_ok = self.ok.is_set() or self.problem is None
        self.ok.clear()
        if problem != self.problem or was_ok:
            log.error(
                "runner %s cannot work: %s -- no new claims until it can (retrying; "
                "`nymph doctor` says what to fix)",
                self._runner.name,
                exc,
            )
            self._notify.status(f"runner {self._runner.name} unavailable: {exc}")
        self.problem = problem

    def wait_ok(self, stopped: Callable[[], bool], pause: Callable[[float], object]) -> bool:
        """Block (backoff and jitter, through ``pause``) until ``check()`` passes; False once ``stopped()``."""
        tries = 0
        while not stopped():
            if self.ok.is_set() or self.check():
                return True
            pause(backoff_s(tries))
            tries += 1
        return False


DISK_CHECK_S = 1.0  # while space is short: how often free space is looked at again
# while there is room: a check this soon after one that passed (at the same floor) passes without
# looking again (a busy nymph polls, and so checked, once per invocation: two statfs calls each); a
# write that meets ENOSPC in between still pauses claims at once (DiskHealth.full)
DISK_RECHECK_S = 0.25
RESUME_MIN_BYTES = 1024 * 1024  # after a full disk, claims resume above this even with a floor of 0


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on ``path``'s filesystem (``statvfs``' ``f_bavail``)."""
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize)


class DiskHealth:
    """Whether the workdir's and the state dir's filesystems have room (``ok``), and if not, why."""

    def __init__(self, paths: Sequence[Path], min_free_bytes: int, notify: SdNotify) -> None:
        self._paths = list(dict.fromkeys(paths))
        self.min_free_bytes = max(0, int(min_free_bytes))
        self._notify = notify
        self._lock = threading.Lock()
        self.ok = threading.Event()
        self.ok.set()
        self.problem: str | None = None
        self._full_seen = False  # a write failed with ENOSPC: stay paused until there is room again
        self._passed: tuple[float, int] | None = None  # (monotonic time, floor) of the last check that passed
        self._problems = 0  # problems so far: a check that began before one cannot clear it

    def check(self) -> bool:
        """Look at free space now; True when every filesystem is above the floor. Never raises."""
        with self._lock:
            floor = max(self.min_free_bytes, RESUME_MIN_BYTES if self._full_seen else 0)
            problems = self._problems
        now = time.monotonic()
        passed = self._passed
        if passed is not None and passed[1] == floor and now - passed[0] < DISK_RECHECK_S:
            return True
        short: list[str] = []
        for path in self._paths:
            try:
                free = free_bytes(path)
            except OSError as exc:  # not there (yet): nymph creates it; nothing to say about space
                log.debug("free space of %s unknown: %s", path, exc)
                continue
            if free < floor:
                short.append(f"{path} has {_mib(free)} free (floor {_mib(floor)})")
        if short:
            self._set_problem("; ".join(short))
            return False
        with self._lock:
            if self._problems != problems:  # a write met a full disk while this one looked: it stands
                return False
            was, self.problem, self._full_seen = self.problem, None, False
            if not self.ok.is_set():
                self.ok.set()
            self._passed = (now, floor)
        if was is not None:
            log.warning("disk space is back (%s); claiming work again", ", ".join(map(str, self._paths)))
            self._notify.status("disk space ok")
        return True

    def full(self, exc: BaseException) -> None:
        """A write of nymph's failed because a filesystem is full: no claims until there is room."""
        with self._lock:
            self._full_seen = True
        self._set_problem(f"a write failed: {exc}")

    def _set_problem(self, problem: str) -> None:
        with self._lock:
            first = self.problem is None
            self.ok.clear()
            self.problem = problem
            self._passed = None
            self._problems += 1
        if first:
            log.error(
                "disk full: %s -- no new claims until there is room (free space on %s, or lower "
                "--min-free-mb); running work carries on, claims resume by themselves",
                problem,
                ", ".join(map(str, self._paths)),
            )
            self._notify.status(f"disk full: {problem}")

    def wait_ok(self, stopped: Callable[[], bool], pause: Callable[[float], object]) -> bool:
        """Block until :meth:`check` passes (looking every :data:`DISK_CHECK_S`); False once ``stopped()``."""
        while not stopped():
            if self.check():
                return True
            pause(DISK_CHECK_S)
        return False


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Watchdog:
    """Pets systemd's watchdog while the outbox delivers; ``sent`` is the outbox's ``on_sent``."""

    def __init__(self, notify: SdNotify, pending: Callable[[], int]) -> None:
        self._notify = notify
        self._pending = pending
        self.outbox_ok = True

    def sent(self, ok: bool) -> None:
        self.outbox_ok = ok
        obs.OUTBOX_PENDING.set(self._pending())
        if ok:
            self.pet()

    def pet(self) -> None:
        if self.outbox_ok:
            self._notify.watchdog()
