"""The one definition of the figures every benchmark prints: median and nearest-rank percentiles."""

from __future__ import annotations

import statistics


def percentile(samples: list[float], p: float) -> float:
    """The ``p`` quantile (0..1) by nearest rank over the sorted samples; the median for p=0.5."""
    if not samples:
        raise ValueError("no samples")
    if p == 0.5:
        return statistics.median(samples)
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


def median_p90(samples: list[float]) -> tuple[float, float]:
    return percentile(samples, 0.5), percentile(samples, 0.9)
