"""Every process a pool user left behind, killed before that user runs another tenant's task.

A task of the process runner runs in a cgroup of its own, killed whole when it ends (:mod:`nymph.cgroup`).
But a user of the task user pool (:mod:`nymph.taskuser`) also runs things outside one: the pip
environment's build (``uv`` and the build backend a producer chose, :mod:`nymph.envcache`), and on a
host without task cgroups the task itself. A process left there (a double-forked ``setsid`` daemon)
keeps the uid, and the next task leased that uid belongs to another tenant: the daemon could read its
workdir and ``task.token``, its ``/proc/PID/environ``, signal it. So :func:`reap` kills every process
of the uid before :class:`~nymph.taskuser.TaskUsers` hands the user out again (at release, and before
this nymph leases it for the first time):

- **find**: one pass over ``/proc``: a process whose real, effective, saved or filesystem uid is the
  user's, zombies aside (nothing to kill: their parent reaps them). None: done, nothing forked (the
  common case: the task's cgroup was killed before the release; about 10 us a process on the host).
- **kill at once**: a helper process forked from nymph drops to the uid (``setgroups([])``,
  ``setresgid``, ``setresuid``: no privilege left) and calls ``kill(-1, SIGKILL)``, which signals
  every process that uid may signal, all of its own but the helper, in one pass the kernel makes
  under its task list lock: a process forking meanwhile leaves no child behind (a fork that meets a
  pending SIGKILL fails). Then root SIGKILLs, through a pidfd, whatever the next pass still finds (a
  process of the uid may kill the helper before it signals). Repeated until a pass finds none, at most
  :data:`REAP_LIMIT_S`; what is left then is returned (the caller keeps the user out of the pool).
- **spared**: a process inside a task cgroup (``.../nymph-tasks/<task>``, owned by root: a task user
  cannot make one, nor move into one) is a live task's. With one nymph per pool there is none of the
  uid being released (its task's cgroup is gone); two nymphs on one host that share a pool (the same
  ``--task-user``: their tasks then share uids, no boundary between them) do not kill each other's
  running tasks with every release, only when a stray process exists (``kill(-1)`` spares nothing).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from nymph.cgroup import TASKS_DIR, cgroup2_mount

log = logging.getLogger(__name__)

REAP_LIMIT_S = 3.0  # the most one reap takes (a process stuck in the kernel, a killer of the helper)
_PAUSE_S = 0.01  # between passes: the killed processes exit
_MOUNT: list[Path | None] = []  # the cgroup2 mount, looked up once


def reap(uid: int, gid: int, limit_s: float = REAP_LIMIT_S) -> list[int]:
    """Kill every process of ``uid`` outside the task cgroups (see the module docstring); the pids
    still there after ``limit_s`` (empty: none left). Never for uid 0. Raises nothing but a bug."""
    if uid == 0:
        raise ValueError("refusing to reap uid 0")
    left = strays(uid)
    if not left:
        return []
    found = len(left)
    deadline = time.monotonic() + limit_s
    while left:
        _kill_as(uid, gid)
        time.sleep(_PAUSE_S)
        for pid in strays(uid):  # a process that killed the helper first (or forked before it)
            _kill_pid(pid, uid)
        left = strays(uid)
        if left and time.monotonic() >= deadline:
            log.error(
                "uid %d: %d process(es) left after %.1fs of SIGKILL: %s",
                uid, len(left), limit_s, " ".join(map(str, left[:20])),
            )  # fmt: skip
            return left
        if left:
            time.sleep(_PAUSE_S)
    log.warning("uid %d: killed %d process(es) it left outside a task's cgroup", uid, found)
    return []


def strays(uid: int) -> list[int]:
    """The live processes of ``uid`` (any of its uids) that are in no task cgroup."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        status = _status(entry.name)
        if status is None or not _of(status, uid):
            continue
        if not _in_task_cgroup(entry.name):
            out.append(int(entry.name))
    return out


def live(uid: int) -> bool:
    """Whether a process of ``uid`` (any of its uids) lives, one in a task cgroup included."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            status = _status(entry.name)
            if status is not None and _of(status, uid):
                return True
    return False


def _status(pid: str) -> bytes | None:
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _of(status: bytes, uid: int) -> bool:
    """Whether the ``/proc/PID/status`` text is of a live (not zombie) process with ``uid`` among its uids."""
    at = status.find(b"\nUid:")
    if at < 0 or str(uid).encode() not in status[at + 5 : status.find(b"\n", at + 5)].split():
        return False
    at = status.find(b"\nState:")
    state = status[at + 7 : at + 12].split()[:1] if at >= 0 else []
    return state not in ([b"Z"], [b"X"])


def _in_task_cgroup(pid: str) -> bool:
    """Whether the process is in a task cgroup: ``.../nymph-tasks/<task>`` of cgroup v2, owned by root."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as fh:
            lines = fh.read().split(b"\n")
    except OSError:
        return False
    path = next((line[3:].decode("utf-8", "replace") for line in lines if line.startswith(b"0::")), "")
    parts = path.strip("/").split("/")
    if len(parts) < 2 or parts[-2] != TASKS_DIR:
        return False
    if not _MOUNT:
        _MOUNT.append(cgroup2_mount())
    mount = _MOUNT[0]
    if mount is None:
        return False
    try:
        return os.lstat(mount.joinpath(*parts)).st_uid == 0  # not one a delegated subtree's user made
    except OSError:
        return False


def _kill_as(uid: int, gid: int) -> None:
    """Fork a helper that becomes ``uid`` and nothing else, and ``kill(-1, SIGKILL)``; wait for it."""
    pid = os.fork()
    if pid == 0:  # the child: system calls only, then _exit (no lock, no log, no atexit)
        code = 1
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)  # every process of uid, but this one
            code = 0
        finally:
            os._exit(code)
    with contextlib.suppress(ChildProcessError):
        _, status = os.waitpid(pid, 0)
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            log.warning("uid %d: the helper that kills its processes ended with status %#x", uid, status)


def _kill_pid(pid: int, uid: int) -> None:
    """SIGKILL ``pid`` as root if it still is a process of ``uid`` (a pidfd: never a pid reused meanwhile)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        status = _status(str(pid))  # read after the pidfd pins the process: its own, not a successor's
        if status is not None and _of(status, uid):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)
