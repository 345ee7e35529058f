"""The demo's workload: ordinary functions, importable by reference on the nymph side.

Because this module is importable (nymph runs with ``examples/`` on PYTHONPATH), the functions
travel by reference (module + qualname + source hash), not as pickles: nymph's default refusal of
pickled functions does not get in the way.
"""

from __future__ import annotations

import time

import dreamlake.lakeshore as dls


@dls.udf(queue="demo")
def add(a: int, b: int) -> int:
    return a + b


@dls.udf(queue="demo")
def countdown(n: int, pause_s: float = 0.3):  # type: ignore[no-untyped-def]
    """A generator: every yield reaches the consumer while the body is still running."""
    for left in range(n, 0, -1):
        time.sleep(pause_s)
        yield {"left": left, "at": time.time()}
    return "lift-off"


@dls.udf(queue="demo")
def chatter(lines: int, pause_s: float = 0.3) -> int:
    """Print as it works: its output reaches ``lakeshore logs -f``, ``q.logs()`` and the dashboard live."""
    import sys

    for i in range(1, lines + 1):
        print(f"step {i} of {lines}")
        if i % 3 == 0:
            print(f"step {i}: a warning on stderr", file=sys.stderr)
        time.sleep(pause_s)
    return lines


@dls.udf(queue="demo")
def explode(x: int) -> int:
    return _check(x)


def _check(x: int) -> int:
    if x < 0:
        raise ValueError(f"x must be non-negative, got {x}")
    return x
