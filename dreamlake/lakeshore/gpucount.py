"""The one reading of a call's GPU count: ``run_config.resources.gpus`` (alias ``nvidia.com/gpu``).

The control plane places a call by it (``store/placement.py``), nymph takes that many devices for
it (``nymph.slots``) and every runner reads it (``nymph.resources``), all through here, so a call
is never placed as one thing and run as another. A count is a whole number from 0 to
:data:`MAX_GPUS`: an int, a float without a fraction (``1.0``: how a JSON number often arrives) or
a string of digits (``"2"``: how Kubernetes writes one); a bool is none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ALIAS", "EXPECTED", "FIELD", "MAX_GPUS", "gpu_count", "gpus_of"]

FIELD = "gpus"
ALIAS = "nvidia.com/gpu"  # Kubernetes' name for the same count
MAX_GPUS = 1024
EXPECTED = f"a whole number of GPUs from 0 to {MAX_GPUS} (such as 1)"


def gpu_count(value: Any) -> int | None:
    """``value`` as a GPU count; None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.isdigit()):
            return None
        value = int(text)
    elif isinstance(value, float):
        if not value.is_integer():  # 1.5, inf, nan
            return None
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= MAX_GPUS:
        return None
    return value


def gpus_of(resources: Any) -> int:
    """The GPU count a ``run_config.resources`` mapping asks for (0 when it asks none); ValueError
    with the message to give when its value is not a count, or it is given under both names."""
    if not isinstance(resources, Mapping):
        return 0
    given = [name for name in (FIELD, ALIAS) if resources.get(name) is not None]
    if not given:
        return 0
    if len(given) > 1:
        raise ValueError(
            f"run_config.resources.{FIELD} is given twice (as {FIELD!r} and {ALIAS!r}): give it once"
        )
    raw = resources[given[0]]
    count = gpu_count(raw)
    if count is None:
        raise ValueError(f"run_config.resources.{given[0]} must be {EXPECTED}, got {raw!r:.40}")
    return count
