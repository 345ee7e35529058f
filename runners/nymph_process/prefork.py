"""nymph's side of the warm-fork server (:mod:`nymph_process.zygote`).

:class:`ZygoteClient` starts one zygote (``python zygote.py FD``, a process of its own, so it is
single-threaded and safe to fork even though nymph has threads), sends it fork requests and reads its
answers on a reader thread: the pid of each child, and later that child's exit code (only the zygote,
the child's parent, can reap it). If the zygote dies, every child still running is marked orphaned
(its exit code unknown: the runner then watches it like a re-attached process) and the client is
dead; the runner starts another or spawns the entry the normal way.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

ZYGOTE_SCRIPT = str(Path(__file__).resolve().with_name("zygote.py"))
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_BOOT_TIME_TTL_S = 1.0
_boot_time: tuple[float, float] = (-_BOOT_TIME_TTL_S, 0.0)  # (monotonic when read, psutil.boot_time())


def boot_time() -> float:
    """``psutil.boot_time()``, read from ``/proc/stat`` at most once a second (not once per fork).

    Cached only briefly: the value follows the wall clock (a step of it moves the boot time), and
    start times computed with it are compared with psutil's own ``create_time`` later."""
    global _boot_time
    now = time.monotonic()
    read_at, value = _boot_time
    if now - read_at >= _BOOT_TIME_TTL_S:
        value = psutil.boot_time()
        _boot_time = (now, value)
    return value


def start_time_of(ticks: int) -> float:
    """A process's start time (psutil ``create_time``) from its start in clock ticks after boot."""
    return ticks / _CLOCK_TICKS + boot_time()


class ZygoteError(Exception):
    """The zygote could not fork this task (dead, not ready, refused); spawn it the normal way.

    ``maybe_forked``: the request reached the zygote and no answer came back (a timeout, the zygote
    died), so a child may exist and run the entry; the runner must then go through the workdir's
    entry lock (:data:`nymph_process.zygote.ENTRY_LOCK`) and never ask a zygote again for this task.
    """

    def __init__(self, message: str, *, maybe_forked: bool = False) -> None:
        super().__init__(message)
        self.maybe_forked = maybe_forked


class ForkedChild:
    """A child of the zygote: ``done`` is set once it exited (``code``) or the zygote died (``code`` None).

    :meth:`exit_fd` is the same news as an fd (a pipe written when ``done`` is set), for a loop
    that waits on many with ``epoll`` (:mod:`nymph.supervisor`) instead of a thread on each."""

    __slots__ = ("_lock", "_pipe", "code", "done", "pid")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.code: int | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None

    def finish(self, code: int | None) -> None:
        """The child exited with ``code`` (None: unknown, the zygote died): set ``done``, write the fd."""
        with self._lock:
            if code is not None:
                self.code = code
            self.done.set()
            if self._pipe is not None:
                with contextlib.suppress(OSError):
                    os.write(self._pipe[1], b"x")

    def exit_fd(self) -> int:
        """An fd readable once ``done`` is set (made on the first call; closed by :meth:`close`)."""
        with self._lock:
            if self._pipe is None:
                self._pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                if self.done.is_set():
                    os.write(self._pipe[1], b"x")
            return self._pipe[0]

    def close(self) -> None:
        with self._lock:
            pipe, self._pipe = self._pipe, None
        for fd in pipe or ():
            with contextlib.suppress(OSError):
                os.close(fd)


