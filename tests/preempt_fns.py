"""Functions the preemption tests (issue 30) ship by reference; the spawned entry imports this
module (PYTHONPATH = repo root)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import dreamlake.lakeshore as dls


@dls.udf(queue="nymph")
def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return f"slept on attempt {dls.attempt()}"


@dls.udf(queue="nymph")
def interruptible(marker: str, seconds: float = 120.0, started: str | None = None) -> str:
    """Sleep; ``finally`` writes ``marker`` with the Interrupted's reason (``none`` without one);
    ``started`` is touched first."""
    reason = "none"
    try:
        if started is not None:
            Path(started).touch()
        time.sleep(seconds)
    except dls.Interrupted as exc:
        reason = exc.reason
        raise
    finally:
        Path(marker).write_text(reason)
    return "slept"


@dls.udf(queue="nymph")
def stepper(log: str, steps: int = 10, delay_s: float = 0.3) -> int:
    """``steps`` steps, each logged once (``<step> <attempt>`` per line in ``log``) and then
    checkpointed; a new attempt resumes after the last checkpointed step. The log line and the
    checkpoint are written with SIGTERM blocked, as one step (what a careful user does)."""
    ckpt = Path(dls.checkpoint_dir()) / "step"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    for step in range(start, steps):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            with open(log, "a") as f:
                f.write(f"{step} {dls.attempt()}\n")
            tmp = ckpt.with_name("step.tmp")
            tmp.write_text(str(step + 1))
            os.replace(tmp, ckpt)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        time.sleep(delay_s)
    return steps


@dls.udf(queue="nymph")
def paused_gen(marker: str) -> Iterator[int]:
    """Yield 0, 1, ...; an Interrupted records where it reached the generator."""
    i = -1
    try:
        for i in range(1000):
            yield i
    except dls.Interrupted as exc:
        Path(marker).write_text(f"{exc.reason} at yield {i}")
        raise


@dls.udf(queue="nymph")
def slow_finally(marker: str, started: str) -> str:
    """Its finally takes a while (a second SIGTERM meanwhile must not cut it short)."""
    try:
        Path(started).touch()
        time.sleep(60)
    finally:
        time.sleep(0.5)
        Path(marker).write_text("cleaned up")
    return "slept"


@dls.udf(queue="nymph")
def big_checkpoint(size: int) -> str:
    """Leave ``size`` bytes in the checkpoint directory, then fail."""
    (Path(dls.checkpoint_dir()) / "weights").write_bytes(b"w" * size)
    raise ValueError(f"failed with a checkpoint of {size} bytes")


@dls.udf(queue="nymph")
def stopped_slowly(marker: str, started: str) -> str:
    """Checkpoint, then sleep; an Interrupted writes its reason to ``marker`` and takes another
    second to end (nymph can be killed meanwhile). An attempt that finds the checkpoint returns."""
    ckpt = Path(dls.checkpoint_dir())
    if (ckpt / "state").exists():
        return f"resumed on attempt {dls.attempt()} from {(ckpt / 'state').read_text()}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "state").write_text(f"attempt {dls.attempt()}")
    Path(started).touch()
    try:
        time.sleep(120)
    except dls.Interrupted as exc:
        Path(marker).write_text(exc.reason)
        time.sleep(1.0)
        raise
    return "slept"
