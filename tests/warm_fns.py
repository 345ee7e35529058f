"""Functions the warm-mode tests (tests/integration/test_process_warm.py) ship by reference.

A warm worker imports this module once and keeps it: ``_CALLS`` counts the calls this process ran,
which is how the tests see module state persist (warm) or not (a cold entry imports it fresh).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

_CALLS: list[int] = []


def count() -> tuple[int, int]:
    """(this process's pid, the calls of this module it ran so far, this one included)."""
    _CALLS.append(1)
    print(f"call {len(_CALLS)} in {os.getpid()}")
    return os.getpid(), len(_CALLS)


def values(n: int) -> Iterator[int]:
    _CALLS.append(1)
    yield from range(n)
    return os.getpid()


def crash(code: int) -> None:
    """Kill the process mid-call, as a segfault or an ``os._exit`` in a library would."""
    os._exit(code)


def hold(pid_file: str, release: str, limit_s: float = 120.0) -> int:
    """Write this process's pid to ``pid_file``, then wait for ``release`` to exist."""
    Path(pid_file).write_text(str(os.getpid()))
    deadline = time.monotonic() + limit_s
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid()


def identity() -> tuple[int, int, int]:
    """(pid, uid, the calls of this module this process ran so far)."""
    _CALLS.append(1)
    return os.getpid(), os.getuid(), len(_CALLS)
