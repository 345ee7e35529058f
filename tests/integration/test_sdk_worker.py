"""run_worker beyond seed 004: cancelling a running generator, gates, and `lakeshore worker start`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import ids
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch, Plane
from dreamlake.lakeshore.errors import DispatchError
from tests.conftest import ROOT
from tests.integration.planes_kit import PLANES, open_plane


@dls.udf(queue="long")
def ticker(n: int):
    for i in range(n):
        time.sleep(0.02)
        yield i


@dls.udf(queue="cli")
def square(x: int) -> int:
    return x * x


@dls.udf(queue="plain")
def blocking(tag: str) -> str:
    STARTED.set()
    assert RELEASE.wait(30), "the test never released the body"
    return tag


STARTED = threading.Event()
RELEASE = threading.Event()


@pytest.fixture(params=PLANES)
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    with open_plane(request.param, request, tmp_path) as (p, _spec):
        yield p


def _cancel_mid_stream(plane: Plane, heartbeat_s: float) -> None:
    q = dls.SyncQueue("long", dispatch=plane)
    inv = ticker.submit(10_000, _dispatch=plane)
    states: list[str | None] = []
    t = threading.Thread(
        target=lambda: states.append(dls.run_worker(q, once=True, poll_timeout=5.0, heartbeat_s=heartbeat_s))
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
    assert (info.value.type, info.value.message) == ("Cancelled", "cancelled by producer")
    assert got[:3] == [0, 1, 2] and len(got) < 10_000
    record = q.status(inv)
    assert record["state"] == "killed"
    assert record["error"]["type"] == "Cancelled"


def test_cancel_stops_a_running_generator_at_its_next_yield(plane: Plane) -> None:
    _cancel_mid_stream(plane, heartbeat_s=0.05)


def test_local_cancel_does_not_wait_for_the_next_heartbeat(tmp_path: Path) -> None:
    """On the local plane the heartbeat thread wakes on the cancel itself: with a beat an hour
    away, the stream still ends with Cancelled (and not a TimeoutError after 10 s of silence...
    the ticker keeps yielding, so it would run its 10_000 frames instead)."""
    plane = Dispatch(str(tmp_path / "jobs.db"))
    try:
        _cancel_mid_stream(plane, heartbeat_s=3600.0)
    finally:
        plane.close()


def test_cancel_of_a_running_plain_call_acks_killed(plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain body cannot be interrupted in process: its result is discarded, the outcome killed."""
    STARTED.clear()
    RELEASE.clear()
    heard = threading.Event()
    beat = plane.heartbeat

    def heartbeat(worker_id: str, running: list[tuple[str, int]]) -> list[str]:
        cancels = beat(worker_id, running)
        if cancels:
            heard.set()
        return cancels

    monkeypatch.setattr(plane, "heartbeat", heartbeat)
    q = dls.SyncQueue("plain", dispatch=plane)
    inv = blocking.submit("late", _dispatch=plane)
    states: list[str | None] = []
    t = threading.Thread(
        target=lambda: states.append(dls.run_worker(q, once=True, poll_timeout=5.0, heartbeat_s=0.05))
    )
    t.start()
    try:
        assert STARTED.wait(20)
        assert q.cancel(inv) == "running"
        assert heard.wait(20), "the cancel never reached the worker's heartbeat"
    finally:
        RELEASE.set()
        t.join(timeout=20)
    assert states == ["killed"]
    with pytest.raises(DispatchError) as info:
        q.result(inv, timeout=5.0)
    assert (info.value.type, info.value.message) == ("Cancelled", "cancelled by producer")


def test_a_cancel_delivered_by_an_idle_poll_reaches_the_next_heartbeat(plane: Plane) -> None:
    """The control plane hands a queued command out once, by poll or by heartbeat: a cancel that
    an idle poll received must still be reported for the invocation by the worker's next
    heartbeat; and every beat that reports the invocation running is asked again until the ack
    (an answer can be lost on its way)."""
    q = dls.SyncQueue("long", dispatch=plane)
    inv = ticker.submit(3, _dispatch=plane)
    wid = ids.new_ulid()
    claim = plane.claim(wid, ["long"], 5.0)
    assert claim is not None and claim.invocation_id == inv
    assert q.cancel(inv) == "running"
    assert plane.claim(wid, ["long"], 0.3) is None  # idle: nothing to run, the cancel rides along
    assert plane.heartbeat(wid, [(inv, claim.attempt)]) == [inv]
    assert plane.heartbeat(wid, [(inv, claim.attempt)]) == [inv]  # once per beat, never twice
    assert plane.ack(inv, "killed", attempt=claim.attempt, worker_id=wid, error={"type": "Cancelled"})
    assert q.status(inv)["state"] == "killed"
    assert plane.heartbeat(wid, [(inv, claim.attempt)]) == []  # acked: nothing more to ask


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


