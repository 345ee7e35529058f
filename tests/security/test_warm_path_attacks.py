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


def _a_write_waits() -> bool:
    """Whether another thread is inside ``write_batch`` (the group commit, waiting on the lock)."""
    import sys
    import threading
    import traceback

    me = threading.get_ident()
    return any(
        any(f.name == "write_batch" for f in traceback.extract_stack(frame))
        for tid, frame in sys._current_frames().items()
        if tid != me
    )


def test_another_tenants_ack_in_the_holders_group_commit_settles_nothing(tmp_path: Path) -> None:
    """A daemon of another namespace, holding no lease, acks a call in the same group commit as the
    holder's ack of it (after a write of its own that splits the run of acks, with an ack of an
    unknown call beside it). Its ack is refused and the call's producer gets the holder's result:
    the acks' run once read its rows back and took any ack of a row this transaction finished as
    applied, and its forged result went to the call's waiters from memory."""
    import threading

    from dreamlake.lakeshore.wire.frames import FRAME_VALUE, encode_frame
    from tests.stack.wait import until

    config = ServerConfig(lease_s=600.0, expire_every_s=3600.0)
    with running_control_plane(str(tmp_path / "s.db"), config=config) as cp:
        store, writer = cp.store, cp.app.state.ctx.writer
        prod_a = store.create_token("producer", "prod-a", "team-a")
        daemon_a = store.create_token("daemon", "daemon-a", "team-a")
        daemon_b = store.create_token("daemon", "daemon-b", "team-b")  # the attacker
        inv = new_ulid()
        assert cp.call("/v1/producer/submit", submit_body(inv, "qa"), prod_a)[0] == 200
        holder, intruder = new_ulid(), new_ulid()
        poll = {"worker_id": holder, "queues": ["qa"], "timeout_s": 0, "kinds": ["run"]}
        status, out = cp.call("/v1/daemon/poll", poll, daemon_a)
        assert status == 200 and out["commands"][0]["body"]["invocation_id"] == inv, out
        assert cp.call("/v1/daemon/register", {"worker_id": intruder, "queues": ["qb"]}, daemon_b)[0] == 200
        awaited: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: awaited.update(
                r=cp.call("/v1/producer/await", {"invocation_id": inv, "timeout_s": 30}, prod_a)
            )
        )
        waiter.start()
        chunk = {
            "invocation_id": new_ulid(),
            "attempt": 1,
            "worker_id": intruder,
            "frames": [encode_frame(FRAME_VALUE, 0, b"x")],
        }

        def ack(of: str, worker: str, blob: bytes) -> dict[str, Any]:
            return {
                "invocation_id": of,
                "state": "succeeded",
                "attempt": 1,
                "worker_id": worker,
                "result_blob": blob,
            }

        sends = [
            ("blocker", "/v1/daemon/result-chunks", chunk, daemon_b),  # waits on the lock, alone
            ("holder", "/v1/daemon/ack", ack(inv, holder, wire.pack("genuine")), daemon_a),
            ("split", "/v1/daemon/result-chunks", chunk, daemon_b),
            ("forged", "/v1/daemon/ack", ack(inv, intruder, wire.pack("forged")), daemon_b),
            ("unknown", "/v1/daemon/ack", ack(new_ulid(), intruder, b""), daemon_b),
        ]
        answers: dict[str, Any] = {}
        threads = []
        with store.db.write_lock:  # what arrives meanwhile queues for one group commit, in order
            for k, (name, path, body, token) in enumerate(sends):
                t = threading.Thread(
                    target=lambda n=name, p=path, b=body, tk=token: answers.update({n: cp.call(p, b, tk)})
                )
                t.start()
                threads.append(t)
                if k == 0:  # the blocker's group commit waits on the lock: the rest queue behind it
                    until(_a_write_waits, "the blocker's write waiting on the lock")
                else:  # each queued, in order, before the next is sent
                    until(
                        lambda k=k: writer._queue is not None and writer._queue.qsize() == k,
                        f"write {k} queued",
                    )
        for t in threads:
            t.join(30)
        waiter.join(30)
        assert answers["holder"][0] == 200, answers
        assert answers["forged"][0] == 403, answers["forged"]
        status, out = awaited["r"]
        assert status == 200 and wire.unpack(out["result_blob"]) == "genuine", out
        got = store.get(inv)
        assert got is not None and (got.worker_id, wire.unpack(got.result_blob)) == (holder, "genuine")


def test_a_call_cannot_set_the_tasks_pythonpath(tmp_path: Path) -> None:
    """The container runners mount the task's PYTHONPATH (the operator's code, nymph's own): a
    producer's ``run_config.env`` naming one (a sibling task's workdir, /root) is refused at
    submit with what to do instead, and nothing is queued."""
    with running_control_plane(str(tmp_path / "s.db")) as cp:
        inv = new_ulid()
        body = submit_body(inv, "q", run_config={"env": {"PYTHONPATH": "/srv/nymph/work/other:/root"}})
        status, out = cp.call("/v1/producer/submit", body, cp.producer_token)
        assert status == 400 and "PYTHONPATH" in out["error"] and "code archive" in out["error"], out
        assert cp.store.get(inv) is None
