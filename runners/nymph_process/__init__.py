"""nymph's ``process`` runner: each invocation is a local process tree in its own cgroup and session.

Registered through the ``nymph.runners`` entry point exactly like a third-party runner. It spawns
``python -m dreamlake.lakeshore.daemon.entry`` (or ``bash -c SCRIPT``) with the workdir as cwd and
stdout/stderr appended to ``stdout.log`` / ``stderr.log`` there (opened through
:mod:`nymph.safeio`: the workdir is the task user's), in a new session. ``Task.as_user`` (the
invocation's ``as_user``, or nymph's task user when nymph runs as root: :mod:`nymph.taskuser`)
wraps the command in ``runuser -u USER --``.

Every task gets its own cgroup v2 (:mod:`nymph.cgroup`, option ``cgroup``: ``"auto"`` (default),
``"off"``, or the path of a cgroup to create task cgroups under): a spawned task joins it through
a ``/bin/sh`` prefix before its command runs, a forked one first thing after the fork. Stopping a
task signals every process in its cgroup (SIGTERM, the grace, then ``cgroup.kill``), and
``destroy`` kills what is left and removes the cgroup, so a descendant that started its own
session (``setsid``, a daemonising library) dies with the task. Where cgroups cannot be used
(``nymph doctor`` says why) the runner falls back to the process group, plus the task's strays:
nymph is a child subreaper, so descendants that left the group and were orphaned become nymph's
children, and those carrying the task's ``LAKESHORE_TASK`` marker are signalled too (best
effort: a descendant that cleared its environment, or one orphaned while nymph was down, is missed).

The handle records ``pid``, ``pgid``, the leader's ``start_time`` (psutil ``create_time``), the
task's name and its cgroup, so :meth:`ProcessRunner.recover` re-attaches only to the very process
it started, never to a recycled pid. A recovered process is not our child: :meth:`wait` then polls psutil and infers the exit code
from the workdir (``result.msgpack`` -> 0, ``error.json`` -> 1, neither -> unknown).

``prefork=True`` (warm fork): a Python task (no ``script``; with a user to become only when nymph
runs as root, the zygote's child then drops to it with ``setgroups`` / ``setgid`` / ``setuid``
before the entry runs) is forked by a long-lived
zygote (:mod:`nymph_process.zygote`) that has already paid the interpreter start-up and the entry's
imports, instead of spawning a new interpreter. The child is set up exactly as the spawned entry
(own session, cwd, environment, logs) and imports the user's code itself; the handle is the same
``{pid, pgid, start_time}``. The zygote reports each child's exit code (it is the parent); if it
dies, running children are watched like re-attached ones and the next task restarts it (or, after
repeated failures, spawns the normal way), so no invocation is lost to it. On by default
(``prefork = false`` under ``[runner_options]`` turns it off). What differs from a spawned entry:
children of one zygote share its hash seed (``PYTHONHASHSEED``) and the entry code it loaded (an
upgrade of the package on disk reaches tasks when nymph restarts), and ``__main__`` is the entry
module. One zygote serves each distinct environment (all but ``LAKESHORE_*`` and the GPU variables,
which are read after start-up), at most four.

Never twice in one workdir: a Python entry runs only under the workdir's entry lock (``flock`` on
``.entry.lock``, which records who ran it). A forked child takes it before it runs the entry; a
spawned entry inherits it from the runner, which takes it before spawning. When a zygote got a fork
request but its answer never came (a timeout, the zygote died), the runner does not ask a zygote
again: it takes the lock and spawns, or, when a child got there first (the lock is held, or the
file says an entry already ran), adopts that child like a re-attached process. The same lock makes
``start`` idempotent under retry: a second start of a Python task finds the entry the first one
started and adopts it.

Limits (:mod:`nymph.limits`): each task cgroup gets ``memory.max`` and ``pids.max`` where the
controllers exist (cgroup v2 under ``nymph-tasks``, or the v1 ``memory`` / ``pids`` hierarchies of a
hybrid host, joined with the cgroup2 one before the task runs): ``run_config.resources``'
``memory`` / ``pids``, else the runner's caps (options ``memory``, default ``"90%"`` of the host,
and ``pids``, default 4096: ``nymph start --task-memory-max`` / ``--task-pids-max``); a task
asking above a cap, or for a field no controller here holds (``cpus``, ``shm``, and ``memory`` /
``pids`` without their controller), is refused with :class:`~nymph.resources.ResourceError`. A
task the kernel killed at its memory limit exits with ``ExitStatus.oom`` set (the limit and the
peak), reported as ``OutOfMemory``. ``gpus`` is assigned through ``CUDA_VISIBLE_DEVICES``. Warm
workers (below) get no limits of their own.

Options: ``python`` (the tasks' interpreter, default nymph's own), ``pythonpath`` (the tasks'
``PYTHONPATH`` instead of nymph's own, a list; e.g. the entry bundle and the code's directory when
the task user cannot read nymph's environment), ``prefork``, ``cgroup``, ``memory``, ``pids``, and the warm mode's
``warm`` (off by default), ``warm_max_calls`` (recycle a worker after that many calls; 0: never)
and ``warm_workers`` (``nymph start`` passes its slot count).

``warm=True`` (:mod:`nymph_process.warm`, trusted code only): a Python ``ref`` call with no user
to become runs in a long-lived warm worker that imports its module once and runs call after call
in itself, with no isolation between calls; a crash, cancel or timeout kills that worker only.
Scripts, tasks with a user to become and pickled functions take the paths above.

The task's environment is the documented host base (``PATH``, ``HOME``, ``LANG``, ``TZ``, ...:
:func:`nymph.taskenv.host_base`, cached and recomputed only when nymph's own environment changed)
plus ``Task.env``; never nymph's whole environment. A pip environment (nymph.envcache) is built for
the runner's ``python`` (:meth:`ProcessRunner.pip_interpreter`) and comes in ``Task.code_dirs``.

Code a call shipped (``Task.code_dirs``, nymph's code cache) reaches the task as
``LAKESHORE_CODE_PATH``, a per-task variable like every ``LAKESHORE_*`` one: it is not part of a
zygote's key, so one zygote serves every version, and the entry (in the forked child or the spawned
process alike) puts the directories first on ``sys.path`` and ``PYTHONPATH``.

Optional features (:class:`~nymph.runner.Capabilities`): ``reap_orphans`` (nymph is a child
subreaper; the agent calls :meth:`ProcessRunner.reap_orphans`) and ``exit_fd`` (a spawned entry's
pidfd, a forked child's exit pipe written by the zygote's reader: a running task waits in nymph's
supervisor loop, with no thread of its own). ``close`` stops the zygotes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import psutil

from dreamlake.lakeshore.daemon.entry import RESULT_MAX_ENV
from nymph import limits, safeio
from nymph.cgroup import CgroupError, TaskCgroups, detect, join_list, spawn_prefix
from nymph.envcache import Interpreter, host_interpreter
from nymph.resources import ResourceError, Resources, parse_defaults, parse_resources
from nymph.runner import Capabilities, ExitStatus, Handle, RunnerError, RunnerUnavailable, Task
from nymph.runnerkit import (
    ENTRY_MODULE,
    default_python,
    handle_workdir,
    inferred_exit_code,
    log_tail,
    option_list,
    task_name,
)
from nymph.taskenv import host_base
from nymph.workdir import ARGS as ARGS_FILE
from nymph_process.prefork import ForkedChild, ZygoteClient, ZygoteError, boot_time, start_time_of
from nymph_process.warm import WarmPool, WarmWorker, passwd_record
from nymph_process.warm import call_over as warm_call_over
from nymph_process.zygote import ENTRY_LOCK

log = logging.getLogger(__name__)

#: run_config.resources fields a local process cannot be held to, with why (see nymph.resources);
#: memory and pids are held where the task cgroups have those controllers (nymph.limits)
UNSUPPORTED_RESOURCES = dict.fromkeys(("cpus", "shm"), "the process runner does not limit it")
_NO_CONTROLLER = "this host's task cgroups have no {} controller (`nymph doctor` says why)"
PIDS_MAX_DEFAULT = 4096  # nymph start --task-pids-max
MEMORY_MAX_DEFAULT = "90%"  # of the host's memory: nymph start --task-memory-max
_POLL_S = 0.05
_START_TIME_SLACK_S = 0.01
_PR_SET_CHILD_SUBREAPER = 36
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PREFORK_DEFAULT = True
_ZYGOTE_TIMEOUT_S = 30.0  # start-up (imports on a cold page cache) and one fork answer
_ZYGOTE_MAX_FAILURES = 3  # consecutive zygote failures before prefork gives up for this runner
_ZYGOTE_MAX = 4  # zygotes kept at once, one per distinct interpreter environment
# per-invocation variables: read after start-up, so a zygote serves tasks that differ only in them
_PER_TASK_ENV = ("LAKESHORE_",)
TASK_MARKER_ENV = "LAKESHORE_TASK"  # nymph-<id>-a<attempt>: how the fallback finds strays
_PER_TASK_ENV_KEYS = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)


class ProcessRunner:
    """Runs each invocation as a local process group (one session per invocation)."""

    name: ClassVar[str] = "process"
    capabilities: ClassVar[Capabilities] = Capabilities(
        as_user=True,
        gpus=True,
        recover=True,
        reap_orphans=True,
        exit_fd=True,
        args_inline=True,
        resources=True,  # memory and pids where the controllers are (start() refuses the rest)
        task_offer=True,
    )

    def __init__(
        self,
        python: str | None = None,
        bash: str = "bash",
        runuser: str = "runuser",
        prefork: bool = PREFORK_DEFAULT,
        cgroup: str = "auto",
        pythonpath: Iterable[str] | str | None = None,
        warm: bool = False,
        warm_max_calls: int = 0,
        warm_workers: int = 1,
        warm_users: Iterable[str] | str = (),
        memory: int | str | None = MEMORY_MAX_DEFAULT,
        pids: int | str | None = PIDS_MAX_DEFAULT,
    ) -> None:
        self.python = python or default_python()
        # what tasks import from when it is not nymph's own PYTHONPATH (a task user who cannot
        # read nymph's venv: the system python3 with the entry bundle and the code's directory)
        self.pythonpath = None if pythonpath is None else os.pathsep.join(option_list(pythonpath))
        self.bash = bash
        self.runuser = runuser
        self.prefork = bool(prefork)
        self.cgroup = str(cgroup)
        self.cgroups: TaskCgroups | None = None
        self.cgroup_problem = 'turned off (cgroup = "off")'
        if self.cgroup != "off":
            found = detect(None if self.cgroup == "auto" else self.cgroup)
            self.cgroups, self.cgroup_problem = found.tree, found.problem
            if found.tree is None:
                log.warning(
                    "process runner: no task cgroups (%s); falling back to process groups: a "
                    "descendant that leaves its task's session is found by walking the process "
                    "tree, best effort",
                    found.problem,
                )
        # memory.max / pids.max of each task cgroup (nymph.limits): the caps, and where they live
        self.controllers = limits.detect(None if self.cgroups is None else self.cgroups.base)
        self.caps = parse_defaults(self.name, memory=_memory_cap(memory), pids=pids or None)
        self._joins: dict[Path, list[Path]] = {}  # a task cgroup -> the v1 cgroups it joins too
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._pidfds: dict[int, int] = {}
        self._forked: dict[int, tuple[ZygoteClient, ForkedChild]] = {}
        self._zygotes: dict[tuple[tuple[str, str], ...], ZygoteClient] = {}
        self._zygote_lock = threading.Lock()
        self._zygote_failures = 0
        # held from spawning a leader until it is in _children, and while reaping anything that is
        # not: an orphan sweep must never reap a leader Popen has not been told about (its exit
        # status would be lost and Popen would report 0)
        self._spawn_lock = threading.Lock()
        # warm mode (nymph_process.warm): trusted ref calls run in long-lived workers, many each
        self._warm = (
            WarmPool(
                self.python,
                workers=int(warm_workers),
                max_calls=int(warm_max_calls),
                cgroups=self.cgroups,
                env_key=_interpreter_key,
                users=option_list(warm_users),
            )
            if _flag(warm)
            else None
        )
        become_subreaper()

    # --- lifecycle ------------------------------------------------------------------------------

    def task_offer(self) -> dict[str, Any]:
        """One task's memory cap where the memory controller holds it (0 where none does: a task
        asking for memory would be refused here), and no CPUs (no controller holds ``cpus``)."""
        memory = self.caps.memory if "memory" in self.controllers.available else None
        return {"memory": int(memory or 0), "cpus": 0}

    def check(self) -> None:
        if self.cgroups is None and self.cgroup not in ("auto", "off"):
            raise RunnerUnavailable(
                f"process runner: cgroup={self.cgroup!r} cannot be used: {self.cgroup_problem}"
            )
        if not os.access(self.python, os.X_OK):
            raise RunnerUnavailable(f"process runner: python {self.python!r} is not executable; set python=")
        env = None if self.pythonpath is None else {**os.environ, "PYTHONPATH": self.pythonpath}
        probe = subprocess.run(
            [self.python, "-c", f"import {ENTRY_MODULE}"], capture_output=True, text=True, timeout=60, env=env
        )
        if probe.returncode != 0:
            raise RunnerUnavailable(
                f"process runner: {self.python} cannot import {ENTRY_MODULE} "
                f"(install dreamlake-lakeshore in that interpreter): {probe.stderr.strip()[-300:]}"
            )

    def close(self) -> None:
        """Stop the zygotes (tasks they forked carry on); nymph calls it at shutdown."""
        with self._zygote_lock:
            zygotes = list(self._zygotes.values())
            self._zygotes.clear()
        for zygote in zygotes:
            zygote.close()
        if self._warm is not None:
            self._warm.close()

    def start(self, task: Task) -> Handle:
        asked = self._resources(task)
        if asked.memory is not None and "memory" in self.controllers.available:
            # packing a result takes as much memory again: the entry refuses one past half the
            # limit before it packs it (ResultTooLarge), rather than dying at the limit
            task.env[RESULT_MAX_ENV] = str(asked.memory // 2)
        if self._warm is not None and task.args is not None and task.script is None:
            self._write_args(task)  # a warm worker reads the workdir's args.msgpack (and serves() too)
        if self._warm is not None and self._warm.serves(task):
            data = self._warm.start(task, self._task_env(task))
            if data is not None:
                data.update(workdir=str(task.workdir), task=task_name(task))
                return Handle(
                    runner=self.name, invocation_id=task.invocation_id, attempt=task.attempt, data=data
                )
        cgroup = self._task_cgroup(task)
        try:
            if cgroup is not None:
                self._limit(task, cgroup, asked)
            return self._start(task, cgroup)
        except BaseException:
            if cgroup is not None and self.cgroups is not None and not self.cgroups.populated(cgroup):
                self.cgroups.remove(cgroup)  # nothing started in it: no empty cgroup left behind
                self.controllers.remove([p.parent for p in self._joins.pop(cgroup, [])])
            raise

    def _resources(self, task: Task) -> Resources:
        """The task's memory and pids limits: what it asks for (refused above nymph's caps, or
        where no controller holds it), else the caps."""
        unsupported = dict(UNSUPPORTED_RESOURCES)
        for name in limits.CONTROLLERS:
            if name not in self.controllers.available:
                unsupported[name] = _NO_CONTROLLER.format(name)
        asked = parse_resources(task.run_config.get("resources"), self.name, unsupported=unsupported)
        for name, flag in (("memory", "--task-memory-max"), ("pids", "--task-pids-max")):
            value, cap = getattr(asked, name), getattr(self.caps, name)
            if value is not None and cap is not None and value > cap:
                shown = limits.size(value) if name == "memory" else str(value)
                capped = limits.size(cap) if name == "memory" else str(cap)
                raise ResourceError(
                    self.name,
                    name,
                    f"asks for {shown}, above this nymph's cap of {capped} ({flag})",
                    f"ask for {capped} or less, or raise {flag} on the nymph",
                )
        return asked.over(self.caps)

    def _limit(self, task: Task, cgroup: Path, asked: Resources) -> None:
        """Set ``asked``'s memory and pids limits on the task's cgroup(s) (nymph.limits)."""
        if not self.controllers.available:
            return
        memory = asked.memory if "memory" in self.controllers.available else None
        pids = asked.pids if "pids" in self.controllers.available else None
        try:
            self._joins[cgroup] = self.controllers.apply(cgroup, task_name(task), memory, pids)
        except OSError as exc:
            raise RunnerError(f"process runner: cannot set the task's limits in {cgroup}: {exc}") from exc

    def _start(self, task: Task, cgroup: Path | None) -> Handle:
        if self.prefork and task.script is None and (not task.as_user or os.geteuid() == 0):
            handle = self._start_forked(task, cgroup)
            if handle is not None:
                return handle
        if task.args is not None and task.script is None:  # the spawned entry reads them from the file
            self._write_args(task)
        cmd = [self.bash, "-c", task.script] if task.script is not None else [self.python, "-m", ENTRY_MODULE]
        if task.as_user:
            cmd = [self.runuser, "-u", task.as_user, "--", *cmd]
        if cgroup is not None:  # joins its cgroup before anything of the task's runs
            cmd = [*spawn_prefix(cgroup, *self._joins.get(cgroup, ())), *cmd]
        env = self._task_env(task)
        workdir = Path(task.workdir)
        lock: int | None = None
        if task.script is None:  # the entry runs once per workdir: under its lock, inherited below
            lock, holder = self._entry_lock(task, cgroup)
            if holder is not None:
                return holder
        out = err = -1
        try:
            try:  # the workdir is the task user's: never through a link planted there
                out = safeio.open_append(workdir, "stdout.log")
                err = safeio.open_append(workdir, "stderr.log")
            except OSError as exc:
                raise RunnerError(f"process runner: cannot open the logs in {workdir}: {exc}") from exc
            with self._spawn_lock:
                try:
                    proc = subprocess.Popen(
                        cmd,
                        cwd=workdir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=() if lock is None else (lock,),
                    )
                except OSError as exc:
                    raise RunnerError(f"process runner: cannot spawn {cmd[0]!r}: {exc}") from exc
                self._children[proc.pid] = proc
            if lock is not None:  # still held here: no forked child can slip in between
                _record_entry(lock, proc.pid)
        finally:
            for fd in (out, err):
                if fd >= 0:
                    os.close(fd)
            if lock is not None:
                os.close(lock)  # the entry's inherited copy keeps the lock until it exits
        with contextlib.suppress(OSError, AttributeError):
            # our child cannot be reaped (nor its pid reused) before this: only we wait for it
            self._pidfds[proc.pid] = os.pidfd_open(proc.pid)
        try:
            start_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            start_time = 0.0
        log.debug("invocation %s: started pid %d", task.invocation_id, proc.pid)
        return self._handle(task, proc.pid, start_time, cgroup)

    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None:
        warm = self._warm_worker(handle)
        if warm is not None:
            return warm[0].wait(warm[1], int(handle.data["warm"]), timeout, handle_workdir(handle))
        pid = int(handle.data["pid"])
        forked = self._forked.get(pid)
        if forked is not None:
            child = forked[1]
            if not child.done.wait(timeout):
                return None
            if child.code is not None:
                return self._status(handle, child.code)
            # the zygote died first: exit code unknown, watched below like a re-attached process
        proc = self._children.get(pid)
        if proc is not None:
            if proc.poll() is None and not _pidfd_ready(self._pidfds.get(pid), timeout):
                try:  # no pidfd (old kernel): Popen's own wait, which polls
                    proc.wait(0 if pid in self._pidfds else timeout)
                except subprocess.TimeoutExpired:
                    return None
            code = proc.wait()
            return self._status(handle, code)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._leader(handle) is not None and not self._warm_call_over(handle):
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)
        return self._status(handle, self._inferred_code(handle))

    def exit_fd(self, handle: Handle) -> int | None:
        """A spawned entry's pidfd, a forked child's exit pipe; None for a re-attached process and
        a warm call (its worker outlives the call: the call waits in a thread)."""
        if "warm" in handle.data:
            return None
        pid = int(handle.data["pid"])
        forked = self._forked.get(pid)
        if forked is not None:
            return forked[1].exit_fd()
        return self._pidfds.get(pid)

    def stop(self, handle: Handle, grace_s: float) -> None:
        warm = self._warm_worker(handle)
        if warm is not None:  # the worker dies with the call; the pool replaces it
            warm[0].stop(warm[1], int(handle.data["warm"]), grace_s)
            return
        cgroup = self._cgroup_of(handle)
        if cgroup is not None:  # the whole cgroup: every session and process group in it
            tree, path = cgroup
            if not tree.populated(path):
                self._reap(handle)
                return
            tree.signal(path, signal.SIGTERM)
            deadline = time.monotonic() + max(grace_s, 0.0)
            while time.monotonic() < deadline:
                self._reap(handle)
                if not tree.populated(path):
                    return
                time.sleep(_POLL_S)
            tree.kill(path)
            tree.wait_empty(path, 10.0)
            self._reap(handle)
            return
        pgid = int(handle.data["pgid"])
        strays = self._strays(handle)
        if not self._owns_group(handle) and not strays:
            return
        self._signal_group(pgid, signal.SIGTERM)
        _signal_each(strays, signal.SIGTERM)
        deadline = time.monotonic() + max(grace_s, 0.0)
        while time.monotonic() < deadline:
            self._reap(handle)
            if not self._group_members(pgid) and not self._strays(handle):
                return
            time.sleep(_POLL_S)
        self._signal_group(pgid, signal.SIGKILL)
        _kill_and_wait(self._strays(handle))
        self._wait_group_gone(handle)

    def destroy(self, handle: Handle) -> None:
        warm = self._warm_worker(handle)
        if warm is not None:  # the worker goes back to the pool, or is killed if the call did not end
            warm[0].done(warm[1], int(handle.data["warm"]))
            self.reap_orphans()  # what a killed worker's calls left, reparented to nymph
            return
        cgroup = self._cgroup_of(handle)
        if cgroup is None:
            _kill_and_wait(self._strays(handle))
        elif not cgroup[0].try_remove(cgroup[1]) and cgroup[0].populated(cgroup[1]):
            cgroup[0].kill(cgroup[1])  # whatever the task left running, in any session
            cgroup[0].wait_empty(cgroup[1], 10.0)
        pgid = int(handle.data["pgid"])
        pid = int(handle.data["pid"])
        proc = self._children.get(pid)
        if proc is not None:
            proc.poll()
        # Fast path: once the leader is reaped, an empty group answers ESRCH to kill(-pgid, 0),
        # with no scan of every process on the host.
        leader_reaped = proc is not None and proc.returncode is not None
        forked = self._forked.get(pid)
        if forked is not None:  # the zygote reaps it; its exit report says the leader is gone
            leader_reaped = forked[1].done.is_set() and forked[1].code is not None
        if not (leader_reaped and not _group_exists(pgid)):
            if self._group_members(pgid) and self._owns_group(handle):
                self._signal_group(pgid, signal.SIGKILL)
            self._wait_group_gone(handle)
        if forked is not None:  # wait for the zygote to reap the leader: no zombie outlives destroy
            forked[1].done.wait(10.0)
            forked[0].forget(pid)
            self._forked.pop(pid, None)
        self._children.pop(pid, None)
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            os.close(fd)
        if cgroup is not None:
            cgroup[0].remove(cgroup[1])
        self.controllers.remove(self._v1_of(handle))
        self.reap_orphans()

    def reap_orphans(self) -> int:
        """Reap zombie children that are no task's leader (descendants reparented to nymph).

        nymph is a child subreaper, so a task's grandchildren whose parent died become nymph's
        children; this reaps those that exited. nymph's own helper subprocesses (same process
        group as nymph) and task leaders (reaped by their Popen) are left alone. Returns the count.
        """
        reaped = 0
        own_group = os.getpgrp()
        try:  # peek without reaping: no exited child at all is the common case, and costs no scan
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return 0
        except ChildProcessError:
            return 0
        except (OSError, AttributeError):
            pass
        with self._spawn_lock:
            try:
                children = psutil.Process().children()
            except psutil.Error:
                return 0
            for child in children:
                if child.pid in self._children or self._owned_by_warm(child.pid):
                    continue
                with contextlib.suppress(ChildProcessError, OSError, psutil.Error):
                    if child.status() != psutil.STATUS_ZOMBIE or os.getpgid(child.pid) == own_group:
                        continue
                    if os.waitpid(child.pid, os.WNOHANG)[0] == child.pid:
                        reaped += 1
        return reaped

    def inspect(self, handle: Handle) -> str:
        warm = self._warm_worker(handle)
        if warm is not None:
            return "running" if warm[1].busy == handle.data["warm"] else "exited"
        if "warm" in handle.data and (
            self._owned_by_warm(int(handle.data["pid"])) or self._warm_call_over(handle)
        ):
            return "exited"  # the call ended (destroyed, or a previous life's); its worker lives on
        pid = int(handle.data["pid"])
        forked = self._forked.get(pid)
        if forked is not None and (not forked[1].done.is_set() or forked[1].code is not None):
            return "running" if not forked[1].done.is_set() else "exited"
        proc = self._children.get(pid)
        if proc is not None:
            return "running" if proc.poll() is None else "exited"
        return "running" if self._leader(handle) is not None else "gone"

    def recover(self, handle: Handle) -> bool:
        return self._leader(handle) is not None

    def _warm_worker(self, handle: Handle) -> tuple[WarmPool, WarmWorker] | None:
        """The pool and worker of a warm call this runner started; None for any other handle (a
        warm call of a previous life is an ordinary re-attached process)."""
        if self._warm is None or "warm" not in handle.data:
            return None
        worker = self._warm.running(handle.data)
        return None if worker is None else (self._warm, worker)

    # --- the entry lock -------------------------------------------------------------------------

    def _entry_lock(self, task: Task, cgroup: Path | None) -> tuple[int | None, Handle | None]:
        """Take the workdir's entry lock to spawn the entry, or the handle of who already ran it.

        A forked child whose answer was lost holds the lock while it runs (and leaves its pid and
        start time in the file after): that child is the task, adopted like a re-attached process,
        provided it runs as the workdir's owner (the file is in the task's reach, so what it names
        is never trusted further than the task itself).
        """
        workdir = Path(task.workdir)
        path = workdir / ENTRY_LOCK
        deadline = time.monotonic() + _ZYGOTE_TIMEOUT_S
        while True:
            try:
                fd = safeio.open_fd(workdir, ENTRY_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise RunnerError(f"process runner: cannot open {path}: {exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                locked = False
            except OSError as exc:
                os.close(fd)
                raise RunnerError(f"process runner: cannot lock {path}: {exc}") from exc
            else:
                locked = True
            holder = _entry_holder(fd)
            if locked and holder is None:
                return fd, None
            os.close(fd)
            if holder is not None:
                pid, start_time = holder
                if not _runs_as_owner(pid, workdir):
                    raise RunnerError(
                        f"process runner: {path} names pid {pid}, which does not run as the "
                        "workdir's owner; not adopted"
                    )
                log.warning(
                    "invocation %s: a zygote child (pid %d) whose fork answer was lost runs the entry; "
                    "adopting it instead of starting it again",
                    task.invocation_id,
                    pid,
                )
                return None, self._handle(task, pid, start_time, cgroup)
            if time.monotonic() >= deadline:  # locked, never recorded: a child stuck in between
                raise RunnerError(f"process runner: {path} stays locked by an unknown process")
            time.sleep(_POLL_S)  # a child took the lock and is about to record itself

    # --- warm fork ------------------------------------------------------------------------------

    def _start_forked(self, task: Task, cgroup: Path | None) -> Handle | None:
        """Start ``task`` through a zygote; None when prefork cannot serve it (spawn it instead)."""
        env = self._task_env(task)
        workdir = Path(task.workdir)
        try:
            user = passwd_record(task.as_user) if task.as_user else None
        except KeyError:
            raise RunnerError(
                f"process runner: as_user {task.as_user!r} is not a user on this host"
            ) from None
        procs = None if cgroup is None else join_list(cgroup, *self._joins.get(cgroup, ()))
        for _attempt in range(2):  # a zygote found dead is restarted once for this task
            zygote = self._zygote(env)
            if zygote is None:
                return None
            try:
                child, start_time = zygote.fork(
                    workdir, env, _ZYGOTE_TIMEOUT_S, cgroup=procs, user=user, args=task.args
                )
            except ZygoteError as exc:
                log.warning("invocation %s: zygote %d: %s", task.invocation_id, zygote.pid, exc)
                self._zygote_failed(zygote)
                if exc.maybe_forked:  # a child may run it: only the entry lock decides from here
                    return None
                continue
            self._zygote_failures = 0
            self._forked[child.pid] = (zygote, child)
            log.debug(
                "invocation %s: forked pid %d from zygote %d", task.invocation_id, child.pid, zygote.pid
            )
            return self._handle(task, child.pid, start_time, cgroup)
        return None

    @staticmethod
    def _write_args(task: Task) -> None:
        """``args.msgpack`` for an entry that reads it (spawned), when nymph handed the arguments
        in the Task (``args_inline``); a file already there (a start tried again) is kept."""
        workdir = Path(task.workdir)
        if os.path.lexists(workdir / ARGS_FILE):
            return
        try:
            safeio.write_file(workdir, ARGS_FILE, task.args or b"")
            owner = os.stat(workdir)
            if owner.st_uid != os.geteuid():  # the entry runs as the workdir's user: theirs, like the rest
                os.chown(workdir / ARGS_FILE, owner.st_uid, owner.st_gid, follow_symlinks=False)
        except OSError as exc:
            raise RunnerError(f"process runner: cannot write {ARGS_FILE} in {workdir}: {exc}") from exc

    def pip_interpreter(self, run_config: Mapping[str, object]) -> Interpreter:
        """What a pip environment is built for: this runner's python (nymph.envcache)."""
        return host_interpreter(self.python)

    def _task_env(self, task: Task) -> dict[str, str]:
        """The host base (nymph.taskenv: PATH, HOME, LANG, TZ, ...; never nymph's whole
        environment), then the task's own variables."""
        env = dict(host_base())
        env.update(task.env)
        if self.pythonpath is not None:
            env["PYTHONPATH"] = self.pythonpath
        env[TASK_MARKER_ENV] = task_name(task)
        return env

    def _handle(self, task: Task, pid: int, start_time: float, cgroup: Path | None) -> Handle:
        data: dict[str, object] = {
            "pid": pid,
            "pgid": pid,
            "start_time": start_time,
            "workdir": str(task.workdir),
            "task": task_name(task),
        }
        if cgroup is not None:
            data["cgroup"] = str(cgroup)
            joins = self._joins.pop(cgroup, None)
            if joins:  # the v1 cgroups its limits live in (nymph.limits): removed with the task
                data["limits"] = [str(p.parent) for p in joins]
        return Handle(runner=self.name, invocation_id=task.invocation_id, attempt=task.attempt, data=data)

    # --- cgroups and the process-group fallback -------------------------------------------------

    def _task_cgroup(self, task: Task) -> Path | None:
        """A fresh cgroup for ``task``; None without cgroups (or when this one cannot be made)."""
        if self.cgroups is None:
            return None
        try:
            return self.cgroups.create(task_name(task))
        except CgroupError as exc:
            log.warning("invocation %s: %s; tracked by its process group", task.invocation_id, exc)
            return None

    def _cgroup_of(self, handle: Handle) -> tuple[TaskCgroups, Path] | None:
        """The cgroup a handle records, with the tree that manages it; None when it records none."""
        raw = handle.data.get("cgroup")
        if not raw:
            return None
        path = Path(str(raw))
        if self.cgroups is not None and self.cgroups.owns(path):
            return self.cgroups, path
        if path.is_absolute() and ".." not in path.parts and (path / "cgroup.kill").exists():
            return TaskCgroups(path.parent), path  # a previous life's tree (nymph's own handle)
        return self.cgroups or TaskCgroups(path.parent), path  # gone: nothing left to kill

    def _strays(self, handle: Handle) -> list[psutil.Process]:
        """Without a cgroup: the task's processes outside its process group (best effort).

        nymph is a child subreaper, so a descendant whose parent died (a double fork, a ``setsid``
        daemon) is reparented to nymph; those of nymph's descendants that carry this task's marker
        (``LAKESHORE_TASK``, unless they cleared their environment), started after the task, are
        its strays. After a nymph restart they are no longer nymph's descendants and are missed.
        """
        marker = handle.data.get("task")
        if not marker:
            return []
        pgid = int(handle.data["pgid"])
        since = float(handle.data.get("start_time") or 0.0) - 1.0
        strays = []
        try:
            descendants = psutil.Process().children(recursive=True)
        except psutil.Error:
            return []
        for proc in descendants:
            with contextlib.suppress(psutil.Error, OSError):
                if proc.create_time() < since or os.getpgid(proc.pid) == pgid:
                    continue
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if proc.environ().get(TASK_MARKER_ENV) == marker:
                    strays.append(proc)
        return strays

    def _zygote(self, env: dict[str, str]) -> ZygoteClient | None:
        """The live zygote for this interpreter environment, started if needed; None: spawn instead."""
        key = _interpreter_key(env)
        with self._zygote_lock:
            if self._zygote_failures >= _ZYGOTE_MAX_FAILURES:
                return None
            zygote = self._zygotes.get(key)
            if zygote is not None and zygote.alive:
                return zygote
            if zygote is None and len(self._zygotes) >= _ZYGOTE_MAX:
                return None
            try:
                zygote = ZygoteClient(self.python, dict(key))
            except ZygoteError as exc:
                log.warning("process runner: %s; spawning instead", exc)
                self._zygote_failures += 1
                return None
            self._zygotes[key] = zygote
            return zygote

    def _zygote_failed(self, zygote: ZygoteClient) -> None:
        with self._zygote_lock:
            self._zygote_failures += 1
            for key, known in list(self._zygotes.items()):
                if known is zygote:
                    del self._zygotes[key]
            if self._zygote_failures >= _ZYGOTE_MAX_FAILURES:
                log.warning(
                    "process runner: the zygote failed %d times; spawning from now on", self._zygote_failures
                )
        zygote.close()

    # --- helpers --------------------------------------------------------------------------------

    def _leader(self, handle: Handle) -> psutil.Process | None:
        """The live (non-zombie) leader process of ``handle``, verified by its start time."""
        try:
            proc = psutil.Process(int(handle.data["pid"]))
            if abs(proc.create_time() - float(handle.data.get("start_time", 0.0))) > _START_TIME_SLACK_S:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(proc.pid, os.WNOHANG)
                return None
            return proc
        except psutil.Error:
            return None

    def _owns_group(self, handle: Handle) -> bool:
        """True while the group is ours: the leader is ours, or it exited and the group lingers."""
        pid = int(handle.data["pid"])
        if pid in self._children or self._leader(handle) is not None:
            return True
        forked = self._forked.get(pid)
        if forked is not None and not forked[1].done.is_set():
            return True  # exited, not yet reaped by the zygote: the pid cannot be reused yet
        # Leader gone (recovered case): the group id cannot be recycled while members remain.
        return bool(self._group_members(int(handle.data["pgid"])))

    @staticmethod
    def _group_members(pgid: int) -> list[psutil.Process]:
        members = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == pgid:
                    members.append(proc)
            except (OSError, psutil.Error):
                continue
        return members

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def _reap(self, handle: Handle) -> None:
        """Reap the leader (our child) and any group member reparented to us (a subreaper)."""
        proc = self._children.get(int(handle.data["pid"]))
        if proc is not None:
            proc.poll()
        for member in self._group_members(int(handle.data["pgid"])):
            if member.pid in self._children or member.pid in self._forked or self._owned_by_warm(member.pid):
                continue  # Popen (or the zygote) reaps its own child; stealing its status would hide a signal
            with contextlib.suppress(ChildProcessError, OSError, psutil.Error):
                if member.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(member.pid, os.WNOHANG)

    @staticmethod
    def _warm_call_over(handle: Handle) -> bool:
        """A warm call of a previous life whose worker lives on: over once its entry lock is free."""
        workdir = handle_workdir(handle)
        return "warm" in handle.data and workdir is not None and warm_call_over(workdir)

    def _owned_by_warm(self, pid: int) -> bool:
        return self._warm is not None and self._warm.owns(pid)

    def _wait_group_gone(self, handle: Handle, limit_s: float = 10.0) -> None:
        pgid = int(handle.data["pgid"])
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self._reap(handle)
            alive = [m for m in self._group_members(pgid) if _not_zombie(m)]
            if not alive:
                return
            self._signal_group(pgid, signal.SIGKILL)
            time.sleep(_POLL_S)
        log.warning("invocation %s: process group %d still has members", handle.invocation_id, pgid)

    def _inferred_code(self, handle: Handle) -> int:
        workdir = handle_workdir(handle)
        return inferred_exit_code(workdir) if workdir is not None else -1

    def _status(self, handle: Handle, code: int) -> ExitStatus:
        reason = None
        pid = int(handle.data["pid"])
        known = pid in self._children or (pid in self._forked and self._forked[pid][1].code is not None)
        if code < 0:
            reason = f"signal {-code}" if code != -1 or known else None
        if code == -1 and not known:
            reason = "exit status unknown (re-attached after a nymph restart)"
        oom = self._oom(handle) if code else None
        if oom is not None:
            reason = "OOMKilled"
        # the tail of the logs says why a task failed; a task that exited 0 needs none
        return ExitStatus(
            exit_code=code,
            reason=reason,
            logs=log_tail(handle_workdir(handle)) if code else None,
            oom=None if oom is None else {"limit": oom.limit, "peak": oom.peak},
        )

    def _oom(self, handle: Handle) -> limits.OomKill | None:
        """The OOM kill of an ended task, read from its cgroups before they are removed."""
        cgroup = self._cgroup_of(handle)
        return self.controllers.oom(None if cgroup is None else cgroup[1], self._v1_of(handle))

    def _v1_of(self, handle: Handle) -> list[Path]:
        """The v1 cgroups a handle records, if they are task cgroups of this runner's hierarchies."""
        raw = handle.data.get("limits")
        if not isinstance(raw, list):
            return []
        bases = set(self.controllers.v1.values())
        paths = [Path(str(p)) for p in raw]
        return [p for p in paths if p.parent in bases and p.name and not p.name.startswith(".")]


