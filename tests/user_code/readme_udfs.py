"""A user's module, written as the README shows: ``import dreamlake.lakeshore as dls`` and ``@dls.udf``.

The runner conformance suite runs it on every runner (tests/contract/test_runner_conformance.py):
a plain call, a generator, a failure with its traceback, a scope, a nested call, a Thunk and the wire
types. It sits in a directory of its own (``tests/user_code``, imported as the top-level module
``readme_udfs``) so that a sandbox can be given this code without the repository: in a bare image
(python3 and msgpack) the only ``dreamlake`` it can import is the entry bundle's.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import dreamlake.lakeshore as dls

PLAN = None  # a Thunk built at import time, below: capturing a call needs no plane


@dls.udf(queue="work")
def topk(xs, k):
    return sorted(xs)[-k:]


@dls.udf(queue="work")
def count(n, gate=None):
    """Yield 0..n-1 and return "done"; before the last value wait for the file ``gate`` (if given)."""
    for i in range(n):
        if gate is not None and i == n - 1:
            while not Path(gate).exists():
                time.sleep(0.02)
        yield i
    return "done"


@dls.udf(queue="work")
def fail(message):
    raise ValueError(message)


@dls.udf(queue="work")
def keys(name):
    """``run.key`` under the submitter's scope, and under one opened in the body."""
    with dls.scope("frames"):
        inner = dls.run.key(name)
    return {"id": dls.run.id, "name": dls.run.name, "key": dls.run.key(name), "inner": inner}


@dls.udf(queue="work")
def who():
    return dls.run.name


@dls.udf(queue="work")
def nested(xs):
    """A UDF calling others locally: each runs here, under its own name, in this invocation."""
    return {"top": topk(xs, 2), "inner": who(), "outer": dls.run.name, "id": dls.run.id}


@dls.udf(queue="work")
def values():
    """The wire types a body returns, the Thunk captured at import, where the SDK was imported from."""
    return {
        "tuple": (1, "a"),
        "set": {2, 3},
        "bytes": b"\x00\xff",
        "when": datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc),  # noqa: UP017 (3.9)
        "complex": 1 + 2j,
        "plan": PLAN.run_config() if PLAN is not None else None,
        "plan_fn": PLAN.to_envelope().fn["qualname"] if PLAN is not None else None,
        "sdk": sys.modules[type(topk).__module__].__file__,
        "python": list(sys.version_info[:2]),
    }


PLAN = topk.thunk([5, 1, 4], 1, _priority=2)
