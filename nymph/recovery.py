"""The agent's side of start-up reconciliation: when it runs, and what holds meanwhile.

:mod:`nymph.reconcile` decides what to do with each thing a previous life left; :class:`Recovery`
decides when. It reconciles once the runner works (claims wait for it, so new work never races
it); while the runner is unavailable, or after a failure (logged, tried again with backoff), the
unsettled workdirs' ``{invocation_id, attempt}`` stay in :attr:`Recovery.pending`, which the
heartbeat reports, so their leases hold until they are reconciled. When the runner's labelled
tasks could not be listed, the sweep of orphaned tasks is retried from the agent's main loop
(:meth:`Recovery.sweep`) with backoff.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nymph import workdir as wd
from nymph.execjob import recover_execs
from nymph.health import RunnerHealth
from nymph.jobs import Jobs
from nymph.lifecycle import JobContext, backoff_s
from nymph.reconcile import recover_all, sweep_labelled
from nymph.runner import RunnerUnavailable

log = logging.getLogger(__name__)

SWEEP_BACKOFF_MAX_S = 60.0


class Recovery:
    """Reconciles what a previous life left, once, and sweeps its orphaned tasks when it can."""

    def __init__(self, jobs: Jobs, health: RunnerHealth, context: Callable[[], JobContext]) -> None:
        self._jobs = jobs
        self._health = health
        self._context = context
        self._lock = threading.Lock()
        self.done = False
        self.failures = 0  # in a row, other than an unavailable runner
        self.pending: list[dict[str, Any]] = []  # leases held for workdirs not reconciled yet
        self.sweep_pending = False  # labelled tasks of a previous life could not be listed yet
        self.sweep_next = 0.0

    def hold_leases(self) -> None:
        """Report the previous life's unsettled work in heartbeats until it is reconciled."""
        with self._lock:
            if not self.pending:
                self.pending = leftover_entries(self._context().config.workdir)

    def pending_entries(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.pending)

    def reconcile(self) -> bool:
        """Recover what a previous life left; True when done.

        Never raises: an unavailable runner defers it, any other failure is logged and counted
        (the caller backs off with :attr:`failures`).
        """
        ctx = self._context()
        try:
            found = recover_all(ctx)
            recover_execs(ctx.config.workdir, ctx.runner, ctx.outbox, ctx.worker_id)
        except RunnerUnavailable as exc:
            self._health.unavailable(exc)
            self.hold_leases()
            log.warning("reconciling the previous run's work is deferred until the runner is back")
            return False
        except Exception as exc:
            self.failures += 1
            self.hold_leases()
            log.exception(
                "reconciling the previous run's work failed (%s: %s); no claims until it succeeds, "
                "trying again (try %d)",
                type(exc).__name__,
                exc,
                self.failures,
            )
            return False
        self.failures = 0
        self.sweep_pending = found.sweep_pending
        for job, alive in found:
            self._jobs.launch(job, functools.partial(job.resume, alive))
        with self._lock:
            self.pending = []
        self.done = True
        return True

    def backoff_s(self) -> float:
        """The pause before the next try after :attr:`failures` failures in a row."""
        return backoff_s(self.failures, cap=SWEEP_BACKOFF_MAX_S)

    def sweep(self) -> None:
        """Retry the labelled-task sweep reconcile could not do (listing failed), with backoff."""
        if not self.sweep_pending or time.monotonic() < self.sweep_next:
            return
        try:
            done = sweep_labelled(self._context(), self._jobs.ids)
        except Exception as exc:  # RunnerUnavailable included: tried again later
            log.warning("removing labelled tasks of a previous run failed again: %s", exc)
            done = False
        if done:
            self.sweep_pending = False
            return
        self.failures += 1
        self.sweep_next = time.monotonic() + self.backoff_s()


def leftover_entries(root: Path) -> list[dict[str, Any]]:
    """``{invocation_id, attempt}`` of every unsettled workdir a previous life left (for leases)."""
    out: list[dict[str, Any]] = []
    for path in wd.leftovers(root):
        meta = wd.read_meta(path)
        if wd.is_settled(path) or not meta or meta.get("invocation_id") != path.name:
            continue
        out.append({"invocation_id": path.name, "attempt": int(meta.get("attempt", 1))})
    return out
