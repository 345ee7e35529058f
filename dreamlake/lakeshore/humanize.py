"""Times for people: ages (``45s``, ``12m``, ``3h``, ``2d``), local date-times and durations.

Shared by the ``lakeshore`` CLI and the ``/ui`` dashboard, so both say the same thing.
"""

from __future__ import annotations

import datetime as dt
import time


def age(seconds: float | None) -> str:
    """``45s``, ``12m``, ``3h``, ``2d``; ``-`` for None."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def when(ts: float | None) -> str:
    """A local ``YYYY-MM-DD HH:MM:SS``; ``-`` for None."""
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def duration(start: float | None, end: float | None, now: float | None = None) -> str:
    """From ``start`` to ``end`` (or now): ``0.42s`` under a minute, else an age; ``-`` unstarted."""
    if start is None:
        return "-"
    span = (end if end is not None else (time.time() if now is None else now)) - start
    return f"{span:.2f}s" if span < 60 else age(span)
