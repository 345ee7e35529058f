"""The runner contract: how nymph starts, watches, stops and re-attaches to one invocation.

A runner turns a prepared workdir into a running ``python3 -m dreamlake.lakeshore.daemon.entry``
(or ``bash -c SCRIPT``) somewhere: a local process group, a container, a Slurm job, a pod. nymph
owns everything else (polling, the workdir, the journal pump, acks, the outbox), so a runner is
small. The lifecycle mirrors Nomad's task drivers::

    handle = runner.start(task)          # spawn; returns a Handle nymph persists in the workdir
    status = runner.wait(handle, t)     # ExitStatus once finished, None if still running after t
    runner.stop(handle, grace_s)        # the cancellation ladder: interrupt, grace, kill
    runner.destroy(handle)              # free everything (container, job, pod); idempotent
    runner.inspect(handle)              # "running" | "exited" | "gone"
    runner.recover(handle)              # after a nymph restart: True if re-attached to a live task
    runner.close()                      # at nymph's shutdown: release what the runner holds

``start`` is idempotent under retry: a start tried again for the same invocation and attempt
(after ``RunnerUnavailable``, when the first answer may have been lost) finds what the first one
started and adopts it instead of starting a second task. When the job is stopped before any start
was answered, a runner that says ``Capabilities.withdraw`` is asked to withdraw what such a start
may have left running (:class:`Withdrawing`).

Handles are small, versioned JSON documents (``handle.json`` in the workdir), so a restarted nymph
can re-attach to what a previous life started; only a file nymph itself wrote is loaded (a task
cannot forge one, see :mod:`nymph.safeio`). Optional features are declared in
:class:`Capabilities` and read only from there: nymph refuses a task that needs one the runner
lacks, before starting it, and calls an optional method (:class:`Labelling`, :class:`Reaping`,
:class:`Withdrawing`) only
when the capability says the runner has it (:class:`Watching`: a task nymph waits for with no thread).

Runners are plugins: the entry-point group ``nymph.runners`` maps a name to a class implementing
:class:`Runner`. See :mod:`nymph.plugins` for loading and validation.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from nymph import safeio
from nymph.errors import NymphError

HANDLE_FILE = "handle.json"
HANDLE_VERSION = 1


class RunnerError(NymphError):
    """A runner could not do what was asked; the message says what to fix."""


class RunnerUnavailable(RunnerError):
    """The runner cannot work on this host (engine down, binary missing)."""


@dataclass(frozen=True)
class Capabilities:
    as_user: bool = False  # can run the task as another local user
    gpus: bool = False  # can expose assigned GPUs to the task
    resources: bool = False  # honours run_config.resources limits (cpus, memory, pids, shm)
    image: bool = False  # honours run_config.image
    network: bool = False  # honours run_config.network
    recover: bool = True  # can re-attach after a nymph restart (else leftovers are destroyed, reported)
    list_labelled: bool = False  # lists the tasks it labelled (Labelling): reconcile adopts or sweeps them
    reap_orphans: bool = False  # reaps descendants reparented to nymph (Reaping): the agent calls it
    exit_fd: bool = False  # gives an fd readable once the task ended (Watching): no thread waits on it
    # takes a Python task's arguments in Task.args (no args.msgpack written by nymph): the runner
    # hands them to the entry, or writes args.msgpack itself before it runs the entry from the file
    args_inline: bool = False
    # says what one task may be given here (Offering: memory, CPUs): the claim matches calls'
    # resources against it (docs/protocol.md "Placement"); False: not matched on them
    task_offer: bool = False
    # withdraws what a start whose answer was lost may have started (Withdrawing): nymph calls it
    # when the job is stopped (cancel, timeout, shutdown) while its start was being tried again
    withdraw: bool = False


@dataclass
class Task:
    """Everything a runner needs to start one invocation. The workdir already holds args.msgpack,
    unless ``args`` is set (a runner whose capabilities say ``args_inline``)."""

    invocation_id: str
    attempt: int
    workdir: Path  # {workdir}/{invocation_id}, private to this invocation
    # LAKESHORE_* variables, CUDA_VISIBLE_DEVICES, the call's env and secrets, --pass-env: never the
    # host's PATH / HOME / LANG (nymph.taskenv.host_base: a runner whose task runs on the host adds them)
    env: dict[str, str]
    script: str | None = None  # run `bash -c script` instead of the Python entry
    # the local user the task runs as: as_user (checked against the allow-list) or, when nymph runs
    # as root, its task user (nymph.taskuser); the workdir is theirs. None: nymph's own user
    as_user: str | None = None
    run_config: dict[str, Any] = field(default_factory=dict)
    gpus: list[str] = field(default_factory=list)  # device indices/UUIDs assigned by nymph
    labels: dict[str, str] = field(default_factory=dict)  # nymph.invocation, nymph.worker, ...
    # host directories of the code archives the call shipped (nymph.codecache), read-only, to go
    # first on the task's import path: env LAKESHORE_CODE_PATH names them; a runner whose task sees
    # another filesystem (a container, a pod) mounts each read-only at the same path
    code_dirs: list[Path] = field(default_factory=list)
    # the operator's mounts the call asked for (--mount NAME=PATH[:ro]): name -> (host path or
    # "pvc:CLAIM", read_only). env LAKESHORE_MOUNT_<NAME> names the host path; a runner whose task
    # sees another filesystem mounts each (at MOUNT_TARGET/<name>) and rewrites the variable
    mounts: dict[str, tuple[str, bool]] = field(default_factory=dict)
    # the Envelope's bytes, not written to the workdir (Capabilities.args_inline, small inline
    # arguments only); None: they are in args.msgpack
    args: bytes | None = None
    # the namespace the invocation belongs to (its tenant): a runner that keeps processes between
    # tasks (the process runner's zygotes) never lets one namespace's task start from another's
    namespace: str | None = None


@dataclass
class Handle:
    """The persisted identity of a started task. ``data`` is runner-specific (pid, container id...)."""

    runner: str
    invocation_id: str
    attempt: int
    data: dict[str, Any]
    version: int = HANDLE_VERSION

    def save(self, workdir: Path) -> None:
        """Write ``handle.json`` (atomically, never through a link the task planted: :mod:`nymph.safeio`)."""
        # every field, shallow: ``data`` is JSON values already (asdict would deep-copy it)
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        safeio.write_file(workdir, HANDLE_FILE, json.dumps(doc).encode())

    @classmethod
    def load(cls, workdir: Path) -> Handle | None:
        """The saved handle; None when there is none, or the file is not one nymph wrote."""
        data = safeio.read_own(workdir, HANDLE_FILE)
        try:
            raw = json.loads(data) if data is not None else None
        except ValueError:
            return None
        if not isinstance(raw, dict) or raw.get("version") != HANDLE_VERSION:
            return None
        try:
            return cls(**raw)
        except TypeError:
            return None


@dataclass
class ExitStatus:
    exit_code: int  # the entry's exit code; negative for a signal
    reason: str | None = None  # e.g. "OOMKilled", "signal 9", "NodeFail": shown in the failure
    logs: str | None = None  # captured stdout/stderr tail, kept with a failed invocation
    # the kernel killed the task at its memory limit (nymph.limits): {"limit": bytes, "peak": bytes}
    oom: dict[str, int | None] | None = None


@runtime_checkable
class Runner(Protocol):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def check(self) -> None:
        """Raise RunnerUnavailable with what to fix when the runner cannot work on this host."""
        ...

    def start(self, task: Task) -> Handle: ...
    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None: ...
    def stop(self, handle: Handle, grace_s: float) -> None: ...
    def destroy(self, handle: Handle) -> None: ...
    def inspect(self, handle: Handle) -> str: ...
    def recover(self, handle: Handle) -> bool: ...

    def close(self) -> None:
        """Release what the runner holds (clients, helper processes) at nymph's shutdown.

        Tasks it started keep running (a restarted nymph re-attaches); a no-op where nothing is held.
        """
        ...


@runtime_checkable
class Labelling(Protocol):
    """The method of a runner whose :class:`Capabilities` say ``list_labelled=True``."""

    def list_labelled(self, worker_id: str | None = None) -> list[Handle]:
        """Handles of every task this runner kind labelled (of ``worker_id`` when given).

        Raise RunnerUnavailable when the runner cannot be asked now.
        """
        ...


@runtime_checkable
class Reaping(Protocol):
    """The method of a runner whose :class:`Capabilities` say ``reap_orphans=True``."""

    def reap_orphans(self) -> int:
        """Reap exited descendants reparented to nymph that are no task's leader; the count."""
        ...