def test_worker_start_cli_runs_one_job(sqlite_control_plane: Any, tmp_path: Path) -> None:
    cp = sqlite_control_plane
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("cli", dispatch=plane)
    inv = square.submit(7, _dispatch=plane)
    # found as every lakeshore command finds the plane: LAKESHORE_URL / LAKESHORE_TOKEN, no flags
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAKESHORE_URL": cp.url, "LAKESHORE_TOKEN": cp.daemon_token}
    cmd = [sys.executable, "-m", "dreamlake.lakeshore.cli", "worker", "start"]
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
    # and from the config file, as every lakeshore command: url and token in config.toml
    config = tmp_path / "config.toml"
    config.write_text(f'url = "{cp.url}"\ntoken = "{cp.daemon_token}"\n')
    env = {k: v for k, v in env.items() if not k.startswith("LAKESHORE_")}
    env["LAKESHORE_CONFIG"] = str(config)
    inv = square.submit(8, _dispatch=plane)
    out = subprocess.run(
        [*cmd, "--queue", "cli", "--once", "--poll-timeout", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert (out.returncode, out.stdout.strip()) == (0, "succeeded"), out.stderr
    assert q.result(inv, timeout=5.0) == 64
    plane.close()


def test_worker_start_cli_runs_pickles_only_with_allow_pickled(sqlite_control_plane: Any) -> None:
    cp = sqlite_control_plane
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("cli", dispatch=plane)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAKESHORE_TOKEN": cp.daemon_token}
    cmd = [sys.executable, "-m", "dreamlake.lakeshore.cli", "worker", "start", "--server", cp.url]
    cmd += ["--queue", "cli", "--once", "--poll-timeout", "10"]
    refused = dls.udf(queue="cli")(lambda: 6 * 7).submit(_dispatch=plane)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert (out.returncode, out.stdout.strip()) == (0, "failed"), out.stderr
    with pytest.raises(DispatchError, match="PickleRefused"):
        q.result(refused, timeout=5.0)
    allowed = dls.udf(queue="cli")(lambda: 6 * 7).submit(_dispatch=plane)
    out = subprocess.run([*cmd, "--allow-pickled"], capture_output=True, text=True, timeout=60, env=env)
    assert (out.returncode, out.stdout.strip()) == (0, "succeeded"), out.stderr
    assert q.result(allowed, timeout=5.0) == 42
    plane.close()


def test_a_superseded_attempt_ends_the_job_not_the_worker(tmp_path: Path) -> None:
    """The plane refuses a frame (409) once the attempt's lease lapsed and it was claimed again:
    the worker drops the job (its ack would be refused too) and stays alive for the next one."""
    from dreamlake.lakeshore.errors import PlaneError

    plane = Dispatch(":memory:")
    q = dls.SyncQueue("long", dispatch=plane)
    inv = ticker.submit(3, _dispatch=plane)
    real = plane.append_frame

    def refuse_second(
        invocation_id: str, seq: int, data: bytes, final: bool, attempt: int, *, worker_id: str
    ) -> None:
        if seq >= 1:
            raise PlaneError(f"attempt {attempt} of {invocation_id} was superseded by attempt 2", 409)
        real(invocation_id, seq, data, final, attempt, worker_id=worker_id)

    plane.append_frame = refuse_second  # type: ignore[method-assign]
    try:
        assert dls.run_worker(q, once=True, poll_timeout=5.0) == "superseded"
        assert q.status(inv)["state"] == "running"  # no ack of the superseded attempt was sent
        plane.append_frame = real  # type: ignore[method-assign]
        other = square.submit(7, _dispatch=plane)
        assert dls.run_worker("cli", once=True, poll_timeout=5.0, dispatch=plane) == "succeeded"
        assert dls.SyncQueue("cli", dispatch=plane).result(other, timeout=5.0) == 49
    finally:
        plane.close()


def test_an_sdk_worker_over_http_never_claims_exec_jobs(sqlite_control_plane: Any) -> None:
    """An exec job it claimed could not run in process and would stay running for ever."""
    cp = sqlite_control_plane
    status, out = cp.json(
        "POST", "/v1/namespaces/ns/exec", {"command": "true", "queue": "cli"}, cp.admin_token
    )
    assert status == 202
    with HttpDispatch(cp.url, cp.admin_token) as plane:
        assert dls.run_worker("cli", once=True, poll_timeout=0.5, dispatch=plane) is None
    assert cp.store.get_exec("ns", out["exec_id"])["state"] == "queued"
