"""nymph's ``slurm`` runner: each invocation is one Slurm batch job.

Registered through the ``nymph.runners`` entry point exactly like a third-party runner. ``start``
writes ``slurm-job.sh`` into the workdir (through :mod:`nymph.safeio`: the workdir is the task
user's; it exports the task's environment and ``exec``\\ s ``python -m
dreamlake.lakeshore.daemon.entry`` or ``bash -c SCRIPT`` under :mod:`nymph_slurm.reaper`, so a
``setsid()`` daemon the task starts stays in the job and dies with it even under
``proctrack/linuxproc``; see :mod:`nymph_slurm.jobs`) and submits it::

    [runuser -u USER --] sbatch --parsable --chdir WORKDIR --output WORKDIR/stdout.log
        --error WORKDIR/stderr.log --open-mode=append --job-name nymph-<invocation_id>-a<attempt>
        --comment nymph:<invocation_id>:a<attempt> --no-requeue --nodes=1 --ntasks=1
        [--partition/--account/--qos/--time] [--cpus-per-task/--mem/--gres=gpu:N] [extra_args]
        WORKDIR/slurm-job.sh

``run_config.resources`` is read by :mod:`nymph.resources`; ``pids`` and ``shm`` are refused
(Slurm has no such per-job limit). The handle is ``{job_id, job_name, workdir}``.

The job's name holds the attempt (:func:`nymph_slurm.jobs.job_name`): it is the job's identity.
An sbatch whose answer never came (it timed out, or the controller stopped answering:
:class:`~nymph.runner.RunnerUnavailable`) may have submitted the job after all, so a start
tried again, and any later attempt's start, first asks ``squeue --states=all --all --user=SUBMITTER`` (the controller filters by user; a
``--name`` alone is filtered by squeue after loading the cluster's whole job table) for the
invocation's jobs in its workdir (:func:`nymph_slurm.jobs.plan_start`): this attempt's is adopted
(a start tried again never submits twice); another
attempt's still active there (or one named the older nymphs' way, ``nymph-<invocation_id>``) is
cancelled first, never adopted. The look-up is skipped only where nothing can be found: a first
attempt's start when no sbatch for it was sent in this nymph's life (kept in memory, never in the
workdir, which the task user can write: a task that deleted a mark there would have a lost answer
submitted twice). A restarted nymph never starts the same attempt again (it releases it, withdrawing
what its start may have left; the control plane runs the next attempt). A job stopped before any start
was answered (a cancel during the retries, or a restarted nymph releasing an attempt that has no
handle) is withdrawn (:meth:`SlurmRunner.withdraw`): looked up the same way and cancelled, or,
while the controller does not answer, once it does again (``check``, the next ``start``); the
deferred cancel needs nothing of the workdir, which may be gone by then.

``wait`` polls ``scontrol show job -o`` (never ``sbatch --wait``, which polls at 2 s, 10 s, 42 s,
...) and maps ``JobState`` / ``ExitCode`` to an :class:`~nymph.runner.ExitStatus`. A job that has
aged out of ``scontrol`` (``MinJobAge``, 300 s by default, and there is no ``sacct`` without
slurmdbd) is ``gone``: its exit code is inferred from the workdir (``result.msgpack`` -> 0,
``error.json`` -> 1, neither -> unknown), as the process runner does for a re-attached process. A
job id that now names another job (ids restart with a fresh ``StateSaveLocation``) is gone too: the
job name must match (a handle saved by an older nymph keeps its old name and is read the same way).

The ladder: ``scancel --signal=TERM --full`` (the batch step and every process it started),
``grace_s``, then ``scancel --full`` (a cancel: Slurm sends SIGTERM and, ``KillWait`` seconds later,
SIGKILL; a plain ``--signal=KILL`` is treated the same way by Slurm), then wait up to
``cancel_wait_s`` for the job to end.

``Task.as_user`` (the invocation's ``as_user``, or nymph's task user when nymph runs as root, see
:mod:`nymph.taskuser`) submits as that user with ``runuser -u USER -- sbatch``, so the job runs as
that user (who must exist on the compute nodes); the job inherits the submitter's environment, so
the interpreter (``python``) must be readable and runnable by that user on the compute node (a
script job whose user cannot run it runs without the reaper). A ``--chdir`` that does not exist silently runs the job in ``/tmp``, so
``start`` refuses a missing workdir and the script itself refuses to run elsewhere.

Errors: a missing binary, an unreachable controller or a timed-out Slurm command is
:class:`~nymph.runner.RunnerUnavailable` (transient); a refused submission (bad partition, bad
resources) is :class:`~nymph.runner.RunnerError` with Slurm's message. ``close`` has nothing to
release (every call is a short-lived Slurm command).
"""

