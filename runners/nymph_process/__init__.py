"""nymph's ``process`` runner: each invocation is a local process tree in its own cgroup and session.

Registered through the ``nymph.runners`` entry point exactly like a third-party runner. It spawns
``python -m dreamlake.lakeshore.daemon.entry`` (or ``bash -c SCRIPT``) with the workdir as cwd and
stdout/stderr appended to ``stdout.log`` / ``stderr.log`` there (opened through
:mod:`nymph.safeio`: the workdir is the task user's), in a new session. ``Task.as_user`` (the
invocation's ``as_user``, or nymph's task user when nymph runs as root: :mod:`nymph.taskuser`)
wraps the command in ``runuser -u USER --``.

Every task gets its own cgroup v2 (:mod:`nymph_process.cgroups`), so a descendant that started its
own session dies with the task; where cgroups cannot be used the runner falls back to the process
group plus the task's strays (:mod:`nymph_process.groups`).

The handle records ``pid``, ``pgid``, the leader's ``start_time`` (psutil ``create_time``), the
task's name and its cgroup, so :meth:`ProcessRunner.recover` re-attaches only to the very process
it started, never to a recycled pid. A recovered process is not our child: :meth:`wait` then polls psutil and infers the exit code
from the workdir (``result.msgpack`` -> 0, ``error.json`` -> 1, neither -> unknown).

``prefork=True`` (warm fork, on by default): a Python task is forked by a long-lived zygote that
has already paid the interpreter start-up and the entry's imports (:mod:`nymph_process.forking`).
Never twice in one workdir: a Python entry runs only under the workdir's entry lock
(:mod:`nymph_process.entrylock`), which also makes ``start`` idempotent under retry. Limits
(``memory.max``, ``pids.max``) and what a task may ask for: :mod:`nymph_process.caps`.

Options: ``python`` (the tasks' interpreter, default nymph's own), ``pythonpath`` (the tasks'
``PYTHONPATH`` instead of nymph's own, a list; e.g. the entry bundle and the code's directory when
the task user cannot read nymph's environment), ``prefork``, ``zygotes`` (how many zygotes live at
once, one per namespace and environment; ``nymph start`` passes its slot count, at least 4),
``cgroup``, ``memory``, ``pids``, and the warm mode's ``warm`` (off by default), ``warm_max_calls``
(recycle a worker after that many calls; 0: never) and ``warm_workers`` (its slot count too).

``warm=True`` (:mod:`nymph_process.warm`, trusted code only): a Python ``ref`` call with no user
to become runs in a long-lived warm worker that imports its module once and runs call after call
in itself, with no isolation between calls; a crash, cancel or timeout kills that worker only.
Scripts, tasks with a user to become and pickled functions take the paths above.

The task's environment is the documented host base (``PATH``, ``HOME``, ``LANG``, ``TZ``, ...:
:func:`nymph.taskenv.host_base`, cached and recomputed only when nymph's own environment changed)
plus ``Task.env``; never nymph's whole environment. A pip environment (nymph.envcache) is built for
the runner's ``python`` (:meth:`ProcessRunner.pip_interpreter`) and comes in ``Task.code_dirs``;
code a call shipped (``Task.code_dirs``) reaches the task as ``LAKESHORE_CODE_PATH``.

Optional features (:class:`~nymph.runner.Capabilities`): ``reap_orphans`` (nymph is a child
subreaper; the agent calls :meth:`ProcessRunner.reap_orphans`) and ``exit_fd`` (a spawned entry's
pidfd, a forked child's exit pipe written by the zygote's reader: a running task waits in nymph's
supervisor loop, with no thread of its own). ``close`` stops the zygotes.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
from nymph.cgroup import TaskCgroups, join_list, spawn_prefix
from nymph.envcache import Interpreter, host_interpreter
from nymph.resources import Resources, parse_defaults
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
from nymph_process import caps as taskcaps
from nymph_process import cgroups, entrylock, groups
from nymph_process.caps import MEMORY_MAX_DEFAULT, PIDS_MAX_DEFAULT
from nymph_process.forking import ZYGOTE_TIMEOUT_S, ZYGOTES_DEFAULT, Zygotes
from nymph_process.forking import interpreter_key as _interpreter_key
from nymph_process.groups import TASK_MARKER_ENV, become_subreaper
from nymph_process.prefork import ForkedChild, ZygoteClient
from nymph_process.warm import WarmPool, WarmWorker
from nymph_process.warm import call_over as warm_call_over

log = logging.getLogger(__name__)

_POLL_S = groups.POLL_S
PREFORK_DEFAULT = True


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
        zygotes: int = ZYGOTES_DEFAULT,
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
        self.cgroups, self.cgroup_problem = cgroups.detect(self.cgroup)
        # memory.max / pids.max of each task cgroup (nymph.limits): the caps, and where they live
        self.controllers = limits.detect(None if self.cgroups is None else self.cgroups.base)
        self.caps = parse_defaults(self.name, memory=taskcaps.memory_cap(memory), pids=pids or None)
        self._joins: dict[Path, list[Path]] = {}  # a task cgroup -> the v1 cgroups it joins too
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._pidfds: dict[int, int] = {}
        self._forked: dict[int, tuple[ZygoteClient, ForkedChild]] = {}
        self._zygote_pool = Zygotes(self.python, int(zygotes))  # prefork (nymph_process.forking)
        self._zygotes = self._zygote_pool.live
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
        self._zygote_pool.close()
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
        """The task's memory and pids limits (:func:`nymph_process.caps.asked`)."""
        return taskcaps.asked(self.name, task.run_config.get("resources"), self.controllers, self.caps)

    def _limit(self, task: Task, cgroup: Path, asked: Resources) -> None:
        """Set ``asked``'s memory and pids limits on the task's cgroup(s) (nymph.limits)."""
        joins = taskcaps.apply(self.controllers, cgroup, task_name(task), asked)
        if joins is not None:
            self._joins[cgroup] = joins

    def _start(self, task: Task, cgroup: Path | None) -> Handle:
        if task.args is not None and task.script is None:  # the entry reads them from the file,
            self._write_args(task)  # spawned or forked (never through a zygote: nymph_process.forking)
        if self.prefork and task.script is None and (not task.as_user or os.geteuid() == 0):
            handle = self._start_forked(task, cgroup)
            if handle is not None:
                return handle
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
                entrylock.record(lock, proc.pid)
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
            if proc.poll() is None and not groups.pidfd_ready(self._pidfds.get(pid), timeout):
                try:  # no pidfd (old kernel): Popen's own wait, which polls
                    proc.wait(0 if pid in self._pidfds else timeout)
                except subprocess.TimeoutExpired:
                    return None
            code = proc.wait()
            return self._status(handle, code)
        deadline = None if timeout is None else time.monotonic() + timeout
        while groups.leader(handle) is not None and not self._warm_call_over(handle):
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
        strays = groups.strays(handle)
        if not self._owns_group(handle) and not strays:
            return
        groups.signal_group(pgid, signal.SIGTERM)
        groups.signal_each(strays, signal.SIGTERM)
        deadline = time.monotonic() + max(grace_s, 0.0)
        while time.monotonic() < deadline:
            self._reap(handle)
            if not groups.members(pgid) and not groups.strays(handle):
                return
            time.sleep(_POLL_S)
        groups.signal_group(pgid, signal.SIGKILL)
        groups.kill_and_wait(groups.strays(handle))
        self._wait_group_gone(handle)

    def destroy(self, handle: Handle) -> None:
        warm = self._warm_worker(handle)
        if warm is not None:  # the worker goes back to the pool, or is killed if the call did not end
            warm[0].done(warm[1], int(handle.data["warm"]))
            self.reap_orphans()  # what a killed worker's calls left, reparented to nymph
            return
        cgroup = self._cgroup_of(handle)
        if cgroup is None:
            groups.kill_and_wait(groups.strays(handle))
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
        if not (leader_reaped and not groups.group_exists(pgid)):
            if groups.members(pgid) and self._owns_group(handle):
                groups.signal_group(pgid, signal.SIGKILL)
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
        """Reap zombie children that are no task's leader (:func:`nymph_process.groups.reap_orphans`);
        task leaders (reaped by their Popen) and warm workers are left alone. Returns the count."""
        return groups.reap_orphans(
            self._spawn_lock, lambda pid: pid in self._children or self._owned_by_warm(pid)
        )

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
        return "running" if groups.leader(handle) is not None else "gone"

    def recover(self, handle: Handle) -> bool:
        return groups.leader(handle) is not None

    def _warm_worker(self, handle: Handle) -> tuple[WarmPool, WarmWorker] | None:
        """The pool and worker of a warm call this runner started; None for any other handle (a
        warm call of a previous life is an ordinary re-attached process)."""
        if self._warm is None or "warm" not in handle.data:
            return None
        worker = self._warm.running(handle.data)
        return None if worker is None else (self._warm, worker)

    # --- the entry lock -------------------------------------------------------------------------

    def _entry_lock(self, task: Task, cgroup: Path | None) -> tuple[int | None, Handle | None]:
        """Take the workdir's entry lock to spawn the entry, or the handle of the child that already
        runs it, adopted like a re-attached process (:func:`nymph_process.entrylock.take`)."""
        lock, holder = entrylock.take(Path(task.workdir), task.invocation_id, ZYGOTE_TIMEOUT_S)
        if holder is not None:
            return None, self._handle(task, holder[0], holder[1], cgroup)
        return lock, None

    # --- warm fork ------------------------------------------------------------------------------

    def _start_forked(self, task: Task, cgroup: Path | None) -> Handle | None:
        """Start ``task`` through a zygote; None when prefork cannot serve it (spawn it instead)."""
        procs = None if cgroup is None else join_list(cgroup, *self._joins.get(cgroup, ()))
        forked = self._zygote_pool.fork(task, self._task_env(task), procs)
        if forked is None:
            return None
        zygote, child, start_time = forked
        self._forked[child.pid] = (zygote, child)
        return self._handle(task, child.pid, start_time, cgroup)

    @staticmethod
    def _write_args(task: Task) -> None:
        """``args.msgpack`` for the entry (spawned or forked: it reads it as the task's user), when
        nymph handed the arguments in the Task (``args_inline``); a file already there is kept."""
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
        return cgroups.task_cgroup(self.cgroups, task_name(task), task.invocation_id)

    def _cgroup_of(self, handle: Handle) -> tuple[TaskCgroups, Path] | None:
        return cgroups.cgroup_of(self.cgroups, handle)

    def _owns_group(self, handle: Handle) -> bool:
        """True while the group is ours: the leader is ours, or it exited and the group lingers."""
        pid = int(handle.data["pid"])
        if pid in self._children or groups.leader(handle) is not None:
            return True
        forked = self._forked.get(pid)
        if forked is not None and not forked[1].done.is_set():
            return True  # exited, not yet reaped by the zygote: the pid cannot be reused yet
        # Leader gone (recovered case): the group id cannot be recycled while members remain.
        return bool(groups.members(int(handle.data["pgid"])))

    def _reap(self, handle: Handle) -> None:
        """Reap the leader (our child) and any group member reparented to us (a subreaper)."""
        proc = self._children.get(int(handle.data["pid"]))
        if proc is not None:
            proc.poll()
        for member in groups.members(int(handle.data["pgid"])):
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
            alive = [m for m in groups.members(pgid) if groups.not_zombie(m)]
            if not alive:
                return
            groups.signal_group(pgid, signal.SIGKILL)
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
        return cgroups.v1_of(self.controllers, handle)


def _flag(value: object) -> bool:
    """A boolean runner option that may come as a string (``NYMPH_RUNNER_OPT_WARM=false``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
