"""Times and sizes for people: ages (``45s``, ``12m``, ``3h``, ``2d``), local date-times,
durations and byte counts (``10 GiB``; ``parse_size`` reads ``10g``).

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


_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def size(n: int) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.5 KiB``, ``10 GiB``, ``1000 KiB``, ``99999 TiB``
    (three digits, or the whole number where three would need an exponent)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    text = f"{value:.0f}" if unit == "B" else f"{value:.3g}"
    return f"{value:.0f} {unit}" if "e" in text else f"{text} {unit}"


def parse_size(text: str) -> int:
    """A byte count as an operator writes it: ``1048576``, ``512k``, ``10g``, ``1.5GiB`` (powers
    of 1024). ValueError, saying what is accepted, for anything else."""
    raw = text.strip().lower().replace(" ", "")
    for suffix in ("ib", "b"):
        if raw.endswith(suffix) and raw[: -len(suffix)][-1:] in "kmgt" and len(raw) > len(suffix):
            raw = raw[: -len(suffix)]
            break
    unit = raw[-1:] if raw[-1:] in "kmgtb" else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not number or not value >= 0 or value != value or value == float("inf"):
        raise ValueError(f"{text!r}: give a number of bytes, e.g. 1048576, 512k, 10g or 1.5GiB")
    return int(value * _UNITS[unit])
