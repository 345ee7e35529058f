"""The warm path's fields from the attacker's side: ``wait_s`` on a task's submit never reveals the
outcome of an invocation the task does not descend to (a keyed duplicate of someone else's), and
acks carried by a poll are the poll's worker's only (another worker's lease: 403, nothing changed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body

SECRET = wire.pack("the other invocation's result")


def _claim(cp: ControlPlane, queue: str) -> tuple[str, dict[str, Any]]:
    worker = new_ulid()
    body = {"worker_id": worker, "queues": [queue], "timeout_s": 0, "kinds": ["run"]}
    status, out = cp.daemon("/v1/daemon/poll", body)
    assert status == 200 and len(out["commands"]) == 1, out
    return worker, out["commands"][0]["body"]


def test_a_tasks_wait_on_a_keyed_duplicate_it_does_not_descend_to_reveals_nothing(tmp_path: Path) -> None:
    with running_control_plane(str(tmp_path / "s.db"), config=ServerConfig(lease_s=3600.0)) as cp:
        cp.submit("tasks")
        _worker, parent = _claim(cp, "tasks")
        task_token = parent["task_token"]
        other = cp.submit("q2", run_config={"key": "k"})  # not the task's descendant
        worker, claimed = _claim(cp, "q2")
        assert claimed["invocation_id"] == other
        ack = {
            "invocation_id": other,
            "state": "succeeded",
            "result_blob": SECRET,
            "worker_id": worker,
            "attempt": 1,
        }
        assert cp.daemon("/v1/daemon/ack", ack)[0] == 200
        body = {**submit_body(new_ulid(), "q2", run_config={"key": "k"}), "wait_s": 1}
        status, out = cp.call("/v1/producer/submit", None, task_token, raw=msgpack.packb(body))
        assert SECRET not in msgpack.packb(out)
        # the key matched the other invocation: the wait is refused as the await would be
        assert status == 403 and "outcome" not in out, out
        assert "reaches only the invocations its task submitted" in out["error"]
        got = cp.store.get(other)
        assert got is not None and got.state == "succeeded"


def test_acks_on_a_poll_cannot_settle_another_workers_lease(tmp_path: Path) -> None:
    with running_control_plane(str(tmp_path / "s.db")) as cp:
        inv = cp.submit("q")
        holder, _ = _claim(cp, "q")
        intruder = new_ulid()
        ack = {"invocation_id": inv, "state": "succeeded", "result_blob": SECRET, "attempt": 1}
        body = {"worker_id": intruder, "queues": ["q"], "timeout_s": 0, "acks": [ack]}
        status, out = cp.daemon("/v1/daemon/poll", body)
        assert status == 200 and [a["status"] for a in out["acked"]] == [403]
        got = cp.store.get(inv)
        assert got is not None and (got.state, got.worker_id, got.result_blob) == ("running", holder, None)
        # another daemon token may not even poll as the holder
        other = cp.store.create_token("daemon", "intruder")
        status, _ = cp.call("/v1/daemon/poll", {**body, "worker_id": holder}, other)
        assert status == 403
        got = cp.store.get(inv)
        assert got is not None and got.state == "running"
