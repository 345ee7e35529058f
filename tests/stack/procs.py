"""The environment of the checkout's subprocesses, and owning them by process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """This environment without nymph's own settings (``NYMPH_*``), with the checkout and its
    runner plugins on ``PYTHONPATH``: how the suite starts ``lakeshore`` and ``nymph``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NYMPH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "runners")])
    return env


def kill_group(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``proc`` leads (started with ``start_new_session=True``),
    and reap ``proc``; what its group left (a task in a session of its own) is the caller's."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    if sig == signal.SIGKILL:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def busy_descriptors(past: int = 1100) -> Iterator[None]:
    """This process as a busy nymph: its descriptors taken up to ``past`` (``/dev/null``, the
    soft ``RLIMIT_NOFILE`` raised for them), so what it opens next is numbered past 1023, where
    ``select.select`` refuses to go. Skips when the hard limit does not allow it."""
    import resource

    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < past + 256:
        pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} leaves no room past {past} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, past + 256), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < past:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
