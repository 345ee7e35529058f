"""Functions the benchmarks ship by reference; importable on the nymph side (``bench/`` on PYTHONPATH)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any


def noop() -> None:
    """Does nothing: what is left of a round trip is pure dispatch."""
    return None


def ticks(n: int) -> Iterator[dict[str, float]]:
    """Yield ``n`` small values ``{"i", "t"}``, ``t`` the wall clock at the yield (bench/streams.py)."""
    for i in range(n):
        yield {"i": i, "t": time.time()}


def echo_back(n: int) -> Iterator[int]:
    """Two-way (it uses its yields): yield 0, then each value sent in, ``n`` times."""
    got = 0
    for _ in range(n):
        got = yield got


def blobs(n: int, size: int) -> Iterator[bytes]:
    """Yield ``n`` values of ``size`` bytes (bench/streams.py)."""
    for i in range(n):
        yield bytes([i % 256]) * size


def array_total(a: Any) -> dict[str, Any]:
    """The sum of a (big) numpy array argument (bench/payloads.py: arguments by reference)."""
    return {"sum": int(a.sum(dtype="uint64")), "nbytes": int(a.nbytes)}


def make_array(n: int) -> Any:
    """A numpy array of ``n`` bytes, all 7 (bench/payloads.py: results by reference)."""
    import numpy as np

    return np.full(n, 7, dtype=np.uint8)


def say(lines: int, pause_s: float) -> int:
    """Print ``lines`` lines ``"<i> <wall clock>"``, ``pause_s`` apart (bench/logs.py: print-to-reader latency)."""
    for i in range(lines):
        print(f"{i} {time.time():.6f}")
        time.sleep(pause_s)
    return lines


def shout(lines: int, width: int) -> float:
    """Print ``lines`` lines of ``width`` bytes as fast as possible; returns the seconds it took."""
    line = "x" * (width - 1)
    start = time.perf_counter()
    for _ in range(lines):
        print(line)
    return time.perf_counter() - start


def noisy_ticks(n: int, lines: int) -> Iterator[dict[str, float]]:
    """:func:`ticks`, printing ``lines`` lines before each value (a flood of prints beside a stream)."""
    for i in range(n):
        for j in range(lines):
            print(f"value {i} line {j}")
        yield {"i": i, "t": time.time()}


def import_probe(module: str | None = None) -> str:
    """Import ``module`` (from the call's pip environment, bench/pip_envs.py) and say where from."""
    if module is None:
        return ""
    return str(__import__(module).__file__)