from __future__ import annotations

import logging
import os
import pwd
import random
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from nymph import safeio
from nymph.envcache import Interpreter, host_interpreter
from nymph.runner import Capabilities, ExitStatus, Handle, RunnerError, RunnerUnavailable, Task
from nymph.runnerkit import (
    ENTRY_MODULE,
    default_python,
    handle_workdir,
    inferred_exit_code,
    log_tail,
)
from nymph.taskenv import host_base
from nymph_slurm.jobs import (
    GPU_ENV,
    QUEUE_FORMAT,
    JobRecord,
    QueuedJob,
    StartPlan,
    batch_script,
    exit_status,
    job_name,
    lookup_names,
    parse_queue,
    parse_record,
    plan_start,
    resource_args,
)

log = logging.getLogger(__name__)

__all__ = ["SCRIPT_FILE", "SlurmRunner"]

SCRIPT_FILE = "slurm-job.sh"
_CMD_TIMEOUT_S = 30.0
_PING_TIMEOUT_S = 10.0  # check(): a client without a configuration source hangs in DNS lookups
_FIRST_POLL_S = 0.05  # polls start fast (a trivial job ends in about 1 s) and back off
# sbatch / scontrol / scancel messages that mean "the controller cannot be reached": transient
_UNREACHABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "connection refused",
    "zero bytes were transmitted",
    "could not establish a configuration source",
    "slurm_load_jobs error: unable to",
)


