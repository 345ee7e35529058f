"""The one reading of a task's limits in ``run_config.resources``: ``cpus`` (alias ``cpu``),
``memory``, ``shm``, ``pids`` and ``gpus`` (alias ``nvidia.com/gpu``, read by :mod:`gpucount`).

nymph reads a task's limits with these parsers (``nymph.resources``), and the control plane
refuses at submit (``store.values.check_run_config``, 400) a value of these fields they would
not read, so a call is never queued only to fail on its nymph with a ``ResourceError``. A limit is
positive: 0 CPUs, 0 bytes or 0 processes is refused, not read as "no limit" (leave the field out
for that); a GPU count of 0 asks for no GPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from dreamlake.lakeshore import gpucount

__all__ = ["ALIASES", "EXPECTED", "FIELDS", "PARSERS", "SIZE", "UNITS", "millicpus", "pids", "size"]

#: The fields of ``run_config.resources``, in the order messages list them.
FIELDS = ("cpus", "memory", "pids", "shm", "gpus")
#: Other names accepted for a field (Kubernetes' own resource names).
ALIASES = {"cpu": "cpus", gpucount.ALIAS: gpucount.FIELD}
#: What each field accepts, as a refusal says it.
EXPECTED = {
    "cpus": "a positive number of CPUs such as 2 or 1.5, or millicores such as '500m'",
    "memory": "a positive size such as 512m, 1g or 512Mi",
    "shm": "a positive size such as 512m, 1g or 512Mi",
    "pids": "a positive whole number",
    "gpus": gpucount.EXPECTED,
}

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_MILLI = re.compile(r"^\s*(\d+)\s*m\s*$")
_WHOLE = re.compile(r"^\s*\d+\s*$")


def millicpus(value: Any) -> int | None:
    """``value`` (``2``, ``1.5``, ``"1.5"``, ``"500m"``) in millicores, at least 1; None if not."""
    if isinstance(value, str) and (milli := _MILLI.match(value)):
        count = int(milli.group(1))
    else:
        number = _number(value)
        if number is None:
            return None
        count = round(number * 1000)
    return count if count >= 1 else None


def size(value: Any) -> int | None:
    """``value`` (bytes, or ``512m``, ``1g``, ``512Mi``: powers of 1024) in bytes, at least 1."""
    if isinstance(value, str):
        match = SIZE.match(value)
        if not match:
            return None
        number = float(match.group(1)) * UNITS[match.group(2).lower()]
    else:
        found = _number(value)
        if found is None:
            return None
        number = found
    return int(number) if number >= 1 else None


def pids(value: Any) -> int | None:
    """``value`` (``1024``, ``"1024"``) as a whole number of processes, at least 1."""
    if isinstance(value, str) and _WHOLE.match(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _number(value: Any) -> float | None:
    """A finite int/float, or a string of one; never a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


#: Each field's parser: its value read, or None when it is not one.
PARSERS: dict[str, Callable[[Any], int | None]] = {
    "cpus": millicpus,
    "memory": size,
    "shm": size,
    "pids": pids,
    "gpus": gpucount.gpu_count,  # the control plane's reading too: what it places, runs
}
