"""What the agent knows about its own health: can the runner work, and does the outbox deliver.

- :class:`RunnerHealth`: ``runner.check()`` at start and while the runner is unavailable; a job
  that meets an unavailable runner reports it here (``JobContext.on_unavailable``). While the
  runner is unavailable nymph claims nothing, ``/healthz`` answers 503 with the problem, and
  systemd's status line says what is wrong; claims resume once ``check()`` passes again.
- :class:`Watchdog`: systemd's watchdog is petted after each successful poll or heartbeat and
  each confirmed outbox send, but only while the outbox delivers: an agent whose acks cannot get
  through is restarted by systemd rather than claiming more work it cannot report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

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
