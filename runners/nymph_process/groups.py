"""Processes of the process runner's tasks: leaders, process groups and the fallback's strays.

Every task runs in a session (and process group) of its own. Where task cgroups cannot be used
(``nymph doctor`` says why) the runner tracks a task by its process group, plus its strays: nymph
is a child subreaper (:func:`become_subreaper`), so descendants that left the group and were
orphaned become nymph's children, and those carrying the task's ``LAKESHORE_TASK`` marker are
signalled too (:func:`strays`; best effort: a descendant that cleared its environment, or one
orphaned while nymph was down, is missed). A leader is only ever the very process the runner
started, verified by its start time (:func:`leader`), never a recycled pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading
import time
from collections.abc import Callable

import psutil

from nymph.runner import Handle

POLL_S = 0.05
_START_TIME_SLACK_S = 0.01
_PR_SET_CHILD_SUBREAPER = 36
TASK_MARKER_ENV = "LAKESHORE_TASK"  # nymph-<id>-a<attempt>: how the fallback finds strays


def become_subreaper() -> None:
    """Adopt orphaned descendants (Linux prctl), so every process a task forks can be reaped.

    Without it a grandchild killed after its parent exited is reparented to PID 1, which on some
    hosts (containers, micro-VMs) never reaps, and lingers as a zombie.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def pidfd_ready(fd: int | None, timeout: float | None) -> bool:
    """Block on a pidfd until the process exits (True) or ``timeout`` passes (False)."""
    if fd is None:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


def leader(handle: Handle) -> psutil.Process | None:
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


def members(pgid: int) -> list[psutil.Process]:
    """The processes of group ``pgid`` (a scan of every process on the host)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def not_zombie(proc: psutil.Process) -> bool:
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def signal_each(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def kill_and_wait(procs: list[psutil.Process], limit_s: float = 10.0) -> None:
    """SIGKILL ``procs`` and wait until each is gone or a zombie (a kill is delivered asynchronously)."""
    signal_each(procs, signal.SIGKILL)
    deadline = time.monotonic() + limit_s
    while procs and time.monotonic() < deadline:
        procs = [p for p in procs if not_zombie(p)]  # a gone process reads as not running
        if procs:
            time.sleep(POLL_S)


def strays(handle: Handle) -> list[psutil.Process]:
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
    found = []
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
                found.append(proc)
    return found


def reap_orphans(lock: threading.Lock, skip: Callable[[int], bool]) -> int:
    """Reap zombie children that are no task's leader (descendants reparented to nymph).

    nymph is a child subreaper, so a task's grandchildren whose parent died become nymph's
    children; this reaps those that exited. nymph's own helper subprocesses (same process
    group as nymph) and the children ``skip`` names are left alone; ``lock`` is held while
    reaping (the runner holds it while it spawns a leader). Returns the count.
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
    with lock:
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return 0
        for child in children:
            if skip(child.pid):
                continue
            with contextlib.suppress(ChildProcessError, OSError, psutil.Error):
                if child.status() != psutil.STATUS_ZOMBIE or os.getpgid(child.pid) == own_group:
                    continue
                if os.waitpid(child.pid, os.WNOHANG)[0] == child.pid:
                    reaped += 1
    return reaped