class SlurmRunner:
    """Runs each invocation as one Slurm batch job (see the module docstring)."""

    name: ClassVar[str] = "slurm"
    capabilities: ClassVar[Capabilities] = Capabilities(
        as_user=True, gpus=True, resources=True, recover=True, withdraw=True
    )

    def __init__(
        self,
        *,
        partition: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        time_limit: str | int | None = None,
        extra_args: Iterable[str] | str = (),
        python: str | None = None,
        bash: str = "bash",
        sbatch: str = "sbatch",
        scontrol: str = "scontrol",
        scancel: str = "scancel",
        squeue: str = "squeue",
        runuser: str = "runuser",
        poll_interval_s: float = 0.2,
        cancel_wait_s: float = 35.0,
    ) -> None:
        if poll_interval_s <= 0:
            raise RunnerError(f"slurm runner: poll_interval_s must be positive, got {poll_interval_s!r}")
        self.partition = partition
        self.account = account
        self.qos = qos
        self.time_limit = None if time_limit in (None, "") else str(time_limit)
        self.extra_args = (
            shlex.split(extra_args) if isinstance(extra_args, str) else [str(a) for a in extra_args]
        )
        self.python = python or default_python()
        self.bash = bash
        self.sbatch = sbatch
        self.scontrol = scontrol
        self.scancel = scancel
        self.squeue = squeue
        self.runuser = runuser
        self.poll_interval_s = float(poll_interval_s)
        self.cancel_wait_s = float(cancel_wait_s)
        self._destroyed: set[str] = set()  # job ids destroyed here: finished, nothing to re-attach to
        # starts withdrawn while the controller did not answer, by (invocation, attempt): done later
        self._withdrawing: dict[tuple[str, int], Task] = {}
        # (invocation, attempt) whose sbatch was sent with no job id answered yet: its start tried
        # again looks the job up first
        self._sent: set[tuple[str, int]] = set()
        self._lock = threading.Lock()  # jobs of many invocations call in from their own threads

    # --- lifecycle ------------------------------------------------------------------------------

    def check(self) -> None:
        for what in ("sbatch", "scontrol", "scancel", "squeue"):
            path = getattr(self, what)
            if shutil.which(path) is None:
                raise RunnerUnavailable(
                    f"slurm runner: {path!r} not found; install the Slurm client tools "
                    f"(apt-get install slurm-client) or set {what}="
                )
        ping = self._run([self.scontrol, "ping"], check=False, timeout=_PING_TIMEOUT_S)
        if ping.returncode != 0 or "UP" not in ping.stdout:
            said = (ping.stdout + ping.stderr).strip()[-300:]
            raise RunnerUnavailable(
                f"slurm runner: the Slurm controller does not answer `scontrol ping` ({said}); start "
                "slurmctld (on a dev box: scripts/services/slurm.sh) or point SLURM_CONF at the "
                "cluster's slurm.conf"
            )
        self._withdraw_pending()

    def start(self, task: Task) -> Handle:
        workdir = Path(task.workdir)
        if not workdir.is_dir():  # sbatch would silently run the job in /tmp
            raise RunnerError(f"slurm runner: workdir {workdir} does not exist; nothing submitted")
        name = job_name(task.invocation_id, task.attempt)
        res_args = resource_args((task.run_config or {}).get("resources"), len(task.gpus))
        self._withdraw_pending()
        key = (task.invocation_id, task.attempt)
        with self._lock:
            sent = key in self._sent
        if sent or task.attempt > 1:  # never submitted twice: this attempt's job may exist already
            plan = self._plan(task)
            self._cancel(task, plan.cancel, "another attempt's, in this workdir")
            if plan.adopt is not None:
                log.warning(
                    "invocation %s: Slurm job %s of this attempt was submitted (an earlier sbatch's "
                    "answer was lost); adopting it",
                    task.invocation_id,
                    plan.adopt,
                )
                return self._handle(task, plan.adopt, name, workdir)
        env = {**host_base(), **task.env}  # the documented base and the task's own (nymph.taskenv)
        if any(a.startswith("--gres=gpu") for a in res_args):
            env = {k: v for k, v in env.items() if k not in GPU_ENV}  # Slurm sets them for its GPUs
        command = (
            [self.bash, "-c", task.script] if task.script is not None else [self.python, "-m", ENTRY_MODULE]
        )
        script = workdir / SCRIPT_FILE
        header = f"nymph invocation {task.invocation_id} attempt {task.attempt} (slurm runner)"
        text = batch_script(str(workdir), env, command, header, python=self.python)
        try:  # the workdir is the task user's: never written through a link planted there
            safeio.write_file(workdir, SCRIPT_FILE, text.encode(), 0o755)
        except OSError as exc:
            raise RunnerError(f"slurm runner: cannot write {script}: {exc}") from exc
        argv = [
            self.sbatch,
            "--parsable",
            f"--chdir={workdir}",
            f"--output={workdir / 'stdout.log'}",
            f"--error={workdir / 'stderr.log'}",
            "--open-mode=append",
            f"--job-name={name}",
            f"--comment=nymph:{task.invocation_id}:a{task.attempt}",
            "--no-requeue",  # a requeued job would run the invocation twice in the same workdir
            "--nodes=1",
            "--ntasks=1",
        ]
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--qos", self.qos),
            ("--time", self.time_limit),
        ):
            if value:
                argv.append(f"{flag}={value}")
        argv += [*res_args, *self.extra_args, str(script)]
        if task.as_user:
            argv = [self.runuser, "-u", task.as_user, "--", *argv]
        with self._lock:
            self._sent.add(key)
        # RunnerUnavailable: it may have been submitted; the start tried again looks first
        out = self._run(argv, env=self._submit_env(task), what="sbatch")
        job_id = out.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"
        if not job_id.isdigit():
            raise RunnerError(f"slurm runner: sbatch answered {out.stdout.strip()[:200]!r}, not a job id")
        with self._lock:
            self._sent.discard(key)  # answered: no start of this attempt comes again
        log.debug("invocation %s: submitted Slurm job %s", task.invocation_id, job_id)
        return self._handle(task, job_id, name, workdir)

    def withdraw(self, task: Task) -> None:
        """Cancel what a start of ``task`` whose answer was lost submitted after all (nymph stopped
        the job before any start was answered, or a restarted nymph releases an attempt that saved
        no handle), found by the job's name in its workdir, as a start would find it. Nothing to do
        when no sbatch was sent for it (:meth:`_may_have_submitted`). While the controller does not
        answer (RunnerUnavailable) it is remembered, and done once it answers again: in
        :meth:`check`, which nymph calls until it passes, or at the next :meth:`start`; that needs
        only the task's identity, workdir path and user, not the workdir itself. It always looks:
        the sbatch may have been sent by this nymph before a restart."""
        with self._lock:
            self._sent.discard((task.invocation_id, task.attempt))
            self._withdrawing[(task.invocation_id, task.attempt)] = task
        self._withdraw_pending()

    def _withdraw_pending(self) -> None:
        with self._lock:
            pending = list(self._withdrawing.items())
        for key, task in pending:
            try:
                plan = self._plan(task)
                self._cancel(task, (*([plan.adopt] if plan.adopt else []), *plan.cancel), "withdrawn")
            except RunnerUnavailable:
                raise  # still remembered: tried again once the controller answers
            except RunnerError as exc:  # not transient: trying again would not do better
                log.warning("invocation %s: withdrawing its Slurm job failed: %s", task.invocation_id, exc)
            with self._lock:
                self._withdrawing.pop(key, None)

    def _plan(self, task: Task) -> StartPlan:
        return plan_start(
            self._queued(task),
            task.invocation_id,
            task.attempt,
            str(task.workdir),
            self._destroyed,
        )

    def _queued(self, task: Task) -> list[QueuedJob]:
        """The jobs Slurm knows (in any state) under the invocation's names (:func:`lookup_names`),
        of the user that submits them: ``--user`` is filtered by the controller (``--name`` alone
        makes squeue load the cluster's whole job table), ``--all`` includes hidden partitions."""
        names = ",".join(lookup_names(task.invocation_id, task.attempt))
        argv = [
            self.squeue,
            "--noheader",
            "--all",
            "--states=all",
            f"--user={task.as_user or _effective_user()}",
            f"--name={names}",
            f"--format={QUEUE_FORMAT}",
        ]
        return parse_queue(self._run(argv, what="squeue").stdout)

    def _cancel(self, task: Task, job_ids: Iterable[str], why: str) -> None:
        """Cancel each job (and wait for it to end, as :meth:`destroy` does); it counts as destroyed."""
        for job_id in job_ids:
            log.warning("invocation %s: cancelling Slurm job %s (%s)", task.invocation_id, job_id, why)
            # no job name to match: the id was read from squeue just now
            self.destroy(Handle(self.name, task.invocation_id, task.attempt, {"job_id": job_id}))

    def _handle(self, task: Task, job_id: str, name: str, workdir: Path) -> Handle:
        return Handle(
            runner=self.name,
            invocation_id=task.invocation_id,
            attempt=task.attempt,
            data={"job_id": job_id, "job_name": name, "workdir": str(workdir)},
        )

    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _FIRST_POLL_S
        while True:
            record = self._record(handle)
            if record is None:
                return self._inferred(handle)
            if not record.active:
                status = exit_status(record)
                status.logs = log_tail(handle_workdir(handle))
                return status
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                time.sleep(min(left, delay * random.uniform(0.8, 1.2)))
            else:
                time.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 1.5, self.poll_interval_s)

    def stop(self, handle: Handle, grace_s: float) -> None:
        record = self._record(handle)
        if record is None or not record.active:
            return
        if record.state != "PENDING":
            self._scancel(handle, "--signal=TERM", "--full")
            if self._ended(handle, max(grace_s, 0.0)):
                return
        self._scancel(handle, "--full")  # the cancel: SIGTERM, KillWait, SIGKILL to what is left
        if not self._ended(handle, self.cancel_wait_s):
            log.warning(
                "invocation %s: Slurm job %s still active %.0f s after scancel",
                handle.invocation_id,
                handle.data["job_id"],
                self.cancel_wait_s,
            )

    def destroy(self, handle: Handle) -> None:
        record = self._record(handle)
        if record is not None and record.active:
            self._scancel(handle, "--full")
            self._ended(handle, self.cancel_wait_s)
        self._destroyed.add(str(handle.data["job_id"]))

    def inspect(self, handle: Handle) -> str:
        record = self._record(handle)
        if record is None:
            return "gone"
        return "running" if record.active else "exited"

    def recover(self, handle: Handle) -> bool:
        """True while Slurm knows the job (pending, running, or finished and not yet destroyed here)."""
        if str(handle.data.get("job_id")) in self._destroyed:
            return False
        return self._record(handle) is not None

    def close(self) -> None:
        """Nothing to release: every call is a short-lived Slurm command."""

    # --- helpers --------------------------------------------------------------------------------

    def _record(self, handle: Handle) -> JobRecord | None:
        job_id = str(handle.data["job_id"])
        out = self._run([self.scontrol, "show", "job", "-o", job_id], check=False)
        if out.returncode != 0:
            said = (out.stderr + out.stdout).strip()
            if "invalid job id" in said.lower():
                return None
            raise self._failure("scontrol show job", said)
        lines = [line for line in out.stdout.splitlines() if line.strip()]
        if not lines:
            return None
        record = parse_record(lines[0])
        expected = handle.data.get("job_name")
        if expected and record.name != expected:  # the id was recycled: our job is long gone
            return None
        return record

    def _ended(self, handle: Handle, limit_s: float) -> bool:
        """Poll until the job is no longer active (True) or ``limit_s`` passes (False)."""
        deadline = time.monotonic() + limit_s
        delay = _FIRST_POLL_S
        while True:
            record = self._record(handle)
            if record is None or not record.active:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, delay * random.uniform(0.8, 1.2)))
            delay = min(delay * 1.5, self.poll_interval_s)

    def _scancel(self, handle: Handle, *flags: str) -> None:
        out = self._run([self.scancel, *flags, str(handle.data["job_id"])], check=False)
        said = (out.stderr + out.stdout).strip()
        if out.returncode != 0 and not _already_over(said):
            raise self._failure("scancel", said)

    def _inferred(self, handle: Handle) -> ExitStatus:
        workdir = handle_workdir(handle)
        code, reason = (inferred_exit_code(workdir) if workdir else -1), None
        if code == -1:
            reason = (
                f"exit status unknown: Slurm job {handle.data['job_id']} is no longer known to scontrol "
                "(finished more than MinJobAge ago)"
            )
        return ExitStatus(exit_code=code, reason=reason, logs=log_tail(workdir))

    def pip_interpreter(self, run_config: Mapping[str, Any]) -> Interpreter:
        """What a pip environment is built for: ``python`` as this host has it (nymph.envcache).
        The environment is built on nymph's host under ``{workdir}/.envs``: the compute nodes see
        it at the same path on the shared workdir, and must run the same interpreter."""
        return host_interpreter(self.python)

    @staticmethod
    def _submit_env(task: Task) -> dict[str, str]:
        """sbatch's environment: nymph's own minus NYMPH_* and a surrounding job's SLURM_* (SLURM_CONF
        stays: it names the cluster), plus the task's. The job inherits it."""
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("NYMPH_", "SLURM_")) or k == "SLURM_CONF"
        }
        env.update(task.env)
        return env

    def _run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        check: bool = True,
        what: str = "",
        timeout: float = _CMD_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        try:
            out = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError as exc:
            raise RunnerUnavailable(
                f"slurm runner: {argv[0]!r} not found ({exc}); install Slurm's client tools"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise RunnerUnavailable(
                f"slurm runner: {shlex.join(argv[:3])} did not answer in {timeout:.0f} s"
            ) from exc
        except OSError as exc:
            raise RunnerError(f"slurm runner: cannot run {argv[0]!r}: {exc}") from exc
        if check and out.returncode != 0:
            raise self._failure(what or Path(argv[0]).name, out.stderr + out.stdout)
        return out

    @staticmethod
    def _failure(what: str, said: str) -> RunnerError:
        said = said.strip()[-500:]
        if any(marker in said.lower() for marker in _UNREACHABLE):
            return RunnerUnavailable(f"slurm runner: the Slurm controller cannot be reached ({what}): {said}")
        return RunnerError(f"slurm runner: {what} failed: {said}")


def _effective_user() -> str:
    """Who sbatch submits as without ``runuser``: nymph's effective user (its uid without a name)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _already_over(said: str) -> bool:
    said = said.lower()
    return "already completing or completed" in said or "invalid job id" in said
