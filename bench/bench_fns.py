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