def _memory_cap(value: int | str | None) -> int | str | None:
    """``--task-memory-max``: a size, or a share of the host's memory (``"90%"``); None: no cap."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ResourceError(
                "process",
                "memory",
                f"not a share of the host's memory: {value!r}",
                "give a size (512m, 8g) or a share between 1% and 100%",
                source="runner_options",
            )
        total = limits.host_memory()
        return None if total is None else int(total * share / 100)
    return value


def _interpreter_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What of a task's environment shapes an interpreter: all but the per-task variables."""
    return tuple(
        sorted(
            (k, v) for k, v in env.items() if k not in _PER_TASK_ENV_KEYS and not k.startswith(_PER_TASK_ENV)
        )
    )


def _flag(value: object) -> bool:
    """A boolean runner option that may come as a string (``NYMPH_RUNNER_OPT_WARM=false``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def become_subreaper() -> None:
    """Adopt orphaned descendants (Linux prctl), so every process a task forks can be reaped.

    Without it a grandchild killed after its parent exited is reparented to PID 1, which on some
    hosts (containers, micro-VMs) never reaps, and lingers as a zombie.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _pidfd_ready(fd: int | None, timeout: float | None) -> bool:
    """Block on a pidfd until the process exits (True) or ``timeout`` passes (False)."""
    if fd is None:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


