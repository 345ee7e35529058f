"""One invocation, from a run command to its ack: the invocation's steps of the supervised
lifecycle (:mod:`nymph.lifecycle`).

:class:`Job` prepares with the worker-side gates (``script`` only with ``--allow-script``,
pickle, ``--allow-module``, the ``as_user`` allow-list, who the task runs as and never root unless
allowed (:mod:`nymph.taskuser`), runner capabilities, a sane ``timeout_s``) before anything is
written or spawned, then GPUs and the private workdir, owned by the task's user; it supervises
with the stream pump around the lifecycle's wait (cancel, ``timeout_s``, shutdown grace and a
lost lease stop it with the ladder) and settles into the durable outbox, after its frames (see
:meth:`Job._close_stream`). A restarted nymph builds a Job around a recovered handle (:meth:`Job.attach`) and
supervises it the same way (:meth:`Job.resume`).

Outcomes: ``succeeded`` (workdir deleted), ``failed`` (workdir kept with its logs), ``killed``
(``{type: "Cancelled", message: <why>}``), ``timeout`` (``{type: "Timeout", ...}``) and
``preempted`` (nymph stopped under it: ``{type: "Preempted", message: "daemon shutdown grace
expired"}``; the control plane requeues it; ``started: false`` in the error when the task never
started, so the hand-back spends nothing). Before the ladder signals the task, ``stop.reason``
in the workdir says why (the entry's ``dls.Interrupted`` carries it) and ``stop.json`` records the
stop, so a nymph that dies before it settles acks that stop after its restart, not the failure the
``Interrupted`` left.
A ``script`` run ends its LOG stream with END whose body is ``wire.pack({"exit_code": 0})`` (the
same bytes are the ack's ``result_blob``), or with ERROR ``{type: "ScriptFailed", ...}``.

One idea: one invocation's steps (prepare, supervise, settle) over one :class:`Job`, whose
attributes every step reads and writes; the pieces that stand alone already live apart (gates,
workdir, taskenv, callenv, checkpoints, the pump), so what is left is over 600 lines as one class.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.daemon.entry import STOP_REASON_FILE
from dreamlake.lakeshore.errors import LakeshoreError
from dreamlake.lakeshore.protocol.limits import by_reference
from nymph import checkpoints, codecache, gates, jobcode, refs, safeio, taskenv, tasktls, taskuser
from nymph import observability as obs
from nymph import workdir as wd
from nymph.callenv import CallEnv
from nymph.errors import GateRefused
from nymph.lifecycle import SHUTDOWN_MESSAGE, JobContext, Phase, Stop, SupervisedJob, backoff_s
from nymph.outbox import CHUNKS
from nymph.pump import Pump
from nymph.runner import ExitStatus, Handle, Task
from nymph.sends import SendRelay
from nymph.slots import gpus_requested

__all__ = ["SHUTDOWN_MESSAGE", "GateRefused", "Job", "JobContext", "backoff_s"]

log = logging.getLogger(__name__)

_ERROR_TYPES = {"killed": "Cancelled", "timeout": "Timeout", "preempted": "Preempted"}
# what the entry's Interrupted says (entry.STOP_REASON_FILE), by Stop.reason
_INTERRUPT_REASONS = {
    "killed": "cancelled",
    "timeout": "timeout",
    "preempted": "preempted",
    "lost": "cancelled",
}
SPILL_AFTER_S = 2.0  # how long a finished job waits for its frames before the outbox takes them
# arguments up to this size go to a runner that takes them in the Task (Capabilities.args_inline)
# instead of into args.msgpack: one file less per invocation; larger ones are written as always
ARGS_INLINE_MAX = 64 * 1024
RESTART_MESSAGE = "nymph restarted between the claim and the start"
T = TypeVar("T")


class Job(SupervisedJob[wd.Outcome]):
    """One invocation: its steps in a thread, its running task parked in the supervisor loop
    where the runner allows (:mod:`nymph.supervisor`)."""

    kind: ClassVar[str] = "invocation"
    id_field: ClassVar[str] = "invocation_id"
    timeout_field: ClassVar[str] = "run_config.timeout_s"
    parkable: ClassVar[bool] = True  # a running task waits in the supervisor loop where it can

    def __init__(
        self,
        ctx: JobContext,
        invocation_id: str,
        attempt: int,
        body: dict[str, Any],
        *,
        after: Job | None = None,
    ) -> None:
        self.body = body
        given = body.get("run_config") or {}
        # a run_config that is not a map is refused by the gates (``InvalidRunConfig``, acked), not
        # raised here, outside the lifecycle that acks (the call would wait out its lease)
        self.bad_run_config = (
            None
            if isinstance(given, dict)
            else f"run_config must be a map, got {type(given).__name__}: {str(given)[:80]!r}"
        )
        self.run_config: dict[str, Any] = dict(given) if isinstance(given, dict) else {}
        super().__init__(ctx, invocation_id, attempt, body.get("timeout_s", self.run_config.get("timeout_s")))
        self.invocation_id = invocation_id
        self.attempt: int = attempt
        self._after = after  # an earlier attempt of the same invocation, still stopping
        self.script: str | None = body.get("script") or self.run_config.get("script")
        self.as_user: str | None = body.get("as_user") or self.run_config.get("as_user")
        self.run_as: str | None = self.as_user  # who the task runs as (nymph.taskuser), set by the gates
        self._pump: Pump | None = None
        self._staged: Path | None = None  # args_ref fetched into {workdir}/.incoming, not yet moved in
        self._code: dict[str, Any] | None = None  # cfg["code"] of the Envelope: a shipped code archive
        self._code_held: str | None = None  # the sha256 this job holds in the code cache
        self._code_dirs: list[Path] = []
        self._callenv = CallEnv()  # its pip environment, secrets, variables and mounts (nymph.callenv)
        self._overflow: str | None = None  # why the stream overflowed (the invocation fails)
        self._args_inline: bytes | None = None  # handed to the runner in the Task, not in args.msgpack
        self.state: str | None = None  # the settled state; "deferred": left for the next life
        self._made_workdir = False  # this life made the workdir (prepare): no stream state there yet
        self._sends: SendRelay | None = None  # a two-way call's sends, fetched into the workdir
        self._tls: list[tuple[str, bytes, int]] = []  # the TLS files handed to the task (nymph.tasktls)
        self._claimed_by: str | None = None  # the worker a recovered workdir says claimed it
        self._start_tried = False  # runner.start was called: the task may have started, answer or not

    def cancel(self, message: str = "cancelled by producer", grace_s: float | None = None) -> None:
        """Stop the task with the ladder and ack ``killed`` ``{type: Cancelled, message}``."""
        super().cancel(message, grace_s)

    # --- a new invocation ------------------------------------------------------------------------

    def prepare(self) -> Task | None:
        if self._after is not None:  # the earlier attempt must be gone before this one uses the workdir
            self._after.join()
            self._after = None
        if self.body.get("args_ref") is not None and self.script is None:
            self._staged = refs.stage_args(self.ctx.client, self.ctx.config.workdir, self.body)
        self._gates()
        self._callenv.fetch_secrets(
            self.ctx, self.invocation_id, self.attempt, self.run_config.get("secrets")
        )
        self._fetch_code()
        pip_env = self._callenv.build(self.ctx, self.run_config, self.run_as)
        if pip_env is not None:  # after the shipped code on the task's import path
            self._code_dirs.append(pip_env)
        wanted = gpus_requested(self.run_config)
        if len(self._gpus) != wanted:  # taken when the run command came (Jobs.start_run), else now
            self.ctx.slots.release_gpus(self._gpus)
            self._gpus = []
            self._gpus = self.ctx.slots.acquire_gpus(wanted)
        if self.due_stop() is not None:
            return None
        cfg = self.ctx.config
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
        meta["run_as"] = self.run_as
        meta["code_sha256"] = self._code_held  # a restarted nymph holds the archive its task runs from
        meta["env_sha256"] = self._callenv.held  # and the pip environment
        if self.run_config.get("two_way"):  # a restarted nymph fetches its sends again
            meta["two_way"] = True
        blob = bytes(self.body.get("args_blob") or b"")
        inline = (
            self.ctx.runner.capabilities.args_inline
            and self.script is None
            and self._staged is None
            and len(blob) <= ARGS_INLINE_MAX
        )
        self._args_inline = blob if inline else None
        self._tls = tasktls.workdir_files()
        self.workdir = wd.create(
            cfg.workdir,
            self.invocation_id,
            blob,
            meta,
            self.run_as,
            args_file=self._staged,
            write_args=not inline,
            token=self._token(),
            extra=self._tls,
        )
        self._made_workdir = True
        self._staged = None
        checkpoints.restore(self.ctx.client, self.workdir, self.body)  # an earlier attempt's
        return Task(
            invocation_id=self.invocation_id,
            attempt=self.attempt,
            workdir=self.workdir,
            env=self._env(),
            script=self.script,
            as_user=self.run_as,
            run_config=self.run_config,
            gpus=list(self._gpus),
            labels={"nymph.invocation": self.invocation_id, "nymph.worker": self.ctx.worker_id, **cfg.labels},
            code_dirs=list(self._code_dirs),
            mounts=dict(self._callenv.mounts),
            args=self._args_inline,
            namespace=refs.namespace_of(self.body),
        )

    def _fetch_code(self) -> None:
        """The code archive the call shipped, held while the task runs (:mod:`nymph.jobcode`)."""
        if self._code is not None:
            self._code_dirs = [jobcode.acquire(self.ctx, self._code)]
            self._code_held = str(self._code["sha256"])

    def _code_cache(self) -> codecache.CodeCache:
        return jobcode.cache_of(self.ctx.config)

    def _release_code(self) -> None:
        if self._code_held is not None:
            self._code_cache().release(self._code_held)
            self._code_held = None

    def _release(self) -> None:
        self._release_code()
        self._callenv.release(self.ctx.config)
        if self._sends is not None:
            self._sends.stop()
        self._take_back()
        super()._release()

    def _take_back(self) -> None:
        """A workdir its pool user still owns as the job ends (kept after a failure, or left by a
        settle that failed) is taken back (:func:`nymph.workdir.seal`) before the user goes back to
        the pool, whose next task is another tenant's; a deferred job's is the next life's."""
        user = taskuser.task_users(self.ctx.config).lease_of(self)
        if user is None or self.workdir is None or self.state == "deferred":
            return
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            return
        wd.seal(self.workdir, owners={uid})

    def _gates(self) -> None:
        """The worker-side gates (:mod:`nymph.gates`), in order; who the task runs as is set here."""
        cfg = self.ctx.config
        gates.check_run_config(cfg, self.bad_run_config or self.bad_timeout, self.script)
        pip = None  # cfg["pip"]: a pip environment (nymph.callenv)
        if self.script is None:
            self._code, pip = gates.check_function(cfg, self._staged, self.body)
        if self.as_user:
            gates.check_as_user(cfg, self.ctx.runner, self.as_user)
        self._callenv.gate(self.ctx, pip, self.run_config)
        if self.as_user:
            self.run_as = self.as_user
        else:  # a user of its own from the pool (nymph.taskuser), the shared task user, or nymph's
            try:
                self.run_as = taskuser.task_users(cfg).acquire(self)
            except taskuser.TaskUserError as exc:
                raise GateRefused("TaskUserPoolExhausted", str(exc)) from None
        gates.check_run_as(cfg, self.ctx.runner, self.run_as, self.as_user)
        gates.check_runner(self.ctx.runner, self.run_config)

    def _token(self) -> str | None:
        token = self.body.get("task_token")
        return token if isinstance(token, str) and token else None

    def _env(self) -> dict[str, str]:
        """The task's variables (nymph.taskenv: never nymph's whole environment): the passed ones,
        the call's env and secrets, then nymph's own for the invocation (a call cannot override them)."""
        env = self._callenv.variables(self.ctx.config)
        gpus = self._gpus if self._gpus or self.ctx.slots.gpu_total else None
        env.update(
            taskenv.invocation_env(
                self.ctx.config, self.invocation_id, self.attempt, self.run_config,
                token=bool(self._token()), code_dirs=self._code_dirs, gpus=gpus,
            )
        )  # fmt: skip
        # the control plane's CA (and client certificate) as nymph has them, copied into the
        # workdir for the task's user alone (nymph.tasktls); nymph's own paths never reach the task
        env.update(tasktls.task_env(self._tls))
        return env

    # --- a recovered invocation ------------------------------------------------------------------

    @classmethod
    def attach(cls, ctx: JobContext, workdir: Path, meta: dict[str, Any], handle: Handle | None) -> Job:
        """A Job for a task a previous life started (``handle`` None: it never started)."""
        body: dict[str, Any] = {
            "run_config": {"two_way": True} if meta.get("two_way") else {},
            "script": meta.get("script"),
            "as_user": meta.get("as_user"),
            "timeout_s": meta.get("timeout_s"),
        }
        job = cls(ctx, str(meta["invocation_id"]), int(meta.get("attempt", 1)), body)
        job.workdir = workdir
        job.handle = handle
        job.started_at = float(meta.get("started_at") or time.time())
        job._claimed_by = meta.get("worker_id")
        if not job.as_user:  # its pool user runs it still (or ran it): not leased to another task
            taskuser.task_users(ctx.config).hold(job, meta.get("run_as"))
            job.run_as = meta.get("run_as")
        code = meta.get("code_sha256")
        if handle is not None and isinstance(code, str) and job._code_cache().hold(code):
            job._code_held = code  # the task still runs from it: pruning leaves it until the job ends
        if handle is not None:
            job._callenv.hold(ctx.config, meta.get("env_sha256"))
        gpus = [str(g) for g in meta.get("gpus") or []]
        # its devices stay its own while it may still run: with a handle, or none saved but its
        # entry holding the lock (nymph died between the start and the handle's write)
        if gpus and (handle is not None or wd.entry_runs(workdir)) and ctx.slots.claim_gpus(gpus):
            job._gpus = gpus
        return job

    def resume(self, alive: bool | None) -> None:
        """Thread body for a recovered invocation: supervise it if alive, else report what it left.

        ``alive`` None: the runner could not say (engine down); ask again with backoff until it can.
        """
        self.guarded(lambda: self._resume(alive))

    def _resume(self, alive: bool | None) -> None:
        handle = self.handle
        if handle is None:
            if self.workdir is not None and wd.nothing_runs(self.workdir):
                self._release_unstarted(self.workdir)
                return
            if self.workdir is not None and self._outlive_unsupervised(self.workdir):
                # the task started (its entry took the lock) but the previous life died before
                # saving its handle: it ran, or still runs, to its end; report what it left
                self.phase = Phase.RUNNING
                self.conclude(lambda: self._close_stream(self._collect(None)))
                return
            if self.workdir is not None:  # stopped or timed out while it ran unsupervised: it goes
                self._withdraw(self._recorded_task(self.workdir))
            self._settle_once(self.failure("DaemonRestart", "nymph restarted before the task was started"))
            return
        if alive is None:
            alive = self._recover_when_available(handle)
            if alive is None:
                self._deferred_stop()
                return
        self.phase = Phase.RUNNING
        if alive:
            log.info("invocation %s: re-attached after restart", self.invocation_id)
            self.conclude(lambda: self.supervise(handle))
        else:
            self.conclude(lambda: self._close_stream(self._collect(None)))

    def _outlive_unsupervised(self, workdir: Path) -> bool:
        """Wait for a task that runs with no handle saved (nymph died in the moment between its
        start and the handle's write) to end: True once its entry released the lock and left an
        outcome, False when a stop came first or it outlived its timeout (then it is reported as a
        restart). The lease holds meanwhile (the job is in the heartbeat's list)."""
        timeout_s = self.body.get("timeout_s")
        deadline = None if not timeout_s else self.started_at + float(timeout_s) + 5.0
        logged = False
        while wd.entry_runs(workdir):
            if not logged:
                log.warning(
                    "invocation %s: its task runs but no handle was saved before the restart; "
                    "waiting for it to end to report its outcome",
                    self.invocation_id,
                )
                logged = True
            if self.stop_request is not None or (deadline is not None and time.time() > deadline):
                return False
            self._stop_event.wait(0.2)
        return any(os.path.lexists(workdir / name) for name in (wd.RESULT, wd.ERROR, wd.FRAMES))

    def _release_unstarted(self, workdir: Path) -> None:
        """A previous life died between the claim and the start (or its task died with it before
        any outcome) and nothing runs in the workdir: ack nothing (a failure would lose a call that
        never ran) and let the control plane run it again once its lease lapses (the lease rule:
        the next attempt, here or on another nymph; at least once, as after any crash). The workdir
        goes first, so a launch still in flight when nymph died finds nothing to run.

        A start whose answer was lost may have started the task after all, away from this host (a
        Slurm job that has not begun yet): a runner that can withdraw (``Capabilities.withdraw``)
        is asked to, with the task as the workdir records it, before the workdir goes; one that
        cannot be asked now withdraws it once it can, from that record alone.

        When no entry ever ran there and this nymph's worker id (kept in its state dir across
        restarts) is the one that claimed the attempt, it is handed back at once instead:
        ``preempted`` with ``error.started`` false (:meth:`stopped`), which requeues the call
        without spending one of its attempts or preemptions, nor waiting for the lease."""
        never_ran = wd.entry_never_ran(workdir)
        self._withdraw(self._recorded_task(workdir))
        wd.remove(workdir)
        if never_ran and self._claimed_by == self.ctx.worker_id:
            self.workdir = None
            log.warning(
                "invocation %s: nymph restarted between the claim and the start of attempt %d "
                "(nothing runs); handed back before it started",
                self.invocation_id,
                self.attempt,
            )
            self._settle_once(self.stopped(Stop("preempted", RESTART_MESSAGE, 0.0, "nymph restarted")))
            return
        self.state = "released"
        log.warning(
            "invocation %s: nymph restarted between the claim and the start of attempt %d (nothing "
            "runs, no outcome); nothing is acked: the control plane runs it again once its lease lapses",
            self.invocation_id,
            self.attempt,
        )

    def _recorded_task(self, workdir: Path) -> Task:
        """The Task a previous life started (or tried to), as its invocation.json records it
        (:meth:`attach`): its identity, workdir, and who it ran as; no environment."""
        return Task(
            invocation_id=self.invocation_id,
            attempt=self.attempt,
            workdir=workdir,
            env={},
            script=self.script,
            as_user=self.run_as,
            run_config=self.run_config,
        )

    def _recover_when_available(self, handle: Handle) -> bool | None:
        """``runner.recover``, asked again while the runner is unavailable; None if stopped meanwhile."""
        return self.when_available("re-attaching", lambda: bool(self.ctx.runner.recover(handle)))

    def _deferred_stop(self) -> None:
        """Stopped before the runner came back: on shutdown leave everything to the next life."""
        stop = self.stop_request
        if stop is not None and stop.reason in ("killed", "preempted") and stop.message == SHUTDOWN_MESSAGE:
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
        self._settle_once(self.stopped(stop or Stop("killed", "cancelled", 0.0)))

    # --- supervision -----------------------------------------------------------------------------

    def supervise(self, handle: Handle) -> wd.Outcome:
        self.begin(handle)
        return self.end(handle)

    def begin(self, handle: Handle) -> None:
        """The stream opens as the task starts (parked or not, frames flow meanwhile); a two-way
        call's sends start to flow into the workdir (nymph.sends)."""
        assert self.workdir is not None
        self._new_pump(self.workdir)
        if self.run_config.get("two_way") and self.ctx.client is not None and self._sends is None:
            self._sends = SendRelay(
                self.ctx.client, self.workdir, self.invocation_id, self.attempt, self.ctx.worker_id
            ).start()

    def end(self, handle: Handle) -> wd.Outcome:
        pump = self._pump
        assert pump is not None
        try:
            ending = self.wait_or_stop(handle)
            pump.stop()
            outcome = self.stopped(ending) if isinstance(ending, Stop) else self._collect(ending)
            if self._overflow is not None:
                outcome = wd.Outcome.failed("StreamOverflow", self._overflow)
            return self._close_stream(outcome)
        finally:  # whatever failed (a pump or outbox write, the wait): the pump stops with the job
            pump.halt()

    def abandon(self) -> None:
        if self._pump is not None:
            self._pump.halt()

    def _new_pump(self, workdir: Path) -> Pump:
        """The invocation's stream, opened on the outbox (its frames go before the ack)."""
        pump = Pump(
            workdir,
            self.invocation_id,
            self.attempt,
            self.ctx.outbox,
            worker_id=self.ctx.worker_id,
            script=self.script is not None,
            limits=self.ctx.config.stream_limits,
            on_overflow=self._overflowed,
            ship=self._ship_frame if self.ctx.inline_threshold is not None else None,
            inline_threshold=self.ctx.inline_threshold,
            fresh=self._made_workdir,
        )
        self._pump = pump
        pump.start()
        return pump

    def _ship_frame(self, seq: int, body: bytes) -> dict[str, Any]:
        """Upload a frame body over the threshold; the pump sends ``{"ref": <this>}`` instead."""
        return refs.ship(
            self.ctx.client, refs.namespace_of(self.body), self.invocation_id, body, f"frame-{seq}"
        )

    def _by_reference(self, outcome: wd.Outcome) -> tuple[wd.Outcome, dict[str, Any] | None]:
        """A result over the control plane's inline threshold, uploaded -> (outcome, its ref);
        one that cannot be uploaded fails the invocation. One left on disk by ``read_outcome``
        streams from the workdir: it never enters nymph's memory."""
        limit = self.ctx.inline_threshold
        on_disk = outcome.extra.get("result_file") if self.workdir is not None else None
        if limit is None or outcome.state != "succeeded":
            return outcome, None
        if not on_disk and not by_reference(len(outcome.result_blob), limit):
            return outcome, None
        size = outcome.extra.get("result_size", len(outcome.result_blob))
        namespace = refs.namespace_of(self.body)
        try:
            if on_disk:
                assert self.workdir is not None
                fh = safeio.open_output(self.workdir, str(on_disk))
                if fh is None:
                    raise LakeshoreError(f"{on_disk} could not be opened safely")
                with fh:
                    ref = refs.ship(self.ctx.client, namespace, self.invocation_id, fh, "result")
            else:
                ref = refs.ship(self.ctx.client, namespace, self.invocation_id, outcome.result_blob, "result")
        except (LakeshoreError, OSError) as exc:
            log.warning("invocation %s: result upload failed: %s", self.invocation_id, exc)
            return wd.Outcome.failed(
                "ResultUploadFailed",
                f"the result ({size} bytes, over the inline threshold of {limit}) "
                f"could not be uploaded to the payload store: {exc}",
            ), None
        return wd.Outcome("succeeded", b"", None, {}), ref

    def _overflowed(self, message: str) -> None:
        """The stream passed ``stream_max_bytes``: stop the task; the invocation fails."""
        self._overflow = message
        self._request(Stop("killed", message, self.ctx.config.stop_grace_s))

    def _collect(self, status: ExitStatus | None) -> wd.Outcome:
        assert self.workdir is not None
        if status is None and self.handle is not None:
            status = self.ctx.runner.wait(self.handle, 0)
        outcome = wd.read_outcome(
            self.workdir, status, script=self.script is not None, big=self.ctx.inline_threshold
        )
        recorded = wd.read_stopping(self.workdir) if outcome.state != "succeeded" else None
        if recorded is not None and recorded[0] in _ERROR_TYPES:
            # a previous life stopped the task (stop.json) and died before it settled: the outcome
            # is that stop (a preemption carries its checkpoint), not the Interrupted it left
            return self.stopped(Stop(recorded[0], recorded[1], 0.0, recorded[2]))
        if outcome.extra.get("disk_full"):  # the task met a full disk: no claims until there is room
            self.ctx.on_disk_full(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.workdir)))
        return outcome

    def _close_stream(self, outcome: wd.Outcome) -> wd.Outcome:
        """End the stream as the outcome says (END for a script's success, ERROR for a failure),
        then wait until the control plane confirmed every frame (the lease holds: the job is still
        running). When that takes longer than ``SPILL_AFTER_S`` (the control plane is away) and
        the outbox has room, or at shutdown, the frames left are put in the outbox, ahead of the
        ack, and the slot is freed; the heartbeat holds the lease until the ack is confirmed."""
        pump = self._pump
        if pump is None and self.workdir is not None:  # a recovered task that had ended: send what is left
            pump = self._new_pump(self.workdir)
            pump.stop()
        if pump is None or outcome.state == "lost":
            return outcome
        if self.script is not None and outcome.state == "succeeded":
            pump.finish(wire.FRAME_END, outcome.result_blob)
        elif outcome.state != "succeeded" and (pump.has_frames or self.script is not None) and outcome.error:
            pump.finish(wire.FRAME_ERROR, {k: str(v) for k, v in outcome.error.items()})
        else:
            pump.stop()
        delivered = pump.drain(self._drain_stopped, patience_s=SPILL_AFTER_S, room=self.ctx.outbox.has_room)
        if delivered or self.lost or pump.refused is not None:
            pump.halt()
            if self.lost:
                return self.stopped(Stop("lost", "lease lost to another attempt", 0.0))
            return outcome  # (refused: superseded or unknown; its ack is refused as well)
        spilled = pump.spill()
        for frames in spilled:  # durable in the outbox, in order, ahead of the ack
            body = {
                "invocation_id": self.invocation_id,
                "attempt": self.attempt,
                "worker_id": self.ctx.worker_id,
                "frames": frames,
            }
            self.ctx.outbox.put(CHUNKS, body)
        if spilled:
            log.info(
                "invocation %s: %d frame(s) not delivered yet wait in the outbox, ahead of the ack",
                self.invocation_id,
                sum(len(f) for f in spilled),
            )
        return outcome

    def _carry_checkpoint(self, outcome: wd.Outcome) -> None:
        """An attempt that may be followed by another one leaves its ``dls.checkpoint_dir()`` to
        it (nymph.checkpoints), recorded before the ack, while the lease is still this attempt's."""
        if self.workdir is None or outcome.state not in ("failed", "timeout", "preempted"):
            return
        checkpoints.save(
            self.ctx.client,
            self.workdir,
            invocation_id=self.invocation_id,
            attempt=self.attempt,
            worker_id=self.ctx.worker_id,
            namespace=refs.namespace_of(self.body),
            max_bytes=int(self.ctx.config.checkpoint_max_mb * 2**20),
        )

    def _keep_args(self, workdir: Path) -> None:
        """A kept workdir holds ``args.msgpack`` even when the arguments went in the Task: the
        failure can be looked at, and run again by hand, as from any other workdir."""
        blob, self._args_inline = self._args_inline, None
        if blob is None or os.path.lexists(workdir / wd.ARGS):
            return
        try:
            safeio.write_file(workdir, wd.ARGS, blob)
        except OSError as exc:
            log.warning("invocation %s: cannot keep %s: %s", self.invocation_id, wd.ARGS, exc)

    def _drain_stopped(self) -> bool:
        """Stop waiting for delivery: the lease was lost, or nymph shuts down (a cancel after the
        task ended changes nothing: its outcome is known)."""
        stop = self.stop_request
        return self.lost or (stop is not None and stop.message == SHUTDOWN_MESSAGE)

    def before_stop(self, stop: Stop) -> None:
        """Tell the entry why (``stop.reason`` in the workdir: its Interrupted carries it)."""
        if self.workdir is None:
            return
        try:
            reason = _INTERRUPT_REASONS.get(stop.reason, "shutdown")
            safeio.write_file(self.workdir, STOP_REASON_FILE, reason.encode(), 0o644)
        except OSError as exc:  # the task is stopped all the same; Interrupted says "shutdown"
            log.warning("invocation %s: cannot write %s: %s", self.invocation_id, STOP_REASON_FILE, exc)
        wd.mark_stopping(self.workdir, stop.reason, stop.message, stop.detail)  # for a restart

    # --- outcomes --------------------------------------------------------------------------------

    def failure(self, type_: str, message: str) -> wd.Outcome:
        return wd.Outcome.failed(type_, message)

    def when_available(self, doing: str, op: Callable[[], T], *, timed: bool = False) -> T | None:
        if doing == "starting":  # the lifecycle's runner.start: from here on it may have started
            self._start_tried = True
        return super().when_available(doing, op, timed=timed)

    def _never_started(self) -> bool:
        """No start of the task was tried (nor one of a previous life is known): nothing ran."""
        return self.handle is None and not self._start_tried and self.phase in (Phase.CLAIMED, Phase.PREPARED)

    def stopped(self, stop: Stop) -> wd.Outcome:
        if stop.reason == "lost":
            return wd.Outcome("lost", b"", None)
        error: dict[str, Any] = {"type": _ERROR_TYPES[stop.reason], "message": stop.message}
        if stop.detail:
            error["reason"] = stop.detail
        if stop.reason == "preempted" and self._never_started():  # handed back before it started:
            error["started"] = False  # it spends no attempt nor preemption (docs/protocol.md)
        return wd.Outcome(stop.reason, b"", error)

    def settle(self, outcome: wd.Outcome) -> None:
        """Ack through the outbox (unless lost), then keep or delete the workdir."""
        refs.discard(self._staged)  # arguments fetched for a job that never started
        self._staged = None
        ref = None
        if not self.lost:
            outcome, ref = self._by_reference(outcome)
        self.state = "lost" if self.lost else outcome.state
        duration = time.time() - self.started_at
        if self.state == "lost":
            log.warning("invocation %s: lost to another attempt; killed, not acked", self.invocation_id)
        else:
            ack: dict[str, Any] = {
                "invocation_id": self.invocation_id,
                "state": outcome.state,
                "result_blob": outcome.result_blob,
                "error": outcome.error,
                "worker_id": self.ctx.worker_id,
                "attempt": self.attempt,
            }
            if ref is not None:
                ack["result_ref"] = ref
            self._carry_checkpoint(outcome)
            self.ctx.outbox.ack(ack)
        if self.workdir is not None:
            if outcome.state == "succeeded" or self.state == "lost":
                wd.remove(self.workdir)
            else:
                self._keep_args(self.workdir)
                wd.mark_settled(self.workdir, outcome)  # a pool user's is taken back next (_release)
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
