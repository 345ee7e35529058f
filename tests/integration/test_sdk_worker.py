"""run_worker beyond seed 004: cancelling a running generator, gates, and `lakeshore worker start`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch, Plane
from dreamlake.lakeshore.errors import DispatchError
from tests.conftest import ROOT


@dls.udf(queue="long")
def ticker(n: int):
    for i in range(n):
        time.sleep(0.02)
        yield i


@dls.udf(queue="cli")
def square(x: int) -> int:
    return x * x


@pytest.fixture(params=["local", "http"])
def plane(request: pytest.FixtureRequest) -> Iterator[Plane]:
    if request.param == "local":
        p: Plane = Dispatch(":memory:")
    else:
        cp = request.getfixturevalue("sqlite_control_plane")
        p = HttpDispatch(cp.url, cp.admin_token)
    yield p
    p.close()


def test_cancel_stops_a_running_generator_at_its_next_yield(plane: Plane) -> None:
    q = dls.SyncQueue("long", dispatch=plane)
    inv = ticker.submit(10_000, _dispatch=plane)
    states: list[str | None] = []
    t = threading.Thread(
        target=lambda: states.append(dls.run_worker(q, once=True, poll_timeout=5.0, heartbeat_s=0.05))
    )
    t.start()
    got: list[int] = []
    with pytest.raises(DispatchError) as info:
        for v in q.stream(inv, timeout=10.0):
            got.append(v)
            if v == 2:
                assert q.cancel(inv) == "running"  # reaches the worker on its next heartbeat
    t.join(timeout=20)
    assert states == ["killed"]
    assert info.value.type == "Cancelled"
    assert got[:3] == [0, 1, 2] and len(got) < 10_000
    assert q.status(inv)["state"] == "killed"


def test_pickle_gate_can_be_closed_on_the_local_plane() -> None:
    plane = Dispatch(":memory:")
    q = dls.SyncQueue("jobs", dispatch=plane)
    inv = dls.udf(queue="jobs")(lambda: 1).submit(_dispatch=plane)
    assert dls.run_worker(q, once=True, allow_pickled=False, poll_timeout=5.0) == "failed"
    with pytest.raises(DispatchError, match="PickleRefused"):
        q.result(inv, timeout=5.0)


def test_unpackable_result_fails_as_type_error() -> None:
    plane = Dispatch(":memory:")
    q = dls.SyncQueue("jobs", dispatch=plane)
    inv = dls.udf(queue="jobs")(lambda: object()).submit(_dispatch=plane)
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "failed"
    with pytest.raises(DispatchError) as info:
        q.result(inv, timeout=5.0)
    assert info.value.type == "TypeError"


def test_once_returns_none_when_no_job_arrives() -> None:
    plane = Dispatch(":memory:")
    assert dls.run_worker(dls.SyncQueue("empty", dispatch=plane), once=True, poll_timeout=0.2) is None
    with pytest.raises(ValueError, match="runtime_policy"):
        dls.run_worker(dls.SyncQueue("empty", dispatch=plane), once=True, runtime_policy="loose")


def test_worker_start_cli_runs_one_job(sqlite_control_plane: Any) -> None:
    cp = sqlite_control_plane
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("cli", dispatch=plane)
    inv = square.submit(7, _dispatch=plane)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAKESHORE_TOKEN": cp.daemon_token}
    cmd = [sys.executable, "-m", "dreamlake.lakeshore.cli", "worker", "start", "--server", cp.url]
    out = subprocess.run(
        [*cmd, "--queue", "cli", "--once", "--poll-timeout", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "succeeded"
    assert q.result(inv, timeout=5.0) == 49
    plane.close()
