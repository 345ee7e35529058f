"""Tasks that submit tasks, written as a user writes them (tests/integration/test_task_submit.py).

Inside a task, nymph sets ``LAKESHORE_URL`` and ``LAKESHORE_TOKEN_FILE`` (the invocation's own task
token), so ``.submit()``, ``SyncQueue.result`` and ``.stream`` need no plane. Lives beside the
README's module in ``tests/user_code`` (no dreamlake there: containers use the entry bundle's).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import dreamlake.lakeshore as dls


@dls.udf
def square(x):
    return x * x


@dls.udf
def count(n):
    yield from range(n)


@dls.udf
def fan_out(n):
    """Submit ``n`` children from inside this task and gather their results here."""
    q = dls.SyncQueue("default")
    children = [square.submit(i) for i in range(n)]
    results = [q.result(child, timeout=300) for child in children]
    streamed = list(q.stream(count.submit(3), timeout=120))
    return {"id": dls.run.id, "children": children, "results": results, "streamed": streamed}


@dls.udf
def wait_forever():
    while True:
        time.sleep(0.05)


@dls.udf
def parent_of_sleepers(n):
    """Submit ``n`` children that never end, then never end either (until cancelled)."""
    for _ in range(n):
        wait_forever.submit()
    wait_forever()


@dls.udf
def hold_token(gate):
    """Leave this task's credential in ``token`` (its workdir) and wait for ``gate`` to appear."""
    Path("token.tmp").write_text(Path(os.environ["LAKESHORE_TOKEN_FILE"]).read_text())
    os.replace("token.tmp", "token")
    while not Path(gate).exists():
        time.sleep(0.02)
    return "released"


@dls.udf
def spawn_holder(gate):
    """A parent whose child (``hold_token``) hands its credential out; returns the child's id."""
    child = hold_token.submit(gate)
    return {"child": child, "result": dls.SyncQueue("default").result(child, timeout=300)}
