"""One invocation, from a run command to its ack.

:class:`Job` runs in its own thread: the worker-side gates (pickle, ``as_user`` allow-list,
runner capabilities) before anything is written or spawned, GPUs, the private workdir,
``runner.start``, the persisted handle, the stream pump, the wait with the cancellation ladder
(cancel, ``timeout_s``, shutdown grace, lost lease), then the outcome into the durable outbox.
A restarted nymph builds a Job around a recovered handle (:meth:`Job.attach`) and supervises it
the same way.

Outcomes: ``succeeded`` (workdir deleted), ``failed`` (workdir kept with its logs), ``killed``
(``{type: "Cancelled", message: <why>}``) and ``timeout`` (``{type: "Timeout", ...}``).
A ``script`` run ends its LOG stream with END whose body is ``wire.pack({"exit_code": 0})`` (the
same bytes are the ack's ``result_blob``), or with ERROR ``{type: "ScriptFailed", ...}``.
"""

from __future__ import annotations

import logging
import os
import pwd
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.envelope import Envelope, is_pickled
from dreamlake.lakeshore.errors import LakeshoreError
from nymph import observability as obs
from nymph import workdir as wd
from nymph.config import NymphConfig
from nymph.outbox import Outbox
from nymph.pump import Pump
from nymph.runner import ExitStatus, Handle, Runner, RunnerError, RunnerUnavailable, Task
from nymph.slots import NotEnoughGpus, Slots, gpus_requested

log = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "daemon shutdown grace expired"
_WAIT_STEP_S = 0.2
RETRY_MAX_S = 10.0  # the longest pause between two tries of an unavailable runner


def backoff_s(tries: int, cap: float = RETRY_MAX_S) -> float:
    """Exponential backoff with full jitter: the pause before try ``tries + 1`` (0.5 s, 1 s, 2 s ...)."""
    return float(random.uniform(0.5, 1.0) * min(cap, 0.5 * 2 ** min(tries, 10)))


def _ignore_unavailable(exc: RunnerUnavailable) -> None:
    pass


@dataclass
class JobContext:
    """What every job shares with the agent."""

    config: NymphConfig
    runner: Runner
    outbox: Outbox
    slots: Slots
    worker_id: str
    on_done: Callable[[Job], None] = field(default=lambda job: None)
    # the runner said it cannot work (engine down): the agent stops claiming until check() passes
    on_unavailable: Callable[[RunnerUnavailable], None] = field(default=_ignore_unavailable)


