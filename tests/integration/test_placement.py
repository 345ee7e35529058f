"""Placement end to end (issue 29): real ``lakeshore server`` and ``nymph start`` processes (process
runner, fake GPUs through ``NYMPH_GPUS``), on SQLite and PostgreSQL.

A call runs only on a nymph that offers what it needs (free GPUs, the labels of its selector); one
that fits no live nymph stays ``queued`` (never claimed and failed, never parked inside a nymph
waiting for devices another call holds); ``_not_before`` holds a call until its time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import ids
from tests import nymph_fns
from tests.integration.conftest import submit_body
from tests.stack.nymph import Nymph
from tests.stack.producer import call, envelope
from tests.stack.server import Server
from tests.stack.wait import LIMIT_S, until

pytestmark = pytest.mark.slow


class PlacedServer(Server):
    """``lakeshore server`` over ``--db`` (SQLite in its data dir, or a fresh PostgreSQL database)."""

    def __init__(self, data_dir: Path, db: str | None) -> None:
        super().__init__(data_dir, *(["--db", db] if db is not None else []))
        self.db = db


class GpuNymph(Nymph):
    """``nymph start`` offering the fake devices ``gpus`` (``NYMPH_GPUS``)."""

    def __init__(self, server: str, token: str, base: Path, gpus: str, *extra: str, queue: str) -> None:
        super().__init__(server, token, base, *extra, queue=queue)
        self.gpus = gpus

    def env(self) -> dict[str, str]:
        return {**super().env(), "NYMPH_GPUS": self.gpus}

    @property
    def worker_id(self) -> str:
        return (self.state_dir / "worker_id").read_text().strip()


@pytest.fixture(params=["sqlite", "postgresql"])
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PlacedServer]:
    data = tmp_path / "cp"
    data.mkdir()
    if request.param == "sqlite":
        srv = PlacedServer(data, None)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()
        return
    from tests.contract.conftest import pg_database

    with pg_database() as url:
        srv = PlacedServer(data, url)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture
def nymphs(plane: PlacedServer, tmp_path: Path) -> Iterator[Callable[..., GpuNymph]]:
    started: list[GpuNymph] = []

    def make(name: str, gpus: str = "none", *extra: str, queue: str = "gpu", slots: int = 4) -> GpuNymph:
        base = tmp_path / name
        base.mkdir()
        token = plane.tokens()["daemon"]
        n = GpuNymph(plane.url, token, base, gpus, "--concurrency", str(slots), *extra, queue=queue)
        started.append(n)
        n.start()
        until(lambda: (n.state_dir / "worker_id").exists(), f"nymph {name} to start")
        until(lambda: _registered(plane, n.worker_id), f"nymph {name} to register")
        return n

    yield make
    for n in started:
        n.stop()


def _workers(plane: PlacedServer) -> list[dict[str, Any]]:
    token = plane.tokens()["admin"]
    resp = httpx.get(f"{plane.url}/v1/ops/workers", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return list(body["workers"] if isinstance(body, dict) else body)


def _registered(plane: PlacedServer, worker_id: str) -> bool:
    return any(w.get("worker_id") == worker_id for w in _workers(plane))


def _submit(
    plane: PlacedServer, fn: Callable[..., Any], *args: Any, queue: str = "gpu", **rc: Any
) -> dict[str, Any]:
    token = plane.tokens()["admin"]
    body = submit_body(
        ids.new_ulid(), queue, run_config={"queue": queue, **rc}, args_blob=envelope(fn, *args)
    )
    return dict(call(plane.url, token, "/v1/producer/submit", body))


def _status(plane: PlacedServer, inv: str) -> dict[str, Any]:
    token = plane.tokens()["admin"]
    resp = httpx.get(
        f"{plane.url}/v1/producer/invocations/{inv}", headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    return dict(msgpack.unpackb(resp.content, raw=False))


def _done(plane: PlacedServer, inv: str) -> dict[str, Any] | None:
    st = _status(plane, inv)
    return st if st["state"] in ("succeeded", "failed", "cancelled", "timeout") else None


def _stays_queued(plane: PlacedServer, inv: str, for_s: float) -> None:
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        assert _status(plane, inv)["state"] == "queued"
        time.sleep(0.1)


def test_gpu_calls_run_only_where_the_gpus_are_and_wait_queued_otherwise(
    plane: PlacedServer, nymphs: Callable[..., GpuNymph]
) -> None:
    small = nymphs("small", "0,1")
    # with only the two-GPU nymph alive a gpus=4 call stays queued, and the submit said why
    first = _submit(plane, nymph_fns.add, 1, 1, resources={"gpus": 4}, max_attempts=3)
    assert "offers 4 GPUs (largest: 2)" in first.get("warning", ""), first
    _stays_queued(plane, first["invocation_id"], 3.0)
    big = nymphs("big", "0,1,2,3")
    invs = [first["invocation_id"]] + [
        _submit(plane, nymph_fns.add, i, 1, resources={"gpus": 4}, max_attempts=3)["invocation_id"]
        for i in range(19)
    ]
    outcomes = [until(lambda inv=inv: _done(plane, inv), f"{inv} to finish", LIMIT_S * 2) for inv in invs]
    assert [o["state"] for o in outcomes] == ["succeeded"] * 20, [o.get("error") for o in outcomes]
    assert {o["worker_id"] for o in outcomes} == {big.worker_id}
    assert [o["attempt"] for o in outcomes] == [1] * 20  # none was ever claimed and failed elsewhere
    assert "NotEnoughGpus" not in small.output() + big.output()


def test_a_call_behind_one_holding_the_gpus_waits_queued_for_another_nymph(
    plane: PlacedServer, nymphs: Callable[..., GpuNymph], tmp_path: Path
) -> None:
    a = nymphs("a", "0,1")
    gate = tmp_path / "gate"
    holder = _submit(plane, nymph_fns.wait_for_file, str(gate), resources={"gpus": 2})["invocation_id"]
    until(lambda: _status(plane, holder)["state"] == "running", "the first call to hold both GPUs")
    waiting = _submit(plane, nymph_fns.add, 2, 2, resources={"gpus": 2})["invocation_id"]
    _stays_queued(plane, waiting, 3.0)  # not claimed by nymph A: it has no GPU free
    b = nymphs("b", "0,1")
    st = until(lambda: _done(plane, waiting), "the second call to run on nymph B")
    assert st["state"] == "succeeded" and st["worker_id"] == b.worker_id
    assert _status(plane, holder)["state"] == "running"
    gate.write_text("go")
    assert until(lambda: _done(plane, holder), "the first call")["worker_id"] == a.worker_id


def test_a_selector_runs_only_on_the_nymph_with_that_label(
    plane: PlacedServer, nymphs: Callable[..., GpuNymph]
) -> None:
    other = nymphs("other", "none", "--label", "pool=b")
    pinned = _submit(plane, nymph_fns.add, 1, 2, selector={"pool": "a"})["invocation_id"]
    unknown = _submit(plane, nymph_fns.add, 1, 3, selector={"rack": "7"})["invocation_id"]
    _stays_queued(plane, pinned, 2.0)
    a = nymphs("a", "none", "--label", "pool=a")
    invs = [pinned] + [
        _submit(plane, nymph_fns.add, i, 0, selector={"pool": "a"})["invocation_id"] for i in range(5)
    ]
    outcomes = [until(lambda inv=inv: _done(plane, inv), f"{inv}") for inv in invs]
    assert {o["state"] for o in outcomes} == {"succeeded"}
    assert {o["worker_id"] for o in outcomes} == {a.worker_id} != {other.worker_id}
    assert _status(plane, unknown)["state"] == "queued"  # a label no nymph has never matches


def test_not_before_holds_a_call_until_its_time(plane: PlacedServer, nymphs: Callable[..., GpuNymph]) -> None:
    nymphs("any", "none")
    at = time.time() + 3.0
    inv = _submit(plane, nymph_fns.add, 1, 1, not_before=at)["invocation_id"]
    while time.time() < at - 0.2:
        assert _status(plane, inv)["state"] == "queued"
        time.sleep(0.1)
    st = until(lambda: _done(plane, inv), "the call after its time")
    assert st["state"] == "succeeded"
    assert at <= st["started_at"] <= at + 1.0 + 0.5  # claimed within a second (a loaded machine's slack)


def _queue_row(plane: PlacedServer, name: str) -> dict[str, Any]:
    token = plane.tokens()["admin"]
    resp = httpx.get(f"{plane.url}/v1/ops/queues", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    return next(q for q in resp.json()["queues"] if q["name"] == name)


def _lakeshore(plane: PlacedServer, *args: str) -> str:
    import subprocess

    from tests.stack.procs import child_env

    cmd = [sys.executable, "-m", "dreamlake.lakeshore.cli", *args, "--url", plane.url,
           "--token", plane.tokens()["admin"]]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_queue_limit_holds_across_the_fleet(plane: PlacedServer, nymphs: Callable[..., GpuNymph]) -> None:
    """``lakeshore queue limit batch --max-running 2`` over 3 nymphs of 4 slots: never more than 2
    running at once (sampled), every call finishes, and ``lakeshore queues`` shows the limit."""
    assert "at most 2 running" in _lakeshore(plane, "queue", "limit", "batch", "--max-running", "2")
    fleet = [nymphs(f"n{i}", "none", queue="batch", slots=4) for i in range(3)]
    invs = [_submit(plane, nymph_fns.sleep_for, 0.6, queue="batch")["invocation_id"] for _ in range(12)]
    seen: list[int] = []

    def finished() -> bool:
        row = _queue_row(plane, "batch")
        seen.append(row["running"])
        return row["counts"]["succeeded"] == len(invs)

    until(finished, "all 12 calls to finish under the limit", LIMIT_S * 2)
    assert max(seen) <= 2, seen
    assert 2 in seen  # the limit, not a single slot, is what held them back
    assert {_status(plane, inv)["state"] for inv in invs} == {"succeeded"}
    assert {_status(plane, inv)["worker_id"] for inv in invs} <= {n.worker_id for n in fleet}
    assert _queue_row(plane, "batch")["max_running"] == 2
    head, *lines = _lakeshore(plane, "queues").splitlines()
    row = next(line.split() for line in lines if line.split()[0] == "batch")
    assert row[head.split().index("LIMIT")] == "2", (head, lines)
    _lakeshore(plane, "queue", "limit", "batch", "--clear")
    assert _queue_row(plane, "batch")["max_running"] is None


def test_workers_show_capacity_and_what_is_free(
    plane: PlacedServer, nymphs: Callable[..., GpuNymph], tmp_path: Path
) -> None:
    """``lakeshore workers`` and ``/v1/ops/workers``: each nymph's GPUs (count, model), CPUs,
    memory and labels as it registered them, and the GPUs and slots free as of its latest poll."""
    big = nymphs("big", "0,1,2,3", "--label", "pool=a", slots=3)
    gate = tmp_path / "gate"
    holder = _submit(plane, nymph_fns.wait_for_file, str(gate), resources={"gpus": 3})["invocation_id"]
    until(lambda: _status(plane, holder)["state"] == "running", "the call to hold three GPUs")

    def row() -> dict[str, Any] | None:
        (w,) = [w for w in _workers(plane) if w["worker_id"] == big.worker_id]
        return w if w["free"]["gpus"] == 1 else None

    w = until(row, "the free GPUs of its poll after the claim")
    assert w["capacity"]["gpus"] == 4 and w["capacity"]["cpus"] >= 1 and w["capacity"]["memory_mb"] > 0
    assert w["free"]["slots"] == 2 and w["labels"]["pool"] == "a"
    head, *lines = _lakeshore(plane, "workers").splitlines()
    (line,) = [x for x in lines if x.startswith(big.worker_id)]
    assert "GPUS FREE" in head and " 1/4" in line and "pool=a" in line, (head, line)
    gate.write_text("go")
    until(lambda: _done(plane, holder), "the call to finish")
    until(
        lambda: next(w for w in _workers(plane) if w["worker_id"] == big.worker_id)["free"]["gpus"] == 4,
        "its next poll to offer all four GPUs again",
    )


def test_a_memory_call_waits_for_a_nymph_whose_tasks_may_have_that_much(
    plane: PlacedServer, nymphs: Callable[..., GpuNymph]
) -> None:
    """resources.memory is matched against what one task may have on a nymph (the process runner's
    --task-memory-max, held by its memory controller): never claimed by one that would refuse it."""
    small = nymphs("small", "none", "--task-memory-max", "256m")
    first = _submit(plane, nymph_fns.add, 2, 2, resources={"memory": "1g"}, max_attempts=1)
    assert "gives one task 1 GiB of memory (largest: 256 MiB)" in first.get("warning", ""), first
    inv = first["invocation_id"]
    _stays_queued(plane, inv, 2.0)
    big = nymphs("big", "none", "--task-memory-max", "2g")
    done = until(lambda: _done(plane, inv), f"{inv} to finish")
    assert (done["state"], done["worker_id"]) == ("succeeded", big.worker_id) != (None, small.worker_id)
