"""The agent: registration, the poll loop, command dispatch, shutdown and version pinning.

Concurrency model: threads. The main thread owns signals and the shutdown sequence; one thread
long-polls (only while a slot is free, asking for at most as many invocations as free slots, with
jitter and exponential backoff on transient errors); each invocation runs in a :class:`Job`
thread; the heartbeat and the outbox sender have a thread each.

Exit codes of :meth:`Agent.run`: 0 after a shutdown; :data:`EXIT_AUTH` when the control plane
rejects the token (401/403); ``upgrade.EXIT_VERSION_MISMATCH`` (75) after draining for a pinned
version other than ours (or the upgrade re-execs).

Shutdown (SIGTERM, or the first SIGINT): stop polling, let running work finish within
``grace_s``, then stop what remains with the ladder and ack it ``killed`` with exactly
``{type: "Cancelled", message: "daemon shutdown grace expired"}``; a second SIGINT skips the
grace. The outbox is flushed best-effort; what it keeps is replayed by the next start.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import tenacity

from dreamlake.lakeshore import __version__, ids
from dreamlake.lakeshore.errors import InvalidId
from nymph import observability as obs
from nymph import upgrade
from nymph import workdir as wd
from nymph.client import AuthRejected, ClientError, ControlPlaneClient, is_retryable
from nymph.config import NymphConfig
from nymph.execjob import ExecJob, recover_execs
from nymph.heartbeat import Heartbeat
from nymph.identity import load_or_create_worker_id
from nymph.job import SHUTDOWN_MESSAGE, Job, JobContext, backoff_s
from nymph.outbox import Outbox
from nymph.reconcile import recover_all, sweep_labelled
from nymph.runner import Runner, RunnerUnavailable
from nymph.sdnotify import SdNotify
from nymph.slots import Slots

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_AUTH = 77  # EX_NOPERM: fix the token, do not restart in a loop


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
        self.notify = notify or SdNotify()
        self.worker_id = ""
        self.heartbeat_s = config.heartbeat_s or 10.0
        self._jobs: dict[str, Job] = {}
        self._execs: dict[str, ExecJob] = {}
        self._poller: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._immediate = threading.Event()
        self._stop_time: float | None = None
        self._exit_code = EXIT_OK
        self._target_version: str | None = None
        self._ready = False
        self._outbox_ok = True
        self._last_poll_ok = False
        self._sigints = 0
        # the runner's health: claims stop (and /healthz says why) while check() fails
        self._runner_ok = threading.Event()
        self._runner_problem: str | None = None
        self._runner_checking = threading.Lock()
        self._reconciled = False
        self._reconcile_failures = 0  # in a row, other than an unavailable runner
        self._sweep_pending = False  # labelled tasks of a previous life could not be listed yet
        self._sweep_next = 0.0
        self._pending_recovery: list[dict[str, Any]] = []
        self.outbox: Outbox | None = None
        self.registered = threading.Event()

    # --- public ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Run until shutdown; return the process exit code."""
        cfg = self.config
        cfg.workdir.mkdir(parents=True, exist_ok=True, mode=0o711)
        cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.worker_id = load_or_create_worker_id(cfg.state_dir)
        self.outbox = Outbox(cfg.state_dir, self.client, on_sent=self._outbox_result)
        self.outbox.start()
        health = None
        if cfg.metrics_port is not None:
            health = obs.start_health_server(cfg.metrics_host, cfg.metrics_port, self.health)
        if not self._register():
            return self._finish(health)
        if self._check_runner():
            self._reconcile()
        else:
            self._pending_recovery = _leftover_entries(cfg.workdir)
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
        poller = threading.Thread(target=self._poll_loop, name="nymph-poll", daemon=True)
        self._poller = poller
        poller.start()
        while not self._stopping.wait(0.5):
            self._reap_orphans()
            self._sweep_labelled()
        self._shutdown(poller)
        hb.stop()
        return self._finish(health)

    def request_stop(self, immediate: bool = False) -> None:
        if self._stop_time is None:
            self._stop_time = time.monotonic()
        if immediate:
            self._immediate.set()
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def running(self) -> list[dict[str, Any]]:
        with self._lock:
            entries = [job.running_entry for job in self._jobs.values()]
            # a previous life's work waiting for the runner to come back keeps its lease
            known = {e["invocation_id"] for e in entries}
            entries += [e for e in self._pending_recovery if e["invocation_id"] not in known]
            return entries

    def running_exec(self) -> list[dict[str, Any]]:
        """The exec jobs running here, ``{exec_id, attempt}``: the heartbeat renews their leases."""
        with self._lock:
            entries = [job.running_entry for job in self._execs.values()]
        return [e for e in entries if e is not None]

    def health(self) -> dict[str, Any]:
        return {
            "ok": self._ready and self._runner_ok.is_set() and not self._stopping.is_set(),
            "runner_ok": self._runner_ok.is_set(),
            "runner_problem": self._runner_problem,
            "worker_id": self.worker_id,
            "version": __version__,
            "runner": self.runner.name,
            "running": len(self.running()),
            "free_slots": self.slots.free(),
            "outbox_pending": self.outbox.pending() if self.outbox else 0,
            "last_poll_ok": self._last_poll_ok,
        }

    # --- start-up --------------------------------------------------------------------------------

    def _context(self) -> JobContext:
        assert self.outbox is not None
        return JobContext(
            self.config,
            self.runner,
            self.outbox,
            self.slots,
            self.worker_id,
            on_done=self._job_done,
            on_unavailable=self._runner_unavailable,
        )

    # --- the runner's health ---------------------------------------------------------------------

    def _check_runner(self) -> bool:
        """Run ``runner.check()``; True when it passes. Never raises: nymph keeps running."""
        with self._runner_checking:
            try:
                self.runner.check()
            except Exception as exc:
                self._runner_unavailable(exc)
                return False
            if not self._runner_ok.is_set():
                if self._runner_problem is not None:
                    log.warning("runner %s is available again; claiming work", self.runner.name)
                self._runner_problem = None
                self._runner_ok.set()
                self.notify.status(f"worker {self.worker_id}: runner {self.runner.name} ok")
            return True

    def _runner_unavailable(self, exc: BaseException) -> None:
        """The runner cannot work: stop claiming and report not-ready until check() passes again."""
        problem = f"{type(exc).__name__}: {exc}"
        was_ok = self._runner_ok.is_set() or self._runner_problem is None
        self._runner_ok.clear()
        if problem != self._runner_problem or was_ok:
            log.error(
                "runner %s cannot work: %s -- no new claims until it can (retrying; "
                "`nymph doctor` says what to fix)",
                self.runner.name,
                exc,
            )
            self.notify.status(f"runner {self.runner.name} unavailable: {exc}")
        self._runner_problem = problem

    def _await_runner(self) -> bool:
        """Block (backoff and jitter) until ``runner.check()`` passes; False when stopping."""
        tries = 0
        while not self._claiming_stopped():
            if self._runner_ok.is_set() or self._check_runner():
                return True
            self._stopping.wait(backoff_s(tries))
            tries += 1
        return False

    def _reconcile(self) -> bool:
        """Recover what a previous life left (deferred while the runner is unavailable).

        Never raises: any other failure is logged and reconciliation is tried again later (with
        backoff, from the poll loop; no claims until it succeeds, so new work never races it).
        """
        ctx = self._context()
        try:
            found = recover_all(ctx)
            recover_execs(self.config.workdir, self.runner, self._require_outbox(), self.worker_id)
        except RunnerUnavailable as exc:
            self._runner_unavailable(exc)
            if not self._pending_recovery:
                self._pending_recovery = _leftover_entries(self.config.workdir)
            log.warning("reconciling the previous run's work is deferred until the runner is back")
            return False
        except Exception as exc:
            self._reconcile_failures += 1
            if not self._pending_recovery:
                self._pending_recovery = _leftover_entries(self.config.workdir)
            log.exception(
                "reconciling the previous run's work failed (%s: %s); no claims until it succeeds, "
                "trying again (try %d)",
                type(exc).__name__,
                exc,
                self._reconcile_failures,
            )
            return False
        self._reconcile_failures = 0
        self._sweep_pending = found.sweep_pending
        for job, alive in found:
            self._launch(job, lambda j=job, a=alive: j.resume(a))
        with self._lock:
            self._pending_recovery = []
        self._reconciled = True
        return True

    def _sweep_labelled(self) -> None:
        """Retry the labelled-task sweep reconcile could not do (listing failed), with backoff."""
        if not self._sweep_pending or time.monotonic() < self._sweep_next:
            return

        def live() -> set[str]:
            with self._lock:
                return set(self._jobs) | set(self._execs)

        try:
            done = sweep_labelled(self._context(), live)
        except Exception as exc:  # RunnerUnavailable included: tried again later
            log.warning("removing labelled tasks of a previous run failed again: %s", exc)
            done = False
        if done:
            self._sweep_pending = False
            return
        self._reconcile_failures += 1
        self._sweep_next = time.monotonic() + backoff_s(self._reconcile_failures, cap=60.0)

    def _retrying(self) -> tenacity.Retrying:
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_retryable),
            wait=tenacity.wait_exponential(multiplier=0.2, max=15.0)
            + tenacity.wait_random(0, 1.0)
            + tenacity.wait_exception(
                lambda e: (getattr(e, "retry_after", None) or 0.0) * random.uniform(1, 1.5)
            ),
            stop=tenacity.stop_when_event_set(self._stopping),
            sleep=self._sleep,
            before_sleep=lambda rs: log.warning(
                "control plane unavailable (try %d), retrying: %s",
                rs.attempt_number,
                rs.outcome.exception() if rs.outcome else None,
            ),
            reraise=True,
        )

    def _sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    def _register(self) -> bool:
        cfg = self.config
        body: dict[str, Any] = {
            "worker_id": self.worker_id,
            "hostname": socket.gethostname(),
            "version": __version__,
            "runner": self.runner.name,
            "queues": list(cfg.queues),
            "labels": dict(cfg.labels),
            "slots": cfg.concurrency,
        }
        if cfg.namespace:
            body["namespace"] = cfg.namespace
        try:
            answer = self._retrying()(self.client.register, body)
        except AuthRejected as exc:
            self._auth_failed(exc)
            return False
        except ClientError as exc:
            if not self._stopping.is_set():
                log.error("registration failed: %s", exc)
                self._exit_code = 1
            return False
        if cfg.heartbeat_s is None and answer.get("heartbeat_s"):
            self.heartbeat_s = float(answer["heartbeat_s"])
        log.info(
            "registered as worker %s (runner %s, queues %s, %d slot(s)) with %s",
            self.worker_id,
            self.runner.name,
            ",".join(cfg.queues),
            cfg.concurrency,
            cfg.server,
        )
        self._ready = True
        self.registered.set()
        self.notify.ready(f"worker {self.worker_id} registered")
        return True

    def _auth_failed(self, exc: AuthRejected) -> None:
        log.error(
            "the control plane rejected nymph's token (%s); create a daemon token with "
            "`lakeshore token create --kind daemon` and run `nymph doctor`",
            exc,
        )
        self._exit_code = EXIT_AUTH
        self.request_stop(immediate=False)

    # --- polling ---------------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._claiming_stopped():
            if not self._runner_ok.is_set() or not self._reconciled:
                if not self._await_runner():
                    break
                if not self._reconciled and not self._reconcile():
                    if self._reconcile_failures:
                        self._stopping.wait(backoff_s(self._reconcile_failures, cap=60.0))
                    continue
            free = self.slots.free()
            if free <= 0:
                self.slots.wait_free(1.0)
                continue
            body = {
                "worker_id": self.worker_id,
                "queues": list(self.config.queues),
                "max": free,
                "timeout_s": self.config.poll_timeout_s,
                "version": __version__,
            }
            try:
                answer = self._retrying()(self.client.poll, body, timeout_s=self.config.poll_timeout_s)
            except AuthRejected as exc:
                obs.POLLS.labels(outcome="auth").inc()
                self._auth_failed(exc)
                return
            except ClientError as exc:
                obs.POLLS.labels(outcome="error").inc()
                if not self._stopping.is_set():
                    log.error("poll refused: %s", exc)
                    self._stopping.wait(5.0)
                continue
            self._last_poll_ok = True
            commands = answer.get("commands") or []
            obs.POLLS.labels(outcome="claimed" if commands else "empty").inc()
            self._pet()
            for command in commands:
                self._dispatch(command)
            self._check_version(answer)
            if not commands:
                # jitter between empty long polls, so a fleet does not poll in lockstep
                self._stopping.wait(random.uniform(0.0, 0.05))

        log.info("poll loop stopped: no new claims")

    def _claiming_stopped(self) -> bool:
        return self._stopping.is_set() or self._target_version is not None

    def _dispatch(self, command: Any) -> None:
        """Handle one command; a malformed one is logged and skipped, never fatal to the caller."""
        try:
            self._dispatch_one(command)
        except Exception:
            cid = command.get("id") if isinstance(command, dict) else None
            log.exception("command %s could not be handled; ignored: %.300r", cid, command)

    def _dispatch_one(self, command: dict[str, Any]) -> None:
        kind = command.get("kind")
        body = command.get("body") or {}
        if kind == "run":
            self._start_run(body)
        elif kind == "exec":
            self._start_exec(body)
        elif kind == "cancel":
            self._cancel(
                str(body.get("invocation_id", "")), str(body.get("reason") or "cancelled by producer")
            )
        else:
            log.warning(
                "command %s of kind %r is not supported by this nymph; ignored", command.get("id"), kind
            )

    def _start_run(self, body: dict[str, Any]) -> None:
        try:
            invocation_id = ids.validate(body.get("invocation_id"), "invocation_id")
        except InvalidId as exc:
            log.error("run command refused before it touched the disk: %s", exc)
            return
        try:
            attempt = int(body.get("attempt") or 1)
        except (TypeError, ValueError):
            log.error(
                "invocation %s: run command refused: attempt %r is not a number",
                invocation_id,
                body.get("attempt"),
            )
            return
        with self._lock:
            earlier = self._jobs.get(invocation_id)
        if earlier is not None and earlier.attempt >= attempt:
            log.warning("invocation %s: already running here; duplicate run command ignored", invocation_id)
            return
        if earlier is not None:
            # a newer attempt of what runs here: the old copy lost its lease; stop it (no ack) and
            # start the new one once it is gone, so the two never share the workdir
            log.warning(
                "invocation %s: attempt %d supersedes attempt %d running here",
                invocation_id,
                attempt,
                earlier.attempt,
            )
            earlier.lose()
        if not self.slots.take():
            self.slots.force_take()
        job = Job(self._context(), invocation_id, attempt, body, after=earlier)
        self._launch(job, job.run, take=False)

    def _start_exec(self, body: dict[str, Any]) -> None:
        job = ExecJob(
            body,
            runner=self.runner,
            client=self.client,
            outbox=self._require_outbox(),
            root=self.config.workdir,
            stop_grace_s=self.config.stop_grace_s,
            on_done=self._exec_done,
            worker_id=self.worker_id,
        )
        with self._lock:
            running = self._execs.get(job.exec_id) if job.exec_id else None
            if running is not None:
                # a newer claim of a job still running here: run on, under that attempt
                if not running.adopt(body.get("attempt")):
                    log.warning("exec %s: already running here; duplicate exec command ignored", job.exec_id)
                return
            self._execs[job.exec_id] = job
        if not self.slots.take():
            self.slots.force_take()
        job.start_thread()

    def _exec_done(self, job: ExecJob) -> None:
        with self._lock:
            if self._execs.get(job.exec_id) is job:
                del self._execs[job.exec_id]
        self.slots.put()

    def _require_outbox(self) -> Outbox:
        assert self.outbox is not None
        return self.outbox

    def _reap_orphans(self) -> None:
        """Reap exited descendants reparented to nymph (it is a child subreaper), if the runner can."""
        reap = getattr(self.runner, "reap_orphans", None)
        if callable(reap):
            try:
                reap()
            except Exception:
                log.exception("reaping orphaned processes failed")

    def _launch(self, job: Job, target: Any, take: bool = True) -> None:
        if take and not self.slots.take():
            self.slots.force_take()
        with self._lock:
            self._jobs[job.invocation_id] = job
        obs.RUNNING.set(len(self._jobs))
        job.start_thread(target)

    def _job_done(self, job: Job) -> None:
        with self._lock:
            if self._jobs.get(job.invocation_id) is job:
                del self._jobs[job.invocation_id]
            obs.RUNNING.set(len(self._jobs))

    def _cancel(self, invocation_id: str, reason: str) -> None:
        with self._lock:
            job = self._jobs.get(invocation_id)
        if job is None:
            log.info("invocation %s: cancel for an invocation not running here; ignored", invocation_id)
            return
        log.info("invocation %s: cancel requested: %s", invocation_id, reason)
        job.cancel(reason)

    # --- heartbeat answers -----------------------------------------------------------------------

    def _on_heartbeat(self, answer: dict[str, Any], sent: list[dict[str, Any]]) -> None:
        self._pet()
        for command in answer.get("commands") or []:
            self._dispatch(command)
        # ``lost`` names the attempts this beat reported; a newer attempt claimed since then is not lost
        reported = {str(e["invocation_id"]): int(e["attempt"]) for e in sent if "invocation_id" in e}
        reported_exec = {str(e["exec_id"]): int(e["attempt"]) for e in sent if "exec_id" in e}
        for lost_id in answer.get("lost") or []:
            with self._lock:
                job = self._jobs.get(str(lost_id))
                exec_job = self._execs.get(str(lost_id))
            if job is not None and job.attempt <= reported.get(str(lost_id), 0):
                log.warning("invocation %s: lease lost to another attempt; killing it", lost_id)
                job.lose()
            if exec_job is not None and (exec_job.attempt or 0) <= reported_exec.get(str(lost_id), 0):
                log.warning("exec %s: lease lost to another claim; stopping it", lost_id)
                exec_job.lose()
        self._check_version(answer)

    def _check_version(self, answer: dict[str, Any]) -> None:
        target = answer.get("target_nymph_version")
        if not target or target == __version__ or self._target_version is not None:
            return
        log.warning(
            "the control plane pins nymph %s (this is %s): no new claims, draining %d running invocation(s)",
            target,
            __version__,
            len(self.running()),
        )
        self._target_version = str(target)
        self.notify.status(f"draining for nymph {target}")
        threading.Thread(target=self._drain_for_upgrade, name="nymph-drain", daemon=True).start()

    def _drain_for_upgrade(self) -> None:
        # A long poll in flight when the pin landed may still claim work: wait for it to return
        # (its claims are run like any other) before waiting for the running work to finish.
        while not self._stopping.is_set() and (
            (self._poller is not None and self._poller.is_alive()) or self._busy()
        ):
            self._stopping.wait(0.2)
        self.request_stop()

    def _busy(self) -> bool:
        with self._lock:
            return bool(self._jobs or self._execs)

    # --- health ----------------------------------------------------------------------------------

    def _outbox_result(self, ok: bool) -> None:
        self._outbox_ok = ok
        obs.OUTBOX_PENDING.set(self.outbox.pending() if self.outbox else 0)
        if ok:
            self._pet()

    def _pet(self) -> None:
        if self._outbox_ok:
            self.notify.watchdog()

    # --- shutdown --------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
        immediate = self._sigints >= 2
        log.warning(
            "%s: %s",
            signal.Signals(signum).name,
            "stopping now"
            if immediate
            else f"no new claims; running work has {self.config.grace_s:g}s to finish",
        )
        self.request_stop(immediate=immediate)

    def _shutdown(self, poller: threading.Thread) -> None:
        self.notify.stopping("shutting down")
        upgrading = self._target_version is not None and self._exit_code == EXIT_OK
        start = self._stop_time or time.monotonic()
        killed = False
        while True:
            with self._lock:
                jobs: list[Job | ExecJob] = [*self._jobs.values(), *self._execs.values()]
            # An in-flight long poll is not waited for on SIGTERM: whatever it might still claim
            # comes back to the queue when its lease lapses (at-least-once), so shutdown stays
            # prompt. Draining for a pinned version waits for it (see _drain_for_upgrade).
            poll_settled = not poller.is_alive() or time.monotonic() >= start + 1.0
            if not jobs and poll_settled:
                break
            expired = time.monotonic() >= start + self.config.grace_s and not upgrading
            if (expired or self._immediate.is_set()) and jobs:
                grace = 0.0 if self._immediate.is_set() else min(self.config.stop_grace_s, 2.0)
                for job in jobs:
                    job.cancel(SHUTDOWN_MESSAGE, grace_s=grace)
                if not killed:
                    log.warning("shutdown grace expired: stopping %d invocation(s)", len(jobs))
                killed = True
            time.sleep(0.05)
        if self.outbox is not None and not self.outbox.flush(5.0):
            log.warning(
                "outbox: %d message(s) not delivered yet; the next start sends them", self.outbox.pending()
            )
        if upgrading:
            self._exit_code = upgrade.EXIT_VERSION_MISMATCH

    def _finish(self, health: Any) -> int:
        if self.outbox is not None:
            self.outbox.stop()
        if health is not None:
            health.stop()
        if (
            self._exit_code == upgrade.EXIT_VERSION_MISMATCH
            and self.config.auto_upgrade
            and self._target_version
        ):
            try:
                upgrade.upgrade_and_reexec(
                    self._target_version,
                    index_url=self.config.upgrade_index_url,
                    wheelhouse=self.config.upgrade_wheelhouse,
                )
            except upgrade.UpgradeError as exc:
                log.error("auto-upgrade to %s failed: %s", self._target_version, exc)
        self.client.close()
        return self._exit_code

    def pid(self) -> int:
        return os.getpid()


def _leftover_entries(root: Any) -> list[dict[str, Any]]:
    """``{invocation_id, attempt}`` of every unsettled workdir a previous life left (for leases)."""
    out: list[dict[str, Any]] = []
    for path in wd.leftovers(root):
        meta = wd.read_meta(path)
        if wd.is_settled(path) or not meta or meta.get("invocation_id") != path.name:
            continue
        out.append({"invocation_id": path.name, "attempt": int(meta.get("attempt", 1))})
    return out
