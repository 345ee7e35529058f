"""The process runner's warm mode: long-lived worker processes that run many calls each.

Off by default; ``warm = true`` under ``[runner_options]`` (or ``nymph start --warm``) turns it on
for trusted code, where the per-call cost of a fresh process (tens of ms, even forked) dominates a
short call. A warm worker (:mod:`nymph_process.warmworker`) is one interpreter that imports the
function's module once and then runs call after call in itself, over one socket to nymph: the
runner's part of a call is one line each way, about a tenth of a millisecond.

What a warm call is, and what it is not:

- **Only** a Python ``ref`` call with no user to become (``Task.as_user`` unset), or one whose
  user is in ``users`` (a root nymph's task user: its workers start as that user) goes to a warm
  worker. A ``script``, any other ``as_user`` task, and a pickled function (even with
  ``--allow-pickled``) take the cold path (a forked or spawned entry) as before. The worker-side gates run per call, in the worker, as in a cold entry:
  ``--allow-module``, ``src_hash``, the runtime check; nymph's own gates (pickles, modules, scripts,
  users, version pins) ran before the runner was asked.
- A worker is keyed by everything that shapes its interpreter: the environment (less the
  per-call ``LAKESHORE_*`` variables), the GPUs the call was given (a library that initialised
  CUDA on some cannot use others), the interpreter, its user, and the code archives the call
  shipped (``LAKESHORE_CODE_PATH``: one per sha256, so a call with other code never meets a module
  imported from another version). A call finds an idle worker of its key, or a new one is started
  (its interpreter start-up paid once); at most ``workers`` are kept (nymph passes its slot
  count), the idle one used least recently making room. ``max_calls`` recycles a worker after that
  many calls (0: never).
- The workdir contract is the cold path's (args in, result / error / frames / logs out, the
  entry lock), so streams, outputs, refs, acks and the outbox are unchanged, and generators work.
- No isolation between calls: module globals, caches, threads and child processes a call left,
  and memory it grew, stay for the next call of that worker (the environment, cwd, ``sys.path``
  and fd 1/2 are reset). A call that crashes the worker (``os._exit``, a signal, a segfault) fails
  with ``ProcessExited`` and that exit code, like a cold crash; only that call is lost and the
  next call starts a new worker. A cancel or a timeout runs the stop ladder on the **worker**
  (its cgroup, or its process group): the worker dies with the call and is replaced.
- nymph killed mid-call: the worker runs the call to its end (it sees the socket's EOF only between
  calls), then exits; the restarted nymph re-attaches to it by its handle (pid + start time) as to
  any re-attached process and acks what the workdir says. A worker never serves another nymph.

Handles of warm calls are ordinary process handles (``pid``, ``pgid``, ``start_time``: the
worker's) with ``warm`` set to the call's number, so recovery needs nothing of this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import pwd
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from nymph.cgroup import CgroupError, TaskCgroups, spawn_prefix
from nymph.runner import ExitStatus, Task
from nymph.runnerkit import log_tail

log = logging.getLogger(__name__)

WORKER_SCRIPT = str(Path(__file__).resolve().with_name("warmworker.py"))
READY_TIMEOUT_S = 30.0  # a worker's start-up: the interpreter and the entry's imports
EXIT_WAIT_S = 10.0  # after the socket's EOF: the worker's exit status comes this soon
_POLL_S = 0.05
CODE_PATH_ENV = "LAKESHORE_CODE_PATH"
# the devices a call was given: a worker that initialised CUDA on some cannot serve others, so they
# key it (a zygote reads them per child, as a fresh process does)
GPU_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
CGROUP_PREFIX = "nymph-warm-"  # + "<nymph's pid>-<n>": a worker's cgroup, under the task cgroups


class WarmWorker:
    """One warm worker process and nymph's end of its socket; used by one call at a time."""

    def __init__(
        self,
        python: str,
        env: Mapping[str, str],
        key: tuple[Any, ...],
        cgroup: Path | None,
        user: Mapping[str, Any] | None = None,
    ) -> None:
        self.key = key
        self.cgroup = cgroup
        self.calls = 0
        self.busy: int | None = None  # the call in flight, by number
        self.code: int | None = None  # the exit status, once the process ended
        self.used = time.monotonic()
        self.last: tuple[int | None, int, bool] | None = None  # (call, exit code, the worker died)
        self._buf = b""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [python, WORKER_SCRIPT, str(theirs.fileno())]
        if cgroup is not None and user is None:  # every process of the worker is in its cgroup
            cmd = [*spawn_prefix(cgroup), *cmd]
        switch: dict[str, Any] = {}
        env = dict(env)
        if user is not None:  # the task user of a root nymph: dropped to before the interpreter starts
            switch = {
                "user": int(user["uid"]),
                "group": int(user["gid"]),
                "extra_groups": list(user["groups"]),
            }
            env.update(HOME=str(user["home"]), USER=str(user["name"]), LOGNAME=str(user["name"]))
            env["SHELL"] = str(user["shell"])
        try:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                close_fds=True,
                start_new_session=True,  # its own process group: the ladder's killpg reaches it
                **switch,
            )
        except OSError as exc:
            ours.close()
            raise WarmError(f"cannot start a warm worker with {python!r}: {exc}") from exc
        finally:
            theirs.close()
        self.sock = ours
        # poll, not select: nymph's descriptors may pass 1023, which select refuses
        self._readable = select.poll()
        self._readable.register(ours, select.POLLIN)
        self.pid = self.proc.pid
        if cgroup is not None and user is not None:
            # it cannot join a root-owned cgroup itself once it is the task user: moved in by nymph,
            # before it is sent any call (until ready it only imports the entry, and starts nothing)
            try:
                TaskCgroups.procs_file(cgroup).write_text(str(self.pid))
            except OSError as exc:
                self.proc.kill()
                self.proc.wait()
                ours.close()
                raise WarmError(f"cannot move warm worker {self.pid} into {cgroup}: {exc}") from exc
        self.start_time = 0.0
        with contextlib.suppress(psutil.Error):
            self.start_time = psutil.Process(self.pid).create_time()

    def wait_ready(self, timeout: float) -> None:
        msg = self._read(timeout)
        if msg is None or "ready" not in msg:
            self.kill()
            raise WarmError(f"warm worker {self.pid} did not start (exit status {self.code})")

    @property
    def alive(self) -> bool:
        return self.code is None and self.proc.poll() is None

    def send(self, call: int, workdir: Path, env: Mapping[str, str]) -> None:
        line = json.dumps({"id": call, "workdir": str(workdir), "env": dict(env)}).encode() + b"\n"
        self.sock.sendall(line)
        self.busy = call
        self.calls += 1

    def result(self, timeout: float | None) -> bool:
        """True once the call in flight ended (``last`` says how); False while it runs."""
        call = self.busy
        msg = self._read(timeout)
        if msg is not None:
            self.last = (call, int(msg["code"]), False)
        elif self.code is not None:  # the worker died mid-call: its exit status is the call's
            self.last = (call, self.code, True)
        else:
            return False
        self.busy = None
        self.used = time.monotonic()
        return True

    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message; None after ``timeout``, or once the worker is gone (``code`` set)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            if self.code is None and self.sock.fileno() < 0:  # closed here (killed): reap it
                self._ended()
            if self.code is not None:
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._readable.poll(None if left is None else left * 1000):
                return None
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # the worker is gone: its exit status is the call's
                self._ended()
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def _ended(self) -> None:
        try:
            self.code = self.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # closed its socket but lingers: it is of no use now
            self.proc.kill()
            self.code = self.proc.wait()
        with contextlib.suppress(OSError):
            self.sock.close()

    def close(self) -> None:
        """Let the worker go: EOF on its socket (it exits after any call in flight)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def kill(self) -> None:
        """SIGKILL the worker (and, with a cgroup, everything its calls left) and reap it."""
        self.close()
        tree = None if self.cgroup is None else TaskCgroups(self.cgroup.parent)
        if tree is not None and self.cgroup is not None:
            with contextlib.suppress(CgroupError, OSError):
                tree.kill(self.cgroup)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.code = self.proc.wait(EXIT_WAIT_S)
        if tree is not None and self.cgroup is not None:  # a kill is delivered asynchronously
            tree.wait_empty(self.cgroup, EXIT_WAIT_S)


class WarmError(Exception):
    """A warm worker could not serve a call; the runner takes the cold path instead."""


class WarmPool:
    """The warm workers of one process runner, and the calls they run."""

    def __init__(
        self,
        python: str,
        *,
        workers: int = 1,
        max_calls: int = 0,
        cgroups: TaskCgroups | None = None,
        env_key: Callable[[Mapping[str, str]], tuple[tuple[str, str], ...]],
        users: tuple[str, ...] = (),
    ) -> None:
        self.python = python
        # users a warm worker may run as (a root nymph's task user); any other as_user runs cold
        self.users = frozenset(users) if os.geteuid() == 0 else frozenset()
        self.workers = max(1, int(workers))
        self.max_calls = max(0, int(max_calls))
        self.cgroups = cgroups
        self._env_key = env_key
        self._lock = threading.Lock()
        self._idle: list[WarmWorker] = []
        self._by_pid: dict[int, WarmWorker] = {}  # every worker, idle or busy
        self._starting = 0  # workers being started (not yet in _by_pid)
        self._closed = False
        self._inflight: dict[int, WarmWorker] = {}  # call number -> its worker, until destroy
        self._calls = itertools.count(1)
        self._names = itertools.count(1)
        self._sweep()

    # --- which calls go warm ---------------------------------------------------------------------

    def serves(self, task: Task) -> bool:
        """A Python ``ref`` call with no user to become, or as one of ``users`` (a root nymph's
        task user; see the module docstring)."""
        if task.script is not None or (task.as_user and task.as_user not in self.users):
            return False
        resources = (task.run_config or {}).get("resources")
        if isinstance(resources, dict) and ({"memory", "pids"} & set(resources)):
            return False  # a warm worker has no cgroup of its own to hold a limit: the cold path does
        return _ref_call(Path(task.workdir))

    # --- the runner's calls ----------------------------------------------------------------------

    def start(self, task: Task, env: dict[str, str]) -> dict[str, Any] | None:
        """Hand ``task`` to a warm worker: the handle's data; None: take the cold path."""
        key = (
            self.python,
            *self._env_key(env),
            (CODE_PATH_ENV, env.get(CODE_PATH_ENV, "")),
            *((name, env.get(name, "")) for name in GPU_ENV),
            ("user", task.as_user or ""),
        )
        for _attempt in range(2):  # an idle worker found dead is replaced once for this call
            try:
                worker = self._checkout(key, env, task.as_user)
            except WarmError as exc:
                log.warning("invocation %s: %s; running it cold", task.invocation_id, exc)
                return None
            call = next(self._calls)
            try:
                worker.send(call, Path(task.workdir), env)
                with self._lock:
                    self._inflight[call] = worker
            except OSError as exc:
                log.warning("invocation %s: warm worker %d: %s", task.invocation_id, worker.pid, exc)
                self._retire(worker, kill=True)
                continue
            data: dict[str, Any] = {
                "pid": worker.pid,
                "pgid": worker.pid,
                "start_time": worker.start_time,
                "warm": call,
            }
            if worker.cgroup is not None:
                data["cgroup"] = str(worker.cgroup)
            log.debug("invocation %s: warm call %d in worker %d", task.invocation_id, call, worker.pid)
            return data
        return None

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is a warm worker of this pool (its exit status is the pool's to reap)."""
        return pid in self._by_pid

    def running(self, data: Mapping[str, Any]) -> WarmWorker | None:
        """The worker of a handle's warm call, until its ``destroy``; None: not this pool's (a
        previous life's call, watched like any re-attached process)."""
        call = data.get("warm")
        worker = self._inflight.get(call) if isinstance(call, int) else None
        if worker is None or worker.pid != int(data["pid"]):
            return None
        return worker

    def wait(
        self, worker: WarmWorker, call: int, timeout: float | None, workdir: Path | None
    ) -> ExitStatus | None:
        if worker.busy == call and not worker.result(timeout):
            return None
        last = worker.last
        if last is None or last[0] != call:  # not reached: a call ends before the next is sent
            return ExitStatus(exit_code=-1, reason="the warm call's outcome is unknown")
        _, code, died = last
        reason = f"signal {-code}" if code < 0 else None
        if died:
            reason = f"the warm worker {worker.pid} died mid-call: {reason or f'exit code {code}'}"
        return ExitStatus(exit_code=code, reason=reason, logs=log_tail(workdir) if code else None)

    def stop(self, worker: WarmWorker, call: int, grace_s: float) -> None:
        """The ladder on the worker that runs the call: SIGTERM, ``grace_s``, SIGKILL. The worker
        dies with the call (its exit status is the call's); the pool replaces it."""
        if worker.busy != call or not worker.alive:
            return
        if worker.cgroup is not None and self.cgroups is not None:
            self.cgroups.signal(worker.cgroup, signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + max(grace_s, 0.0)
        while worker.alive and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        worker.kill()
        worker.result(EXIT_WAIT_S)  # reads the EOF: the worker's exit status becomes the call's

    def done(self, worker: WarmWorker, call: int) -> None:
        """The runner's ``destroy`` of a warm call: an idle live worker goes back to the pool (or
        is recycled after ``max_calls``); one that died, or still runs the call, is killed."""
        with self._lock:
            if self._inflight.get(call) is not worker:
                return  # destroyed already
            del self._inflight[call]
        if worker.busy is not None or not worker.alive:  # mid-call (a stop that did not finish) or dead
            self._retire(worker, kill=True)
            return
        self._kill_leftovers(worker)
        if self._closed:
            self._retire(worker, kill=False)
        elif self.max_calls and worker.calls >= self.max_calls:
            log.info("warm worker %d: recycled after %d calls", worker.pid, worker.calls)
            self._forget(worker)
            worker.close()  # it exits at once; reaped aside, so this call's ack does not wait for it
            threading.Thread(
                target=self._reap, args=(worker,), name=f"warm-{worker.pid}", daemon=True
            ).start()
        else:
            with self._lock:
                if worker.pid in self._by_pid:
                    self._idle.append(worker)

    def close(self) -> None:
        """At nymph's shutdown: every worker gets EOF. An idle one exits now; a call in flight runs
        to its end and is still waited for (its answer still comes), then its worker exits."""
        with self._lock:
            self._closed = True
            idle = [w for w in self._by_pid.values() if w.busy is None]
            busy = [w for w in self._by_pid.values() if w.busy is not None]
            self._idle.clear()
            for worker in idle:
                del self._by_pid[worker.pid]
        for worker in busy:
            with contextlib.suppress(OSError):
                worker.sock.shutdown(socket.SHUT_WR)  # EOF for it; its answer can still be read
        for worker in idle:
            worker.close()
            self._reap(worker)

    def _kill_leftovers(self, worker: WarmWorker) -> None:
        """Kill the processes the call left in the worker's cgroup (every one but the worker: it
        starts none outside its calls), so a call's descendants die with it, as a cold task's do.
        Without a cgroup they are left (the process-group fallback cannot tell them apart cheaply)."""
        if worker.cgroup is None or self.cgroups is None:
            return
        left = [pid for pid in TaskCgroups.members(worker.cgroup) if pid != worker.pid]
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if left:
            log.info("warm worker %d: killed %d process(es) its call left running", worker.pid, len(left))
            deadline = time.monotonic() + EXIT_WAIT_S
            while time.monotonic() < deadline and any(
                p != worker.pid for p in TaskCgroups.members(worker.cgroup)
            ):
                time.sleep(0.01)

    # --- the pool --------------------------------------------------------------------------------

    def _checkout(self, key: tuple[Any, ...], env: Mapping[str, str], as_user: str | None) -> WarmWorker:
        evict: list[WarmWorker] = []
        with self._lock:
            if self._closed:
                raise WarmError("the runner is closed")
            for worker in reversed(self._idle):  # the most recently used first: its caches are warm
                if worker.key == key:
                    self._idle.remove(worker)
                    if worker.alive:
                        worker.busy = -1  # reserved until its call is sent
                        return worker
                    evict.append(worker)
                    break
            while len(self._by_pid) - len(evict) >= self.workers and self._idle:
                oldest = min(self._idle, key=lambda w: w.used)  # makes room for this key
                self._idle.remove(oldest)
                evict.append(oldest)
            full = len(self._by_pid) + self._starting - len(evict) >= self.workers
            if not full:
                self._starting += 1  # counted from now on: two calls never both take the last place
        for worker in evict:
            self._retire(worker, kill=not worker.alive)
        if full:
            raise WarmError(f"all {self.workers} warm workers are busy")
        try:
            cgroup = self._new_cgroup()
            try:
                user = _user_record(as_user) if as_user else None
                worker = WarmWorker(self.python, env, key, cgroup, user)
                worker.wait_ready(READY_TIMEOUT_S)
            except BaseException:
                if cgroup is not None and self.cgroups is not None:
                    self.cgroups.remove(cgroup)
                raise
            worker.busy = -1  # reserved until its call is sent
            with self._lock:
                self._by_pid[worker.pid] = worker
        finally:
            with self._lock:
                self._starting -= 1
        log.info("warm worker %d started (%d kept)", worker.pid, len(self._by_pid))
        return worker

    def _sweep(self) -> None:
        """Remove the empty worker cgroups of nymphs that are gone (a nymph killed while its
        workers were idle: they exited, their cgroups stayed). A populated one is a previous
        life's worker still running a call: its handle's ``destroy`` removes it."""
        if self.cgroups is None:
            return
        with contextlib.suppress(OSError):
            for path in self.cgroups.base.glob(f"{CGROUP_PREFIX}*"):
                owner = path.name[len(CGROUP_PREFIX) :].partition("-")[0]
                if owner.isdigit() and not psutil.pid_exists(int(owner)) and not TaskCgroups.populated(path):
                    with contextlib.suppress(OSError, CgroupError):
                        path.rmdir()

    def _new_cgroup(self) -> Path | None:
        if self.cgroups is None:
            return None
        try:
            return self.cgroups.create(f"{CGROUP_PREFIX}{os.getpid()}-{next(self._names)}")
        except CgroupError as exc:
            log.warning("warm worker: %s; tracked by its process group", exc)
            return None

    def _forget(self, worker: WarmWorker) -> None:
        with self._lock:
            self._by_pid.pop(worker.pid, None)
            if worker in self._idle:
                self._idle.remove(worker)

    def _retire(self, worker: WarmWorker, *, kill: bool) -> None:
        self._forget(worker)
        if kill:
            worker.kill()
        else:
            worker.close()
        self._reap(worker)

    def _reap(self, worker: WarmWorker) -> None:
        """Wait for the worker's exit (it was told to go) and remove its cgroup."""
        if worker.code is None:
            try:
                worker.code = worker.proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                worker.kill()
        if worker.cgroup is not None and self.cgroups is not None:
            self.cgroups.remove(worker.cgroup)


def passwd_record(name: str) -> dict[str, Any]:
    """What a process needs to become ``name`` (a warm worker, the zygote's child): uid, gid,
    groups, home, shell and name. KeyError for a user this host does not have."""
    pw = pwd.getpwnam(name)
    return {
        "name": pw.pw_name,
        "uid": pw.pw_uid,
        "gid": pw.pw_gid,
        "groups": os.getgrouplist(pw.pw_name, pw.pw_gid),
        "home": pw.pw_dir,
        "shell": pw.pw_shell,
    }


def _user_record(name: str) -> dict[str, Any]:
    """``passwd_record`` of the user a warm worker runs as, or a WarmError that names it."""
    try:
        return passwd_record(name)
    except KeyError:
        raise WarmError(f"user {name!r} is not a user on this host") from None


def call_over(workdir: Path) -> bool:
    """Whether the warm call of ``workdir`` ended: its entry lock was taken and recorded (a
    worker ran it), and is free again. For a previous life's warm call, whose worker may live on
    after it (it exits only once its old socket is closed and its call is done)."""
    from nymph import safeio
    from nymph_process.zygote import ENTRY_LOCK

    try:
        fd = safeio.open_fd(workdir, ENTRY_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size == 0:
            return False  # not yet taken (a worker never takes a recorded lock again)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held: the call runs
        return False
    finally:
        os.close(fd)
    return True


def _ref_call(workdir: Path) -> bool:
    """Whether the workdir's ``args.msgpack`` calls a function by reference (not a pickle)."""
    from dreamlake.lakeshore.envelope import is_pickled
    from nymph import refs

    try:
        fn = refs.header_of(workdir / "args.msgpack").get("fn") or {}
    except Exception:  # a bad envelope: the cold entry reports it as it always does
        return False
    return not is_pickled(fn) and fn.get("kind", "ref") == "ref"
