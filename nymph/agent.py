"""The agent: registration, the threads, and shutdown; each concern is a piece of its own.

::

    Agent                      registration, start-up, the main loop, signals, shutdown, exit code
     +-- Jobs (jobs.py)        the one table of jobs (invocations and exec jobs) and the commands
     +-- Poller (poller.py)    the long-poll loop, in its own thread
     +-- Heartbeat             lease renewal; its answers carry commands, lost ids and the pin
     +-- RunnerHealth          can the runner work? no claims while it cannot (health.py)
     +-- Watchdog              systemd's watchdog, petted while the outbox delivers (health.py)
     +-- Recovery              reconcile what a previous life left, hold its leases meanwhile
     +-- VersionPin            a pinned version: stop claiming, drain (upgrade.py)
     +-- Outbox                frames (in batches), then acks, per invocation; durable until confirmed

Concurrency model: threads. The main thread owns signals, housekeeping (reaping orphaned
processes, the deferred labelled-task sweep) and the shutdown sequence; one thread long-polls
(only while a slot is free); each job runs in a thread of its own (:mod:`nymph.lifecycle`); the
heartbeat and the outbox sender have a thread each.

Exit codes of :meth:`Agent.run`: 0 after a shutdown; :data:`EXIT_AUTH` when the control plane
rejects the token (401/403); ``upgrade.EXIT_VERSION_MISMATCH`` (75) after draining for a pinned
version other than ours (or the upgrade re-execs).

Shutdown (SIGTERM, or the first SIGINT): stop polling, let running work finish within
``grace_s``, then stop what remains with the ladder and ack it ``preempted`` with
``{type: "Preempted", message: "daemon shutdown grace expired", reason: <why nymph stopped>}``
(the control plane runs it again elsewhere at once); a second SIGINT skips the grace. Drain
(SIGUSR1, ``nymph drain``: :mod:`nymph.drain`) is the same with ``drain_timeout_s`` (unbounded by
default) as the grace. A call a poll in flight claims after the stop began is handed back before
it starts (``preempted`` with ``started: false``: it spends no attempt nor preemption). The
outbox is flushed best-effort; what it keeps is replayed by the next start. The runner is closed
last.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any, cast

from dreamlake.lakeshore import __version__, ids
from dreamlake.lakeshore.errors import AuthError, InvalidId, PlaneError
from nymph import drain, upgrade
from nymph import observability as obs
from nymph.client import ControlPlaneClient
from nymph.config import NymphConfig
from nymph.errors import UpgradeError, redact
from nymph.health import DiskHealth, RunnerHealth, Watchdog
from nymph.heartbeat import Heartbeat
from nymph.identity import load_or_create_worker_id
from nymph.jobs import Jobs
from nymph.lifecycle import SHUTDOWN_MESSAGE, JobContext
from nymph.outbox import Outbox
from nymph.placement import auto_labels, host_capacity
from nymph.poller import Poller, retrying
from nymph.prune import PRUNE_EVERY_S, prune
from nymph.recovery import Recovery
from nymph.runner import Reaping, Runner
from nymph.sdnotify import SdNotify
from nymph.slots import Slots
from nymph.supervisor import POOL_THREADS, Supervisor
from nymph.watcher import Watcher

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_AUTH = 77  # EX_NOPERM: fix the token, do not restart in a loop
HOUSEKEEPING_S = 0.5  # how often the main thread reaps orphans and retries a deferred sweep
POLL_SETTLE_S = 1.0  # at shutdown, how long an in-flight long poll may take to come back
SHUTDOWN_STEP_S = 0.05


class Stopping:
    """The shutdown request: when it came, and whether the grace is skipped."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.immediate = threading.Event()
        self.since: float | None = None
        self.deadline: float | None = None  # monotonic; None: running work may take as long as it needs
        self.why = "nymph stopped"
        self.sigints = 0

    def request(self, immediate: bool = False, grace_s: float | None = None, why: str | None = None) -> None:
        """Stop; running work has ``grace_s`` (None: no bound); the earliest deadline asked wins."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if grace_s is not None and (self.deadline is None or now + grace_s < self.deadline):
            self.deadline = now + grace_s
            if why:
                self.why = why
        elif why and self.deadline is None:
            self.why = why
        if immediate:
            self.immediate.set()
        self.event.set()


class Agent:
    def __init__(
        self,
        config: NymphConfig,
        runner: Runner,
        *,
        client: ControlPlaneClient | None = None,
        gpu_pool: Any = None,
        gpu_total: int = 0,
        notify: SdNotify | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.client = client or ControlPlaneClient(config.server, config.token)
        self.slots = Slots(config.concurrency, gpu_pool, gpu_total)
        self.capacity = host_capacity(gpu_pool, runner)
        self.labels = {**auto_labels(self.capacity), **dict(config.labels)}
        self.notify = notify or SdNotify()
        self.worker_id = ""
        self.heartbeat_s = config.heartbeat_s or 10.0
        self.inline_threshold: int | None = None  # set by the register answer
        self.outbox: Outbox | None = None
        self.registered = threading.Event()
        self.stopping = Stopping()
        self.exit_code = EXIT_OK
        self.runner_health = RunnerHealth(runner, self.notify)
        self._next_prune = 0.0
        self.disk = DiskHealth([config.workdir, config.state_dir], config.min_free_mb * 2**20, self.notify)
        self.watchdog = Watchdog(self.notify, lambda: self.outbox.pending() if self.outbox else 0)
        # running tasks wait here, not in a thread each (runners with an exit fd: nymph.supervisor)
        self.supervisor = Supervisor(pool_threads=max(POOL_THREADS, 2 * config.concurrency))
        self.jobs = Jobs(self.slots, self.context)
        self.recovery = Recovery(self.jobs, self.runner_health, self.context)
        self.pin = upgrade.VersionPin(
            self.notify,
            stopping=self.stopping.event,
            polling=lambda: self.poller.is_alive(),
            wait_idle=self.jobs.wait_idle,
            running=lambda: len(self.running()),
            request_stop=self.request_stop,
        )
        self.poller = Poller(
            self.client,
            config,
            self.slots,
            worker_id=lambda: self.worker_id,
            stopping=self.stopping.event,
            claiming_stopped=self._claiming_stopped,
            ready=self._ready_to_claim,
            dispatch=self._dispatch_claimed,
            on_answer=self.pin.check,
            on_auth=self._auth_failed,
            pet=self.watchdog.pet,
            take_acks=lambda wid, n: self.outbox.take_acks(wid, n) if self.outbox is not None else [],
            acks_answered=lambda msgs, answers: (
                self.outbox.acks_answered(msgs, answers) if self.outbox is not None else None
            ),
            labels=self.labels,
            task_offer=self.capacity.get("task"),
        )

    # --- public ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Run until shutdown; return the process exit code."""
        cfg = self.config
        cfg.workdir.mkdir(parents=True, exist_ok=True, mode=0o711)
        cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.worker_id = load_or_create_worker_id(cfg.state_dir)
        drain.write_pid(cfg.state_dir)  # `nymph drain` finds this process
        self.outbox = Outbox(
            cfg.state_dir,
            self.client,
            on_sent=self.watchdog.sent,
            watcher=Watcher(inotify=cfg.stream_inotify, poll_s=cfg.stream_poll_s),
            max_bytes=cfg.stream_max_bytes,
            on_full=self.disk.full,
            poll_imminent=self.poller.poll_soon,
        )
        self.outbox.start()
        health = None
        if cfg.metrics_port is not None:
            health = obs.start_health_server(cfg.metrics_host, cfg.metrics_port, self.health)
        if not self._register():
            return self._finish(health)
        if self.runner_health.check():
            self.recovery.reconcile()
        else:
            self.recovery.hold_leases()
        hb = Heartbeat(
            self.client,
            self.worker_id,
            self.heartbeat_s,
            running=self.running,
            free_slots=self.slots.free,
            running_exec=self.running_exec,
            on_answer=self._on_heartbeat,
        )
        hb.start()
        self.poller.start()
        while not self.stopping.event.wait(HOUSEKEEPING_S):
            self._reap_orphans()
            self.recovery.sweep()
            self._prune()
        self._shutdown()
        hb.stop()
        self._deregister()
        return self._finish(health)

    def request_stop(self, immediate: bool = False) -> None:
        self.stopping.request(immediate, self.config.grace_s, "nymph stopped")

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGUSR1, self._on_signal)

    def context(self) -> JobContext:
        """What a new job shares with the agent (the outbox exists once :meth:`run` started)."""
        assert self.outbox is not None
        return JobContext(
            self.config,
            self.runner,
            self.outbox,
            self.slots,
            self.worker_id,
            on_done=self._job_done,
            on_unavailable=self.runner_health.unavailable,
            client=self.client,
            inline_threshold=self.inline_threshold,
            on_disk_full=self.disk.full,
            supervisor=self.supervisor,
        )

    def _job_done(self, job: Any) -> None:
        """A job released its slot; one that kept its workdir (failed) brings the next prune forward."""
        self.jobs.done(job)
        if getattr(job, "state", None) not in (None, "succeeded", "lost", "deferred", "released"):
            self._next_prune = 0.0

    def running(self) -> list[dict[str, Any]]:
        """The invocations whose leases the heartbeat renews, ``{invocation_id, attempt}``: the
        running jobs (a job runs until every frame of it was confirmed), those whose ack is not
        confirmed yet (a lease is given up only by the ack), and a previous life's work waiting
        for the runner to come back."""
        entries = self.jobs.entries("invocation")
        known = {e["invocation_id"] for e in entries}
        acks = self.outbox.pending_entries() if self.outbox is not None else []
        for e in [*acks, *self.recovery.pending_entries()]:
            if e["invocation_id"] not in known:
                known.add(e["invocation_id"])
                entries.append(e)
        return entries

    def running_exec(self) -> list[dict[str, Any]]:
        """The exec jobs running here, ``{exec_id, attempt}``: the heartbeat renews their leases."""
        return self.jobs.entries("exec")

    def health(self) -> dict[str, Any]:
        runner_ok = self.runner_health.ok.is_set()
        disk_ok = self.disk.check()  # looked at now: /healthz tells the truth while every slot is busy
        return {
            "ok": self.registered.is_set() and runner_ok and disk_ok and not self.stopping.event.is_set(),
            "runner_ok": runner_ok,
            "runner_problem": self.runner_health.problem,
            "disk_ok": disk_ok,
            "disk_problem": self.disk.problem,
            "control_plane_ok": getattr(getattr(self.client, "link", None), "up", True),
            "worker_id": self.worker_id,
            "version": __version__,
            "runner": self.runner.name,
            "running": len(self.running()),
            "free_slots": self.slots.free(),
            "outbox_pending": self.outbox.pending() if self.outbox else 0,
            "last_poll_ok": self.poller.last_ok,
        }

    # --- start-up --------------------------------------------------------------------------------

    def _register(self) -> bool:
        cfg = self.config
        body: dict[str, Any] = {
            "worker_id": self.worker_id,
            "hostname": socket.gethostname(),
            "version": __version__,
            "runner": self.runner.name,
            "queues": list(cfg.queues),
            "labels": self.labels,
            "slots": cfg.concurrency,
            "capacity": self.capacity,
            "allow_pickled": cfg.allow_pickled,  # the SDK warns at a pickled submit nobody here takes
        }
        if cfg.namespace:
            body["namespace"] = cfg.namespace
        try:
            answer = retrying(self.stopping.event)(self.client.register, body)
        except AuthError as exc:
            self._auth_failed(exc)
            return False
        except PlaneError as exc:
            if not self.stopping.event.is_set():
                log.error("registration failed: %s", exc)
                self.exit_code = 1
            return False
        if cfg.heartbeat_s is None and answer.get("heartbeat_s"):
            self.heartbeat_s = float(answer["heartbeat_s"])
        limits = self.client.limits_of(answer)  # what the control plane allows (ServerLimits)
        self.inline_threshold = limits.inline_threshold_bytes
        self.poller.limits = limits
        self.client.limits = limits  # its jobs' uploads (a checkpoint) are sized by it
        log.info(
            "registered as worker %s (runner %s, queues %s, %d slot(s)) with %s",
            self.worker_id,
            self.runner.name,
            ",".join(cfg.queues),
            cfg.concurrency,
            redact(cfg.server),
        )
        self.registered.set()
        self.notify.ready(f"worker {self.worker_id} registered")
        return True

    def _auth_failed(self, exc: AuthError) -> None:
        log.error(
            "the control plane rejected nymph's token (%s); create a daemon token with "
            "`lakeshore token create --kind daemon` and run `nymph doctor`",
            exc,
        )
        self.exit_code = EXIT_AUTH
        self.request_stop(immediate=False)

    # --- claiming --------------------------------------------------------------------------------

    def _claiming_stopped(self) -> bool:
        return self.stopping.event.is_set() or self.pin.target is not None

    def _ready_to_claim(self) -> bool:
        """Block until the runner works, the disks have room and the previous life is reconciled;
        False when stopping. Free space is looked at again before every claim."""
        while not self._claiming_stopped():
            if not self.runner_health.wait_ok(self._claiming_stopped, self.stopping.event.wait):
                return False
            if not self.disk.wait_ok(self._claiming_stopped, self.stopping.event.wait):
                return False
            if not self.runner_health.ok.is_set():
                continue
            if self.recovery.done or self.recovery.reconcile():
                return True
            if self.recovery.failures:
                self.stopping.event.wait(self.recovery.backoff_s())
        return False

    def _on_heartbeat(self, answer: dict[str, Any], sent: list[dict[str, Any]]) -> None:
        self.watchdog.pet()
        for command in answer.get("commands") or []:
            self.jobs.dispatch(command)
        # ``lost`` names the attempts this beat reported; a newer attempt claimed since then is not lost
        self.jobs.lose(list(answer.get("lost") or []), sent)
        self.pin.check(answer)

    # --- housekeeping ----------------------------------------------------------------------------

    def _reap_orphans(self) -> None:
        """Reap exited descendants reparented to nymph (a child subreaper), if the runner can."""
        if not self.runner.capabilities.reap_orphans:
            return
        try:
            cast(Reaping, self.runner).reap_orphans()
        except Exception:
            log.exception("reaping orphaned processes failed")

    def _prune(self) -> None:
        """Kept failed workdirs and ``*.old-*`` leftovers (:mod:`nymph.prune`), once the previous
        life was reconciled and then every ``PRUNE_EVERY_S``."""
        if not self.recovery.done or time.monotonic() < self._next_prune:
            return
        cfg = self.config
        # at least every minute, and twice per keep_failed_s when that is shorter
        self._next_prune = time.monotonic() + min(PRUNE_EVERY_S, max(1.0, cfg.keep_failed_s / 2))
        try:
            prune(
                cfg.workdir,
                keep_s=cfg.keep_failed_s,
                keep_bytes=int(cfg.keep_failed_mb * 2**20),
                busy=self.jobs.ids(),
            )
        except Exception:
            log.exception("pruning %s failed; tried again in %.0fs", cfg.workdir, PRUNE_EVERY_S)

    # --- shutdown --------------------------------------------------------------------------------

    def _dispatch_claimed(self, command: Any) -> None:
        """A poll's command; a run claimed as nymph stops (the poll was in flight) is acked
        ``preempted`` at once, never started (no workdir, no task), with ``started: false``: the
        control plane hands it to another nymph without counting an attempt or a preemption."""
        body = command.get("body") if isinstance(command, dict) else None
        if (
            self.stopping.event.is_set()
            and command.get("kind") == "run"
            and isinstance(body, dict)
            and self.outbox is not None
        ):
            try:
                invocation_id = ids.validate(body.get("invocation_id"), "invocation_id")
                attempt = int(body.get("attempt") or 1)
            except (InvalidId, TypeError, ValueError):
                self.jobs.dispatch(command)  # malformed: refused there, as any other
                return
            log.warning("invocation %s: claimed as nymph stops; handed back before it started", invocation_id)
            error = {
                "type": "Preempted",
                "message": SHUTDOWN_MESSAGE,
                "reason": self.stopping.why,
                "started": False,  # spends no attempt nor preemption (docs/protocol.md)
            }
            self.outbox.ack(
                {
                    "invocation_id": invocation_id,
                    "state": "preempted",
                    "result_blob": b"",
                    "error": error,
                    "worker_id": self.worker_id,
                    "attempt": attempt,
                }
            )
            return
        self.jobs.dispatch(command)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGUSR1:
            timeout = drain.take_timeout(self.config.state_dir, self.config.drain_timeout_s)
            bound = "as long as it takes" if timeout is None else f"{timeout:g}s"
            log.warning("SIGUSR1: draining: no new claims; running work has %s to finish", bound)
            self.stopping.request(grace_s=timeout, why=f"nymph drained (drain timeout {bound})")
            return
        if signum == signal.SIGINT:
            self.stopping.sigints += 1
        immediate = self.stopping.sigints >= 2
        log.warning(
            "%s: %s",
            signal.Signals(signum).name,
            "stopping now"
            if immediate
            else f"no new claims; running work has {self.config.grace_s:g}s to finish",
        )
        name = signal.Signals(signum).name
        self.stopping.request(
            immediate, self.config.grace_s, f"nymph stopped ({name}, grace {self.config.grace_s:g}s)"
        )

    def _shutdown(self) -> None:
        self.notify.stopping("shutting down")
        upgrading = self.pin.target is not None and self.exit_code == EXIT_OK
        start = self.stopping.since or time.monotonic()
        killed = False
        settle_by = start + self.config.poll_timeout_s + POLL_SETTLE_S
        while True:
            # An in-flight long poll is waited for (it ends within poll_timeout_s): what it still
            # claims is preempted before it starts (_dispatch_claimed) and its ack sent before nymph
            # exits; left behind, its lease would lapse and spend one of the call's attempts.
            # Read before ``busy``: a poller seen ended dispatched all it claimed.
            poll_settled = not self.poller.is_alive() or time.monotonic() >= settle_by
            busy = self.jobs.busy()
            if not busy and poll_settled:
                break
            deadline = self.stopping.deadline
            expired = deadline is not None and time.monotonic() >= deadline and not upgrading
            if (expired or self.stopping.immediate.is_set()) and busy:
                grace = 0.0 if self.stopping.immediate.is_set() else min(self.config.stop_grace_s, 2.0)
                count = self.jobs.stop_all(SHUTDOWN_MESSAGE, grace, self.stopping.why)
                if not killed:
                    log.warning("shutdown grace expired: stopping %d job(s)", count)
                killed = True
            if busy:
                self.jobs.wait_idle(SHUTDOWN_STEP_S)
            else:  # only the in-flight poll is waited for (wait_idle would return at once: a spin)
                self.poller.join(max(0.0, min(SHUTDOWN_STEP_S, settle_by - time.monotonic())))
        if self.outbox is not None and not self.outbox.flush(5.0):
            log.warning(
                "outbox: %d message(s) not delivered yet; the next start sends them", self.outbox.pending()
            )
        if upgrading:
            self.exit_code = upgrade.EXIT_VERSION_MISMATCH

    def _deregister(self) -> None:
        """Tell the control plane this worker stopped (not live from now), once shutdown is done;
        a control plane that cannot be told finds out when the live window lapses."""
        try:
            self.client.deregister(self.worker_id)
        except PlaneError as exc:
            log.warning(
                "could not deregister worker %s (%s); it shows as live until it is not seen",
                self.worker_id,
                exc,
            )
            return
        log.info("deregistered worker %s", self.worker_id)

    def _finish(self, health: Any) -> int:
        drain.clear_pid(self.config.state_dir)
        if self.outbox is not None:
            self.outbox.stop()
        if health is not None:
            health.stop()
        self.supervisor.close()  # nothing is parked any more: shutdown waited for every job
        self._close_runner()  # before a re-exec: nothing of the runner's (a zygote) outlives this life
        target = self.pin.target
        if self.exit_code == upgrade.EXIT_VERSION_MISMATCH and self.config.auto_upgrade and target:
            try:
                upgrade.upgrade_and_reexec(
                    target,
                    index_url=self.config.upgrade_index_url,
                    wheelhouse=self.config.upgrade_wheelhouse,
                )
            except UpgradeError as exc:
                log.error("auto-upgrade to %s failed: %s", target, exc)
        self.client.close()
        return self.exit_code

    def _close_runner(self) -> None:
        try:
            self.runner.close()
        except Exception:
            log.exception("closing runner %s failed", self.runner.name)
