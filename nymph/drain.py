"""Draining a host: stop claiming, let running calls finish, exit 0 (issue 30 item 2).

``nymph drain`` (or ``kill -USR1`` of nymph's pid) asks a running nymph to drain: it stops
claiming at once, lets the calls it runs finish, and exits 0 when none is left. ``--drain-timeout``
bounds the wait: past it the calls still running are stopped with the ladder and acked
``preempted`` (the control plane runs them again elsewhere at once, spending none of their
``max_attempts``). A SIGTERM during a drain keeps its own, shorter, ``grace_s``.

The running nymph is found by its pid file, ``{state_dir}/nymph.pid`` (written at start, removed
at exit); the timeout travels in ``{state_dir}/drain.timeout`` (written before the signal, read
and removed by the agent). Both live in nymph's private state directory, out of tasks' reach.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import psutil

from nymph import safeio

PID_FILE = "nymph.pid"
DRAIN_FILE = "drain.timeout"
WAIT_STEP_S = 0.1


class DrainError(Exception):
    """No nymph to drain, or it could not be asked."""


def write_pid(state_dir: Path) -> None:
    safeio.write_file(state_dir, PID_FILE, f"{os.getpid()}\n".encode(), 0o644)


def clear_pid(state_dir: Path) -> None:
    """Remove the pid file when it is still this process's."""
    if read_pid(state_dir) == os.getpid():
        try:
            (state_dir / PID_FILE).unlink()
        except OSError:
            pass


def read_pid(state_dir: Path) -> int | None:
    try:
        text = (state_dir / PID_FILE).read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its parent has not reaped yet does not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def request(state_dir: Path, timeout_s: float | None) -> int:
    """Ask the nymph whose pid file is in ``state_dir`` to drain; its pid."""
    pid = read_pid(state_dir)
    if pid is None or not _alive(pid):
        raise DrainError(
            f"no running nymph has its pid file in {state_dir} (is it started with this --state-dir?)"
        )
    text = "" if timeout_s is None else f"{timeout_s:g}"
    safeio.write_file(state_dir, DRAIN_FILE, text.encode(), 0o600)
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError as exc:
        raise DrainError(f"cannot signal nymph (pid {pid}): {exc.strerror}") from exc
    return pid


def wait_exit(pid: int, timeout_s: float | None) -> bool:
    """Whether ``pid`` ended within ``timeout_s`` (None: wait for it)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while _alive(pid):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(WAIT_STEP_S)
    return True


def take_timeout(state_dir: Path, default: float | None) -> float | None:
    """The drain timeout ``nymph drain`` left (and remove it), else ``default``; None: unbounded."""
    path = state_dir / DRAIN_FILE
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
        path.unlink()
    except OSError:
        return default
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default
