"""Never twice in one workdir: the process runner's side of the workdir's entry lock.

A Python entry runs only under the workdir's entry lock (``flock`` on ``.entry.lock``, which
records who ran it: :mod:`nymph_process.zygote`). A forked child takes it before it runs the
entry; a spawned entry inherits it from the runner, which takes it before spawning (:func:`take`)
and records the entry's pid in it (:func:`record`). When a zygote got a fork request but its
answer never came (a timeout, the zygote died), the runner does not ask a zygote again: it takes
the lock and spawns, or, when a child got there first (the lock is held, or the file says an entry
already ran), adopts that child like a re-attached process. The same lock makes ``start``
idempotent under retry: a second start of a Python task finds the entry the first one started and
adopts it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path

import psutil

from nymph import safeio
from nymph.runner import RunnerError
from nymph_process.prefork import boot_time, start_time_of
from nymph_process.zygote import ENTRY_LOCK

log = logging.getLogger(__name__)

_POLL_S = 0.05
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def take(workdir: Path, invocation_id: str, patience_s: float) -> tuple[int | None, tuple[int, float] | None]:
    """Take the workdir's entry lock to spawn the entry -> ``(its fd, None)``, or ``(None, (pid,
    start_time))`` of who already ran it.

    A forked child whose answer was lost holds the lock while it runs (and leaves its pid and
    start time in the file after): that child is the task, adopted like a re-attached process,
    provided it runs as the workdir's owner (the file is in the task's reach, so what it names
    is never trusted further than the task itself). A lock held but never recorded is waited for
    ``patience_s`` (a child took it and is about to record itself).
    """
    path = workdir / ENTRY_LOCK
    deadline = time.monotonic() + patience_s
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
        found = holder(fd)
        if locked and found is None:
            return fd, None
        os.close(fd)
        if found is not None:
            pid, _start_time = found
            if not runs_as_owner(pid, workdir):
                raise RunnerError(
                    f"process runner: {path} names pid {pid}, which does not run as the "
                    "workdir's owner; not adopted"
                )
            log.warning(
                "invocation %s: a zygote child (pid %d) whose fork answer was lost runs the entry; "
                "adopting it instead of starting it again",
                invocation_id,
                pid,
            )
            return None, found
        if time.monotonic() >= deadline:  # locked, never recorded: a child stuck in between
            raise RunnerError(f"process runner: {path} stays locked by an unknown process")
        time.sleep(_POLL_S)  # a child took the lock and is about to record itself


def holder(fd: int) -> tuple[int, float] | None:
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


def record(fd: int, pid: int) -> None:
    """Say in the entry lock file that ``pid`` runs (ran) the entry: no forked child runs it after."""
    ticks = None
    with contextlib.suppress(psutil.Error):
        ticks = round((psutil.Process(pid).create_time() - boot_time()) * _CLOCK_TICKS)
    with contextlib.suppress(OSError):
        os.write(fd, json.dumps({"pid": pid, "ticks": ticks}).encode())


def runs_as_owner(pid: int, workdir: Path) -> bool:
    """True when process ``pid`` runs as the owner of ``workdir`` (or as nymph's own user)."""
    try:
        uid = psutil.Process(pid).uids().real
        return uid in (workdir.stat().st_uid, os.geteuid())
    except (psutil.Error, OSError):
        return False
