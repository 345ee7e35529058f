"""Functions the fault suite runs in real tasks (imported by reference: ``tests.faults.fns``).

Each execution leaves a mark in a directory the test owns (one line per run, appended), so a test
counts how many times each call ran, whatever nymph or the control plane went through meanwhile.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any


def _mark(tally: str, key: str) -> None:
    fd = os.open(os.path.join(tally, key), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


def double(tally: str, key: str, value: int, delay_s: float = 0.0, pad: str = "") -> int:
    """``2 * value``, after ``delay_s``; each run marked under ``tally/key`` (``pad``: bulk for
    the arguments, unused)."""
    _mark(tally, key)
    time.sleep(delay_s)
    return 2 * value


def hold(tally: str, key: str, value: int, gate: str, limit_s: float = 120.0) -> int:
    """``2 * value`` once the file ``gate`` exists: the test decides when the call ends."""
    _mark(tally, key)
    deadline = time.monotonic() + limit_s
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 2 * value


def count(tally: str, key: str, n: int, delay_s: float = 0.0) -> Iterator[int]:
    """Yield ``0..n-1``, ``delay_s`` apart."""
    _mark(tally, key)
    for i in range(n):
        yield i
        if delay_s:
            time.sleep(delay_s)


def fail(tally: str, key: str, stderr_bytes: int = 0) -> None:
    """Raise ValueError, after writing ``stderr_bytes`` to stderr (a failed workdir keeps that log)."""
    import sys

    _mark(tally, key)
    sys.stderr.write("e" * stderr_bytes)
    sys.stderr.flush()
    raise ValueError(f"{key} failed on purpose")


def hold_then_fail(tally: str, key: str, gate: str, limit_s: float = 120.0) -> None:
    """Raise ValueError once the file ``gate`` exists (an error.json the test decides the time of)."""
    _mark(tally, key)
    deadline = time.monotonic() + limit_s
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError(f"{key} failed on purpose")


def accumulate(tally: str, key: str, steps: int) -> Generator[list[Any], Any, list[Any]]:
    """A deterministic two-way body: yield, ``steps`` times, every value sent in so far (in the
    order the body received them); return them all. Each run (attempt) marked under ``tally/key``."""
    _mark(tally, key)
    got: list[Any] = []
    for _ in range(steps):
        got.append((yield list(got)))
    return got
