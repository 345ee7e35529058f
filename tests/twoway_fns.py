"""Two-way generator bodies the tests ship by reference (importable: PYTHONPATH is the repo root)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import dreamlake.lakeshore as dls


@dls.udf(queue="tune")
def tuner() -> Generator[float, float | None, None]:
    """Seed 004's L3 tuner, as written there, with @dls.udf added."""
    lr = 0.1
    while True:
        loss = yield lr
        if loss is None:
            return
        lr = lr * 0.5 if loss > 1.0 else lr * 1.1


@dls.udf(queue="tune")
def echo(steps: int) -> Generator[int, Any, list[Any]]:
    """Yield 0..steps-1; return every value sent in, in the order the body received them."""
    got: list[Any] = []
    for i in range(steps):
        got.append((yield i))
    return got


@dls.udf(queue="tune")
def resilient() -> Generator[str, Any, str]:
    """A thrown ValueError is caught and reported as the next value; a close runs ``finally``."""
    said = "ready"
    try:
        while True:
            try:
                said = f"got {(yield said)!r}"
            except ValueError as exc:
                said = f"caught ValueError: {exc}"
    finally:
        print("finally ran", flush=True)


@dls.udf(queue="tune", send_timeout_s=0.5, two_way=True)  # its yield is a statement: say so
def impatient() -> Generator[str, Any, str]:
    try:
        yield "waiting"
    except dls.SendTimeout:
        return "timed out"
    return "answered"


@dls.udf(queue="tune")
def one_way(n: int) -> Generator[int, None, None]:
    yield from range(n)
