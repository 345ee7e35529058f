"""What a pool user left outside its workdir, removed before that user runs another tenant's task.

A task's workdir is its uid's alone (0700), and a failed call's kept one is taken back from the uid
(:func:`nymph.workdir.seal`). But a task may also write where every user may: ``/tmp``, a POSIX
shared memory object in ``/dev/shm``, a SysV shared memory segment. What it leaves there is its
uid's, and the next task leased that uid of the task user pool (:mod:`nymph.taskuser`) belongs to
another tenant, who owns it too: tenant A's task writes ``/tmp/model-key``, tenant B's task reads
it. So :func:`sweep` removes it at the points :mod:`nymph.uidreap` kills the uid's processes (at
release, and before this nymph leases the uid for the first time), once those are dead (no process
of the uid writes meanwhile, nor holds a directory open):

- **files**: each entry at the top level of :data:`SHARED_DIRS` (those present: ``/dev/mqueue``
  holds the POSIX message queues where it is mounted; where it is not, they are out of reach) and
  of ``/run/user/<uid>`` whose owner (``lstat``) is the uid: a directory with everything under it
  (``shutil.rmtree`` on the parent's fd: no link followed, nothing outside the tree reached),
  anything else unlinked (a symlink: the link, never its target). Inside them, a directory someone
  else owns that every user may write to (another user's ``/tmp/shared`` of mode 1777) is walked
  the same way, as the uid may have left entries there too: down to :data:`NESTED_DEPTH` levels,
  each opened by its parent's fd without following a link, and at most :data:`NESTED_ENTRIES`
  entries looked at per place (a warning says when that stopped the walk). The uid's entries in a
  directory it could not write to as "other" (a service's ``/tmp/systemd-private-*``, 0700; a
  group-writable one) are out of reach, and so are its files anywhere else (a world-writable directory elsewhere):
  only the well-known shared places are walked, one ``scandir`` per directory (a ``stat`` per
  entry).
- **SysV IPC**: each shared memory segment, semaphore array and message queue (``/proc/sysvipc``)
  whose owner or creator is the uid, removed with ``IPC_RMID`` through libc (``ctypes``: no
  ``ipcrm`` per object). Those of nymph's IPC namespace, which process-runner tasks share. A
  segment still attached (by a process of another uid) goes once that detaches, as the kernel does.
- **spared**: when a process of the uid still runs after the reap, it is in a task cgroup: a live
  task of another nymph that shares the pool (the same ``--task-user``, no boundary between its
  tasks anyway). Nothing is removed then (its files are in use), and a warning says so.

A removal that fails is logged and skipped; it does not keep the user from the pool, as a process
left running does (:mod:`nymph.uidreap`): a file cannot act, and the next release tries again.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import stat
from pathlib import Path

from nymph import uidreap

log = logging.getLogger(__name__)

# The world-writable (sticky) directories whose top level is swept; a test points it at a scratch dir.
SHARED_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")
RUN_USER = "/run/user"  # /run/user/<uid>: the uid's runtime directory, if a login made one
SYSVIPC = "/proc/sysvipc"
_IPC_RMID = 0
_SHM_DEST = 0o1000  # a segment already removed, waiting for its last detach
_IPC = (("shm", "shm segment(s)"), ("sem", "semaphore array(s)"), ("msg", "message queue(s)"))
_LIBC: list[ctypes.CDLL] = []
NESTED_DEPTH = 4  # world-writable directories of others inside a shared place: walked this deep
NESTED_ENTRIES = 20_000  # entries looked at under one shared place, at most
_SUBDIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def sweep(uid: int) -> dict[str, int]:
    """Remove what ``uid`` left in the shared places (see the module docstring); how many were
    removed, by place or kind. Never for uid 0. Raises nothing but that."""
    if uid == 0:
        raise ValueError("refusing to sweep uid 0")
    removed: dict[str, int] = {}
    try:
        if uidreap.live(uid):
            log.warning(
                "uid %d: a process of it runs in a task cgroup (a nymph that shares the pool): its "
                "files in %s and its SysV IPC objects are not removed", uid, ", ".join(SHARED_DIRS),
            )  # fmt: skip
            return removed
        for place in (*SHARED_DIRS, os.path.join(RUN_USER, str(uid))):
            removed[place] = _sweep_dir(place, uid)
        for kind, label in _IPC:
            removed[label] = _sweep_ipc(kind, uid)
    except Exception:
        log.exception("uid %d: removing what it left outside its workdir failed", uid)
    done = [f"{n} in {what}" if what.startswith("/") else f"{n} {what}" for what, n in removed.items() if n]
    if done:
        log.warning("uid %d: removed what it left outside its workdir: %s", uid, ", ".join(done))
    return removed


def _sweep_dir(path: str, uid: int) -> int:
    """Remove the entries of ``uid`` in the directory ``path`` and in the world-writable
    directories of others under it (see the module docstring); how many went."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # not on this host (no /dev/mqueue, no /run/user/<uid>)
        return 0
    budget = [NESTED_ENTRIES]
    try:
        count = _sweep_fd(fd, path, uid, 0, budget)
    finally:
        os.close(fd)
    if budget[0] < 0:
        log.warning(
            "uid %d: stopped looking under %s after %d entries; what it left deeper may remain",
            uid, path, NESTED_ENTRIES,
        )  # fmt: skip
    return count


