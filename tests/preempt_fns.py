"""Functions the preemption tests (issue 30) ship by reference; the spawned entry imports this
module (PYTHONPATH = repo root)."""

from __future__ import annotations

import time
from pathlib import Path

import dreamlake.lakeshore as dls


@dls.udf(queue="nymph")
def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return f"slept on attempt {dls.attempt()}"


@dls.udf(queue="nymph")
def interruptible(marker: str, seconds: float = 120.0) -> str:
    """Sleep; ``finally`` writes ``marker`` with the Interrupted's reason (``none`` without one)."""
    reason = "none"
    try:
        time.sleep(seconds)
    except dls.Interrupted as exc:
        reason = exc.reason
        raise
    finally:
        Path(marker).write_text(reason)
    return "slept"