class Refused(Exception):
    """A gate refused the invocation before anything was spawned."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message


class Job:
    """Supervises one invocation in a thread of its own."""

    def __init__(
        self,
        ctx: JobContext,
        invocation_id: str,
        attempt: int,
        body: dict[str, Any],
        *,
        after: Job | None = None,
    ) -> None:
        self.ctx = ctx
        self._after = after  # an earlier attempt of the same invocation, still stopping
        self.invocation_id = invocation_id
        self.attempt = attempt
        self.body = body
        self.run_config: dict[str, Any] = dict(body.get("run_config") or {})
        self.script: str | None = body.get("script") or self.run_config.get("script")
        self.as_user: str | None = body.get("as_user") or self.run_config.get("as_user")
        timeout = body.get("timeout_s", self.run_config.get("timeout_s"))
        self._bad_timeout: str | None = None
        try:
            self.timeout_s: float | None = float(timeout) if timeout not in (None, "", 0) else None
        except (TypeError, ValueError):  # refused by the gates, so the invocation is still acked
            self.timeout_s = None
            self._bad_timeout = f"run_config.timeout_s {timeout!r} is not a number of seconds"
        self.workdir: Path | None = None
        self.handle: Handle | None = None
        self.started_at = time.time()
        self._stop_request: tuple[str, dict[str, Any] | None, float] | None = None
        self._stop_event = threading.Event()
        self._lost = False
        self._gpus: list[str] = []
        self._thread: threading.Thread | None = None
        self._destroyed = False
        self.state: str | None = None

    # --- control from other threads --------------------------------------------------------------

    def cancel(self, message: str = "cancelled by producer", grace_s: float | None = None) -> None:
        """Stop the task with the ladder and ack ``killed`` ``{type: Cancelled, message}``."""
        grace = self.ctx.config.stop_grace_s if grace_s is None else grace_s
        self._request("killed", {"type": "Cancelled", "message": message}, grace)

    def lose(self) -> None:
        """Another attempt owns the invocation: kill it and do not ack."""
        self._lost = True
        self._request("lost", None, 0.0)

    def _request(self, state: str, error: dict[str, Any] | None, grace_s: float) -> None:
        if self._stop_request is None or state == "lost":
            self._stop_request = (state, error, grace_s)
        self._stop_event.set()

    @property
    def running_entry(self) -> dict[str, Any]:
        return {"invocation_id": self.invocation_id, "attempt": self.attempt}

    def start_thread(self, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=target, name=f"nymph-job-{self.invocation_id}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # --- a new invocation ------------------------------------------------------------------------

    def run(self) -> None:
        """Thread body for a freshly claimed invocation."""
        try:
            if self._after is not None:
                self._after.join()
                self._after = None
            self._run_new()
        except Exception as exc:  # never leave a claimed invocation without an ack
            log.exception("invocation %s: nymph failed while running it", self.invocation_id)
            self._settle(wd.Outcome.failed("DaemonError", f"nymph failed: {type(exc).__name__}: {exc}"))
        finally:
            self._release()

    def _run_new(self) -> None:
        cfg = self.ctx.config
        try:
            self._gates()
            self._gpus = self.ctx.slots.acquire_gpus(gpus_requested(self.run_config), self._stop_event) or []
        except Refused as exc:
            log.warning("invocation %s: refused: %s: %s", self.invocation_id, exc.type, exc.message)
            self._settle(wd.Outcome.failed(exc.type, exc.message))
            return
        except NotEnoughGpus as exc:
            self._settle(wd.Outcome.failed("NotEnoughGpus", str(exc)))
            return
        if self._stop_event.is_set():
            self._settle(self._stopped_outcome(None))
            return
        meta = {
            "invocation_id": self.invocation_id,
            "attempt": self.attempt,
            "script": self.script,
            "as_user": self.as_user,
            "timeout_s": self.timeout_s,
            "started_at": self.started_at,
            "gpus": self._gpus,
            "worker_id": self.ctx.worker_id,
        }
        self.workdir = wd.create(
            cfg.workdir, self.invocation_id, bytes(self.body.get("args_blob") or b""), meta, self.as_user
        )
        task = Task(
            invocation_id=self.invocation_id,
            attempt=self.attempt,
            workdir=self.workdir,
            env=self._env(),
            script=self.script,
            as_user=self.as_user,
            run_config=self.run_config,
            gpus=list(self._gpus),
            labels={"nymph.invocation": self.invocation_id, "nymph.worker": self.ctx.worker_id, **cfg.labels},
        )
        handle = self._start_when_available(task)
        if handle is None:  # stopped (cancel, shutdown, lost lease) while the runner was unavailable
            self._settle(self._stopped_outcome(None))
            return
        if isinstance(handle, RunnerError):
            self._settle(wd.Outcome.failed(type(handle).__name__, str(handle)))
            return
        self.handle = handle
        self.handle.save(self.workdir)
        log.info(
            "invocation %s: started (attempt %d, runner %s)",
            self.invocation_id,
            self.attempt,
            self.ctx.runner.name,
        )
        self._supervise()

    def _start_when_available(self, task: Task) -> Handle | RunnerError | None:
        """``runner.start``, tried again (backoff and jitter) while the runner is unavailable.

        An unavailable runner (the Docker engine down) is transient: the invocation stays claimed
        (the heartbeat keeps its lease) and is not settled; the agent is told, so it stops claiming
        and reports not-ready until ``runner.check()`` passes again. A refusal (RunnerError) is
        returned to be acked ``failed``; None when the job was stopped while waiting.
        """
        tries = 0
        while True:
            try:
                return self.ctx.runner.start(task)
            except RunnerUnavailable as exc:
                delay = backoff_s(tries)
                tries += 1
                log.warning(
                    "invocation %s: runner %s unavailable (try %d), kept claimed, retrying in %.1fs: %s",
                    self.invocation_id,
                    self.ctx.runner.name,
                    tries,
                    delay,
                    exc,
                )
                self.ctx.on_unavailable(exc)
                if self._stop_event.wait(delay):
                    return None
            except RunnerError as exc:
                return exc

    def _gates(self) -> None:
        cfg = self.ctx.config
        caps = self.ctx.runner.capabilities
        if self._bad_timeout:
            raise Refused("InvalidRunConfig", self._bad_timeout)
        if self.script is None:
            try:
                header = Envelope.header(bytes(self.body.get("args_blob") or b""))
            except LakeshoreError as exc:
                raise Refused(type(exc).__name__, f"bad envelope: {exc}") from exc
            if is_pickled(header.get("fn") or {}) and not cfg.allow_pickled:
                raise Refused(
                    "PickleRefused",
                    f"pickled function {header['fn'].get('where') or header['fn'].get('qualname')!r} refused: "
                    "this nymph runs only functions shipped by reference; start it with --allow-pickled "
                    "to accept pickled functions (that is code execution)",
                )
        if self.as_user:
            if self.as_user not in cfg.allow_users:
                raise Refused(
                    "UserNotAllowed",
                    f"as_user {self.as_user!r} is not allowed on this nymph (allowed: "
                    f"{', '.join(cfg.allow_users) or 'none'}); start it with --allow-user {self.as_user}",
                )
            if not caps.as_user:
                raise Refused(
                    "RunnerCapabilityMissing", f"runner {self.ctx.runner.name!r} cannot run as another user"
                )
            try:
                pwd.getpwnam(self.as_user)
            except KeyError:
                raise Refused(
                    "UserNotAllowed",
                    f"as_user {self.as_user!r} is allowed but is not a user on this host (its workdir is "
                    f"owned by that user); create it with useradd",
                ) from None
        if gpus_requested(self.run_config) and not caps.gpus:
            raise Refused("RunnerCapabilityMissing", f"runner {self.ctx.runner.name!r} cannot expose GPUs")
        for key, needed in (("image", caps.image), ("network", caps.network)):
            if self.run_config.get(key) and not needed:
                raise Refused(
                    "RunnerCapabilityMissing",
                    f"runner {self.ctx.runner.name!r} does not honour run_config.{key}",
                )
        resources = self.run_config.get("resources") or {}
        limits = [k for k in resources if k != "gpus"] if isinstance(resources, dict) else []
        if limits and not caps.resources:
            raise Refused(
                "RunnerCapabilityMissing",
                f"runner {self.ctx.runner.name!r} does not enforce resource limits ({', '.join(sorted(limits))})",
            )

    def _env(self) -> dict[str, str]:
        cfg = self.ctx.config
        env = {
            "LAKESHORE_ALLOW_PICKLED": "1" if cfg.allow_pickled else "0",
            "LAKESHORE_RUNTIME_POLICY": cfg.runtime_policy,
            "LAKESHORE_INVOCATION_ID": self.invocation_id,
        }
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if self._gpus or self.ctx.slots.gpu_total:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._gpus)
        return env

    # --- a recovered invocation ------------------------------------------------------------------

    @classmethod
    def attach(cls, ctx: JobContext, workdir: Path, meta: dict[str, Any], handle: Handle | None) -> Job:
        """A Job for a task a previous life started (``handle`` None: it never started)."""
        body: dict[str, Any] = {
            "run_config": {},
            "script": meta.get("script"),
            "as_user": meta.get("as_user"),
            "timeout_s": meta.get("timeout_s"),
        }
        job = cls(ctx, str(meta["invocation_id"]), int(meta.get("attempt", 1)), body)
        job.workdir = workdir
        job.handle = handle
        job.started_at = float(meta.get("started_at") or time.time())
        gpus = [str(g) for g in meta.get("gpus") or []]
        if handle is not None and gpus and ctx.slots.claim_gpus(gpus):
            job._gpus = gpus
        return job

    def resume(self, alive: bool | None) -> None:
        """Thread body for a recovered invocation: supervise it if alive, else report what it left.

        ``alive`` None: the runner could not say (engine down); ask again with backoff until it can.
        """
        try:
            if alive is None and self.handle is not None:
                alive = self._recover_when_available(self.handle)
                if alive is None:
                    self._deferred_stop()
                    return
            if self.handle is None:
                self._settle(
                    wd.Outcome.failed("DaemonRestart", "nymph restarted before the task was started")
                )
            elif alive:
                log.info("invocation %s: re-attached after restart", self.invocation_id)
                self._supervise()
            else:
                try:
                    outcome = self._collect(None)
                except Exception:
                    self._destroy()  # the failure is acked below; the task's resources go now
                    raise
                self._finish(outcome)
        except Exception as exc:
            log.exception("invocation %s: nymph failed while recovering it", self.invocation_id)
            self._settle(wd.Outcome.failed("DaemonError", f"nymph failed: {type(exc).__name__}: {exc}"))
        finally:
            self._release()

    def _recover_when_available(self, handle: Handle) -> bool | None:
        """``runner.recover`` tried again while the runner is unavailable; None if stopped meanwhile."""
        tries = 0
        while True:
            try:
                return bool(self.ctx.runner.recover(handle))
            except RunnerUnavailable as exc:
                delay = backoff_s(tries)
                tries += 1
                log.warning(
                    "invocation %s: cannot re-attach yet, runner %s unavailable (try %d); retrying in %.1fs",
                    self.invocation_id,
                    self.ctx.runner.name,
                    tries,
                    delay,
                )
                self.ctx.on_unavailable(exc)
                if self._stop_event.wait(delay):
                    return None

    def _deferred_stop(self) -> None:
        """Stopped before the runner came back: on shutdown leave everything to the next life."""
        request = self._stop_request
        if (
            request is not None
            and request[0] == "killed"
            and (request[1] or {}).get("message") == (SHUTDOWN_MESSAGE)
        ):
            log.warning(
                "invocation %s: runner still unavailable at shutdown; left for the next start",
                self.invocation_id,
            )
            self.state = "deferred"
            return
        log.warning(
            "invocation %s: stopped while the runner was unavailable; its task is collected later",
            self.invocation_id,
        )
        self._settle(self._stopped_outcome(None))

    # --- supervision -----------------------------------------------------------------------------

    def _supervise(self) -> None:
        assert self.handle is not None and self.workdir is not None
        pump = Pump(
            self.workdir, self.invocation_id, self.attempt, self.ctx.outbox, script=self.script is not None
        )
        self._pump = pump
        pump.start()
        try:
            self._supervise_with(pump)
        finally:  # whatever failed (a pump or outbox write, the wait): no container or pod outlives it
            pump.halt()
            self._destroy()

    def _supervise_with(self, pump: Pump) -> None:
        assert self.handle is not None
        runner = self.ctx.runner
        deadline = self.started_at + self.timeout_s if self.timeout_s else None
        status: ExitStatus | None = None
        stopped: tuple[str, dict[str, Any] | None, float] | None = None
        tries = 0
        while status is None:
            if self._stop_request is not None:
                stopped = self._stop_request
            elif deadline is not None and time.time() >= deadline:
                stopped = (
                    "timeout",
                    {
                        "type": "Timeout",
                        "message": f"timed out after {self.timeout_s:g}s (run_config.timeout_s)",
                    },
                    self.ctx.config.stop_grace_s,
                )
            if stopped is not None:
                log.info(
                    "invocation %s: stopping (%s), grace %.1fs", self.invocation_id, stopped[0], stopped[2]
                )
                try:
                    runner.stop(self.handle, stopped[2])
                    status = runner.wait(self.handle, 5.0) or ExitStatus(-9, "stopped")
                except RunnerUnavailable as exc:  # the labelled task is collected by a later start
                    log.warning("invocation %s: could not stop the task: %s", self.invocation_id, exc)
                    self.ctx.on_unavailable(exc)
                break
            try:
                status = runner.wait(self.handle, _WAIT_STEP_S)
                tries = 0
            except RunnerUnavailable as exc:  # engine lost mid-run: the task may well live on
                delay = backoff_s(tries)
                tries += 1
                log.warning(
                    "invocation %s: lost the runner while waiting (try %d), retrying in %.1fs: %s",
                    self.invocation_id,
                    tries,
                    delay,
                    exc,
                )
                self.ctx.on_unavailable(exc)
                self._stop_event.wait(delay)
        pump.stop()
        outcome = self._stopped_outcome(stopped) if stopped is not None else self._collect(status)
        self._finish(outcome)

    def _stopped_outcome(self, stopped: tuple[str, dict[str, Any] | None, float] | None) -> wd.Outcome:
        state, error, _ = (
            stopped or self._stop_request or ("killed", {"type": "Cancelled", "message": "cancelled"}, 0.0)
        )
        return wd.Outcome(state, b"", error)

    def _collect(self, status: ExitStatus | None) -> wd.Outcome:
        assert self.workdir is not None
        if status is None and self.handle is not None:
            status = self.ctx.runner.wait(self.handle, 0)
        return wd.read_outcome(self.workdir, status, script=self.script is not None)

    def _finish(self, outcome: wd.Outcome) -> None:
        """Close the stream, free the runner's resources (also when closing the stream fails), settle."""
        try:
            self._close_stream(outcome)
        finally:
            self._destroy()
        self._settle(outcome)

    def _destroy(self) -> None:
        """``runner.destroy`` once (it is idempotent, but one call is enough)."""
        if self.handle is None or self._destroyed:
            return
        self._destroyed = True
        try:
            self.ctx.runner.destroy(self.handle)
        except RunnerError as exc:
            log.warning("invocation %s: destroy failed: %s", self.invocation_id, exc)

    def _close_stream(self, outcome: wd.Outcome) -> None:
        pump = getattr(self, "_pump", None)
        if pump is None and self.workdir is not None:
            pump = Pump(
                self.workdir,
                self.invocation_id,
                self.attempt,
                self.ctx.outbox,
                script=self.script is not None,
            )
            pump.poll()
        if pump is not None and outcome.state != "lost":
            if self.script is not None and outcome.state == "succeeded":
                pump.finish(wire.FRAME_END, outcome.result_blob)
            elif (
                outcome.state != "succeeded" and (pump.sent_any or self.script is not None) and outcome.error
            ):
                pump.finish(wire.FRAME_ERROR, {k: str(v) for k, v in outcome.error.items()})

    def _settle(self, outcome: wd.Outcome) -> None:
        """Ack through the outbox (unless lost), then keep or delete the workdir."""
        self.state = outcome.state
        duration = time.time() - self.started_at
        if outcome.state == "lost" or self._lost:
            log.warning("invocation %s: lost to another attempt; killed, not acked", self.invocation_id)
            self.state = "lost"
        else:
            ack: dict[str, Any] = {
                "invocation_id": self.invocation_id,
                "state": outcome.state,
                "result_blob": outcome.result_blob,
                "error": outcome.error,
                "worker_id": self.ctx.worker_id,
                "attempt": self.attempt,
            }
            self.ctx.outbox.ack(ack)
        if self.workdir is not None:
            if outcome.state == "succeeded" or self.state == "lost":
                wd.remove(self.workdir)
            else:
                wd.mark_settled(self.workdir, outcome)
        err = f" {outcome.error.get('type')}: {outcome.error.get('message')}" if outcome.error else ""
        log.info(
            "invocation %s: %s runner=%s attempt=%d duration=%.3fs%s",
            self.invocation_id,
            self.state,
            self.ctx.runner.name,
            self.attempt,
            duration,
            err,
        )
        obs.INVOCATIONS.labels(runner=self.ctx.runner.name, state=self.state).inc()
        obs.INVOCATION_SECONDS.labels(runner=self.ctx.runner.name).observe(duration)

    def _release(self) -> None:
        self.ctx.slots.release_gpus(self._gpus)
        self._gpus = []
        # forget the job before freeing its slot: a poll woken by the slot may claim its next attempt
        self.ctx.on_done(self)
        self.ctx.slots.put()
