"""nymph's ``process`` runner: each invocation is a local process group in its own session.

Registered through the ``nymph.runners`` entry point exactly like a third-party runner. It spawns
``python -m dreamlake.lakeshore.daemon.entry`` (or ``bash -c SCRIPT``) with the workdir as cwd and
stdout/stderr appended to ``stdout.log`` / ``stderr.log`` there, in a new session so the whole tree
can be signalled as one process group. ``as_user`` wraps the command in ``runuser -u USER --``.

The handle records ``pid``, ``pgid`` and the leader's ``start_time`` (psutil ``create_time``), so
:meth:`ProcessRunner.recover` re-attaches only to the very process it started, never to a recycled
pid. A recovered process is not our child: :meth:`wait` then polls psutil and infers the exit code
from the workdir (``result.msgpack`` -> 0, ``error.json`` -> 1, neither -> unknown).

``prefork=True`` (warm fork): a Python task (no ``script``, no ``as_user``) is forked by a long-lived
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

Limits: a process runs unconfined on the host, so ``run_config.resources`` may only name ``gpus``
(nymph assigns the devices through ``CUDA_VISIBLE_DEVICES``); any other field is refused with
:class:`~nymph.resources.ResourceError` (see :mod:`nymph.resources`).

Optional features (:class:`~nymph.runner.Capabilities`): ``reap_orphans`` (nymph is a child
subreaper; the agent calls :meth:`ProcessRunner.reap_orphans`). ``close`` stops the zygotes.
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
from pathlib import Path
from typing import ClassVar

import psutil

from nymph.resources import parse_resources
from nymph.runner import Capabilities, ExitStatus, Handle, RunnerError, RunnerUnavailable, Task
from nymph.runnerkit import ENTRY_MODULE, default_python, handle_workdir, inferred_exit_code, log_tail
from nymph_process.prefork import ForkedChild, ZygoteClient, ZygoteError
from nymph_process.zygote import ENTRY_LOCK

log = logging.getLogger(__name__)

#: run_config.resources fields a local process cannot be held to, with why (see nymph.resources).
UNSUPPORTED_RESOURCES = dict.fromkeys(
    ("cpus", "memory", "pids", "shm"), "a local process runs unconfined on the host"
)
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
_PER_TASK_ENV_KEYS = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)


class ProcessRunner:
    """Runs each invocation as a local process group (one session per invocation)."""

    name: ClassVar[str] = "process"
    capabilities: ClassVar[Capabilities] = Capabilities(
        as_user=True, gpus=True, recover=True, reap_orphans=True
    )

    def __init__(
        self,
        python: str | None = None,
        bash: str = "bash",
        runuser: str = "runuser",
        prefork: bool = PREFORK_DEFAULT,
    ) -> None:
        self.python = python or default_python()
        self.bash = bash
        self.runuser = runuser
        self.prefork = bool(prefork)
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
        become_subreaper()

    # --- lifecycle ------------------------------------------------------------------------------

    def check(self) -> None:
        if not os.access(self.python, os.X_OK):
            raise RunnerUnavailable(f"process runner: python {self.python!r} is not executable; set python=")
        probe = subprocess.run(
            [self.python, "-c", f"import {ENTRY_MODULE}"], capture_output=True, text=True, timeout=60
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

    def start(self, task: Task) -> Handle:
        parse_resources(task.run_config.get("resources"), self.name, unsupported=UNSUPPORTED_RESOURCES)
        if self.prefork and task.script is None and not task.as_user:
            handle = self._start_forked(task)
            if handle is not None:
                return handle
        cmd = [self.bash, "-c", task.script] if task.script is not None else [self.python, "-m", ENTRY_MODULE]
        if task.as_user:
            cmd = [self.runuser, "-u", task.as_user, "--", *cmd]
        env = {k: v for k, v in os.environ.items() if not k.startswith("NYMPH_")}
        env.update(task.env)
        workdir = Path(task.workdir)
        lock: int | None = None
        if task.script is None:  # the entry runs once per workdir: under its lock, inherited below
            lock, holder = self._entry_lock(task)
            if holder is not None:
                return holder
        try:
            with (
                open(workdir / "stdout.log", "ab") as out,
                open(workdir / "stderr.log", "ab") as err,
                self._spawn_lock,
            ):
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
        return Handle(
            runner=self.name,
            invocation_id=task.invocation_id,
            attempt=task.attempt,
            data={"pid": proc.pid, "pgid": proc.pid, "start_time": start_time, "workdir": str(workdir)},
        )

    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None:
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
        while self._leader(handle) is not None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)
        return self._status(handle, self._inferred_code(handle))

    def stop(self, handle: Handle, grace_s: float) -> None:
        pgid = int(handle.data["pgid"])
        if not self._owns_group(handle):
            return
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + max(grace_s, 0.0)
        while time.monotonic() < deadline:
            self._reap(handle)
            if not self._group_members(pgid):
                return
            time.sleep(_POLL_S)
        self._signal_group(pgid, signal.SIGKILL)
        self._wait_group_gone(handle)

    def destroy(self, handle: Handle) -> None:
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
                if child.pid in self._children:
                    continue
                with contextlib.suppress(ChildProcessError, OSError, psutil.Error):
                    if child.status() != psutil.STATUS_ZOMBIE or os.getpgid(child.pid) == own_group:
                        continue
                    if os.waitpid(child.pid, os.WNOHANG)[0] == child.pid:
                        reaped += 1
        return reaped

    def inspect(self, handle: Handle) -> str:
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

    # --- the entry lock -------------------------------------------------------------------------

    def _entry_lock(self, task: Task) -> tuple[int | None, Handle | None]:
        """Take the workdir's entry lock to spawn the entry, or the handle of who already ran it.

        A forked child whose answer was lost holds the lock while it runs (and leaves its pid and
        start time in the file after): that child is the task, adopted like a re-attached process.
        """
        path = Path(task.workdir) / ENTRY_LOCK
        deadline = time.monotonic() + _ZYGOTE_TIMEOUT_S
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
                log.warning(
                    "invocation %s: a zygote child (pid %d) whose fork answer was lost runs the entry; "
                    "adopting it instead of starting it again",
                    task.invocation_id,
                    pid,
                )
                return None, Handle(
                    runner=self.name,
                    invocation_id=task.invocation_id,
                    attempt=task.attempt,
                    data={"pid": pid, "pgid": pid, "start_time": start_time, "workdir": str(task.workdir)},
                )
            if time.monotonic() >= deadline:  # locked, never recorded: a child stuck in between
                raise RunnerError(f"process runner: {path} stays locked by an unknown process")
            time.sleep(_POLL_S)  # a child took the lock and is about to record itself

    # --- warm fork ------------------------------------------------------------------------------

    def _start_forked(self, task: Task) -> Handle | None:
        """Start ``task`` through a zygote; None when prefork cannot serve it (spawn it instead)."""
        env = self._task_env(task)
        workdir = Path(task.workdir)
        for _attempt in range(2):  # a zygote found dead is restarted once for this task
            zygote = self._zygote(env)
            if zygote is None:
                return None
            try:
                child, start_time = zygote.fork(workdir, env, _ZYGOTE_TIMEOUT_S)
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
            return Handle(
                runner=self.name,
                invocation_id=task.invocation_id,
                attempt=task.attempt,
                data={
                    "pid": child.pid,
                    "pgid": child.pid,
                    "start_time": start_time,
                    "workdir": str(workdir),
                },
            )
        return None

    @staticmethod
    def _task_env(task: Task) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NYMPH_")}
        env.update(task.env)
        return env

    def _zygote(self, env: dict[str, str]) -> ZygoteClient | None:
        """The live zygote for this interpreter environment, started if needed; None: spawn instead."""
        key = tuple(
            sorted(
                (k, v)
                for k, v in env.items()
                if k not in _PER_TASK_ENV_KEYS and not k.startswith(_PER_TASK_ENV)
            )
        )
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
            if member.pid in self._children or member.pid in self._forked:
                continue  # Popen (or the zygote) reaps its own child; stealing its status would hide a signal
            with contextlib.suppress(ChildProcessError, OSError, psutil.Error):
                if member.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(member.pid, os.WNOHANG)

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
        return ExitStatus(exit_code=code, reason=reason, logs=log_tail(handle_workdir(handle)))


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
    start_time = ticks / _CLOCK_TICKS + psutil.boot_time() if isinstance(ticks, int) else 0.0
    return int(raw["pid"]), start_time


def _record_entry(fd: int, pid: int) -> None:
    """Say in the entry lock file that ``pid`` runs (ran) the entry: no forked child runs it after."""
    ticks = None
    with contextlib.suppress(psutil.Error):
        ticks = round((psutil.Process(pid).create_time() - psutil.boot_time()) * _CLOCK_TICKS)
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