def _entry_holder(fd: int) -> tuple[int, float] | None:
    """The ``(pid, start_time)`` recorded in an entry lock file; None when nothing is recorded."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = json.loads(os.read(fd, 4096) or b"null")
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("pid"), int):
        return None
    ticks = raw.get("ticks")
    start_time = start_time_of(ticks) if isinstance(ticks, int) else 0.0
    return int(raw["pid"]), start_time


def _record_entry(fd: int, pid: int) -> None:
    """Say in the entry lock file that ``pid`` runs (ran) the entry: no forked child runs it after."""
    ticks = None
    with contextlib.suppress(psutil.Error):
        ticks = round((psutil.Process(pid).create_time() - boot_time()) * _CLOCK_TICKS)
    with contextlib.suppress(OSError):
        os.write(fd, json.dumps({"pid": pid, "ticks": ticks}).encode())


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _not_zombie(proc: psutil.Process) -> bool:
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _signal_each(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def _kill_and_wait(procs: list[psutil.Process], limit_s: float = 10.0) -> None:
    """SIGKILL ``procs`` and wait until each is gone or a zombie (a kill is delivered asynchronously)."""
    _signal_each(procs, signal.SIGKILL)
    deadline = time.monotonic() + limit_s
    while procs and time.monotonic() < deadline:
        procs = [p for p in procs if _not_zombie(p)]  # a gone process reads as not running
        if procs:
            time.sleep(_POLL_S)


def _runs_as_owner(pid: int, workdir: Path) -> bool:
    """True when process ``pid`` runs as the owner of ``workdir`` (or as nymph's own user)."""
    try:
        uid = psutil.Process(pid).uids().real
        return uid in (workdir.stat().st_uid, os.geteuid())
    except (psutil.Error, OSError):
        return False
