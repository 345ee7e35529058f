"""Functions the benchmarks ship by reference; importable on the nymph side (``bench/`` on PYTHONPATH)."""

from __future__ import annotations


def noop() -> None:
    """Does nothing: what is left of a round trip is pure dispatch."""
    return None