@runtime_checkable
class Offering(Protocol):
    """The method of a runner whose :class:`Capabilities` say ``task_offer=True``."""

    def task_offer(self) -> dict[str, Any]:
        """What one task may be given here, as the poll's offer says it: ``memory`` (bytes: the
        most one task's limit may be; 0 where no limit can be held, so calls asking for memory
        are not claimed here) and ``cpus`` (likewise); a key left out is not matched on."""
        ...


@runtime_checkable
class Withdrawing(Protocol):
    """The method of a runner whose :class:`Capabilities` say ``withdraw=True``."""

    def withdraw(self, task: Task) -> None:
        """Stop and free whatever a start of ``task`` that raised RunnerUnavailable started after
        all (the answer was lost); a no-op when nothing was started. nymph calls it when the job is
        stopped before any start of it was answered (after the job settled: it may wait on a
        runner that just did not answer), and when a restarted nymph releases an attempt that saved
        no handle (before its workdir is removed; ``task`` then has no environment), so nothing
        runs that nobody supervises.

        Raise RunnerUnavailable when the runner cannot be asked now; it should then remember the
        withdrawal and do it once it can (nymph does not call it again), without the workdir.
        """
        ...


@runtime_checkable
class Watching(Protocol):
    """The method of a runner whose :class:`Capabilities` say ``exit_fd=True``."""

    def exit_fd(self, handle: Handle) -> int | None:
        """An fd that becomes readable once the task of ``handle`` ended (its leader exited); None
        when the runner has none for it (nymph then waits with :meth:`Runner.wait` in a thread).

        The runner owns the fd: it stays open until :meth:`Runner.destroy` of the handle, and nymph
        only polls it (``epoll``), then calls ``wait``, which must then answer without blocking long.
        """
        ...