class ZygoteClient:
    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        self.python = python
        self.env = dict(env)
        self.children: dict[int, ForkedChild] = {}
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._lock = threading.Lock()  # sends, pending replies, children
        self._pending: dict[int, tuple[threading.Event, dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [python, ZYGOTE_SCRIPT, str(theirs.fileno())],
                env=self.env,
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                close_fds=True,
            )
        except OSError as exc:
            ours.close()
            raise ZygoteError(f"cannot start the zygote with {python!r}: {exc}") from exc
        finally:
            theirs.close()
        self.sock = ours
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name=f"zygote-{self.pid}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._dead.is_set()

    @property
    def idle(self) -> bool:
        """No fork request unanswered and every child it forked ended: closing it orphans nothing."""
        with self._lock:
            return not self._pending and all(c.done.is_set() for c in self.children.values())

    def wait_ready(self, timeout: float) -> bool:
        self._ready.wait(timeout)
        return self._ready.is_set() and self.alive

    def fork(
        self,
        workdir: Path,
        env: Mapping[str, str],
        timeout: float,
        *,
        cgroup: str | None = None,
        user: Mapping[str, Any] | None = None,
    ) -> tuple[ForkedChild, float]:
        """Fork a child for ``workdir``; returns it and its start time (psutil ``create_time``).

        ``cgroup``: the ``cgroup.procs`` file the child joins before anything else; ``user``: who
        it becomes before it runs the entry (``uid``, ``gid``, ``groups``, ``name``, ``home``).
        The child reads the arguments from the workdir's ``args.msgpack``: they never pass through
        the zygote, whose memory every later child inherits.
        """
        if not self.wait_ready(timeout):
            raise ZygoteError("the zygote is not ready" if self.alive else "the zygote is dead")
        req_id = next(self._ids)
        event = threading.Event()
        reply: dict[str, Any] = {}
        req: dict[str, Any] = {"id": req_id, "workdir": str(workdir), "cgroup": cgroup, "user": user}
        if all(k in env for k in self.env):  # the zygote's own environment plus the task's variables
            req["env_update"] = {k: v for k, v in env.items() if self.env.get(k) != v}
        else:
            req["env"] = dict(env)
        line = json.dumps(req).encode() + b"\n"
        with self._lock:
            if self._dead.is_set():
                raise ZygoteError("the zygote is dead")
            self._pending[req_id] = (event, reply)
            try:
                self.sock.sendall(line)
            except OSError as exc:
                self._pending.pop(req_id, None)
                raise ZygoteError(f"cannot reach the zygote: {exc}") from exc
        if not event.wait(timeout):
            with self._lock:
                self._pending.pop(req_id, None)
            self.close()  # a hung zygote is no use; what it forked (if anything) carries on orphaned
            raise ZygoteError(f"the zygote did not answer within {timeout:g} s", maybe_forked=True)
        if "pid" not in reply:
            if "error" in reply:  # the zygote's fork() failed: no child
                raise ZygoteError(str(reply["error"]))
            raise ZygoteError("the zygote died before answering", maybe_forked=True)
        pid = int(reply["pid"])
        with self._lock:
            child = self.children[pid]
        ticks = reply.get("ticks")
        start_time = 0.0
        if isinstance(ticks, int):
            start_time = start_time_of(ticks)  # as psutil computes create_time
        return child, start_time

    def forget(self, pid: int) -> None:
        with self._lock:
            child = self.children.pop(pid, None)
        if child is not None:
            child.close()

    def close(self) -> None:
        """Stop the zygote (its children carry on) and reap it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(5.0)
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    # --- reader thread --------------------------------------------------------------------------

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._dispatch(json.loads(line))
        except (OSError, ValueError) as exc:
            log.warning("zygote %d: %s", self.pid, exc)
        finally:
            self._died()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "exit" in msg:
            with self._lock:
                child = self.children.get(int(msg["exit"]))
            if child is not None:
                child.finish(int(msg["code"]))
        elif "id" in msg:
            with self._lock:
                if "pid" in msg:
                    pid = int(msg["pid"])
                    self.children[pid] = ForkedChild(pid)
                waiter = self._pending.pop(int(msg["id"]), None)
            if waiter is not None:
                waiter[1].update(msg)
                waiter[0].set()
        elif "ready" in msg:
            self._ready.set()

    def _died(self) -> None:
        with self._lock:
            self._dead.set()
            pending = list(self._pending.values())
            self._pending.clear()
            orphans = [c for c in self.children.values() if not c.done.is_set()]
        for event, _reply in pending:
            event.set()
        for child in orphans:  # exit code unknown from now on: the runner watches them via psutil
            child.finish(None)
        self._ready.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)  # reap the zygote itself
        if self.proc.returncode not in (0, None):
            log.warning("zygote %d exited with status %s", self.pid, self.proc.returncode)