def _sweep_fd(fd: int, path: str, uid: int, depth: int, budget: list[int]) -> int:
    """``_sweep_dir``'s walk of the directory ``fd`` (named ``path`` in messages)."""
    count = 0
    with os.scandir(fd) as entries:
        for entry in entries:
            budget[0] -= 1
            if budget[0] < 0:
                break
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile
            if st.st_uid != uid:
                if depth < NESTED_DEPTH and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
                    try:  # not a link (O_NOFOLLOW): swapped for one meanwhile, it is skipped
                        sub = os.open(entry.name, _SUBDIR, dir_fd=fd)
                    except OSError:
                        continue
                    try:
                        count += _sweep_fd(sub, os.path.join(path, entry.name), uid, depth + 1, budget)
                    finally:
                        os.close(sub)
                continue
            if _remove(fd, entry.name, st):
                count += 1
            else:
                log.warning("uid %d: could not remove all of %s it left", uid, os.path.join(path, entry.name))
    return count


def _remove(fd: int, name: str, st: os.stat_result) -> bool:
    """Remove ``name`` in the directory ``fd`` (a directory: all of it, no link followed); whether it went."""
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, ignore_errors=True, dir_fd=fd)
    else:
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return True
        except OSError:
            return False
    try:
        os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return False


def ipc_ids(kind: str, uid: int) -> list[int]:
    """The ids of the SysV IPC objects of ``kind`` (``shm``, ``sem``, ``msg``) that ``uid`` owns or
    created, those already removed aside (a segment still attached)."""
    try:
        lines = Path(SYSVIPC, kind).read_text().splitlines()
    except OSError:
        return []
    if not lines:
        return []
    head = lines[0].split()
    at_uid, at_cuid, at_perms = head.index("uid"), head.index("cuid"), head.index("perms")
    out = []
    for line in lines[1:]:
        fields = line.split()
        if len(fields) != len(head) or str(uid) not in (fields[at_uid], fields[at_cuid]):
            continue
        if kind == "shm" and int(fields[at_perms], 8) & _SHM_DEST:
            continue
        out.append(int(fields[1]))
    return out


def _sweep_ipc(kind: str, uid: int) -> int:
    """``IPC_RMID`` each object of ``kind`` that ``uid`` owns or created; how many went."""
    ids = ipc_ids(kind, uid)
    count = 0
    for ident in ids:
        if _rmid(kind, ident) == 0:
            count += 1
            continue
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.EIDRM):  # not gone meanwhile
            log.warning("uid %d: could not remove its SysV %s %d: %s", uid, kind, ident, os.strerror(err))
    return count


def _rmid(kind: str, ident: int) -> int:
    """``shmctl`` / ``semctl`` / ``msgctl(ident, IPC_RMID)`` through libc: 0, or -1 and errno."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    libc = _LIBC[0]
    if kind == "sem":
        return int(libc.semctl(ctypes.c_int(ident), ctypes.c_int(0), ctypes.c_int(_IPC_RMID)))
    ctl = libc.shmctl if kind == "shm" else libc.msgctl
    return int(ctl(ctypes.c_int(ident), ctypes.c_int(_IPC_RMID), ctypes.c_void_p(None)))
