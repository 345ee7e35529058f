"""Daemon routes over real HTTP: register, poll (long poll, concurrency), ack, result-chunk, heartbeat."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import Conflict
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.protocol.limits import ServerLimits
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import ControlPlane, running_control_plane
from tests.integration.daemon_kit import follow, frame, poll


def test_register_answers_lease_and_heartbeat(control_plane: ControlPlane) -> None:
    worker = new_ulid()
    status, out = control_plane.daemon(
        "/v1/daemon/register",
        {
            "worker_id": worker,
            "hostname": "h1",
            "version": "0.1.0",
            "runner": "process",
            "queues": ["default", "gpu"],
            "labels": {"zone": "a"},
            "slots": 2,
        },
    )
    limits = out.pop("limits")  # what the control plane allows, as GET /v1/ops/info says it
    assert (status, out) == (200, {"worker_id": worker, "lease_s": 30.0, "heartbeat_s": 10.0})
    assert limits["acks_per_poll"] == 256 and limits["inline_threshold_bytes"] is None  # no payload store
    assert limits["max_payload_bytes"] == 100 * 2**20  # MAX_PAYLOAD_BYTES: nymph sizes checkpoints by it
    assert set(limits) == {f.name for f in fields(ServerLimits)}  # every limit the client side knows


def test_run_command_body_is_exact(control_plane: ControlPlane) -> None:
    parent = control_plane.submit("other")
    inv = control_plane.submit(
        "render",
        run_config={
            "prefix": "scenes/0007",
            "script": "echo hi",
            "as_user": "alice",
            "timeout_s": 5,
            "custom": [1],
        },
        args_blob=b"ENVELOPE",
        parent_invocation_id=parent,
    )
    out = poll(control_plane, new_ulid(), ["render"])
    assert "target_nymph_version" not in out
    (cmd,) = out["commands"]
    assert cmd["kind"] == "run" and len(cmd["id"]) == 26
    token = cmd["body"].pop("task_token")  # the invocation's own credential (test_task_submit.py)
    assert isinstance(token, str) and token.startswith("lst_")
    assert cmd["body"] == {
        "invocation_id": inv,
        "function": {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"},
        "args_blob": b"ENVELOPE",
        "namespace": "default",
        "run_config": {
            "queue": "render",
            "priority": 0.0,
            "key": None,
            "prefix": "scenes/0007",
            "script": "echo hi",
            "as_user": "alice",
            "timeout_s": 5,
            "custom": [1],
        },
        "prefix": "scenes/0007",
        "attempt": 1,
        "parent_invocation_id": parent,
        "root_invocation_id": parent,
        "script": "echo hi",
        "as_user": "alice",
        "timeout_s": 5,
    }
    plain = control_plane.submit("plain")
    (cmd,) = poll(control_plane, new_ulid(), ["plain"])["commands"]
    assert set(cmd["body"]) == {
        "invocation_id",
        "function",
        "args_blob",
        "run_config",
        "namespace",
        "attempt",
        "task_token",
    }
    assert cmd["body"]["invocation_id"] == plain


def test_poll_times_out_empty_and_claims_best_first(control_plane: ControlPlane) -> None:
    worker = new_ulid()
    assert poll(control_plane, worker, timeout_s=0.2) == {"commands": []}
    low = control_plane.submit(run_config={"priority": 0})
    high = control_plane.submit(run_config={"priority": 5})
    out = poll(control_plane, worker, limit=5)
    assert [c["body"]["invocation_id"] for c in out["commands"]] == [high, low]


def test_waiting_poll_gets_job_submitted_after_it_started(control_plane: ControlPlane) -> None:
    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(poll(control_plane, new_ulid(), ["late"], timeout_s=20))
    )
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    inv = control_plane.submit("late")
    t.join(20)
    assert [c["body"]["invocation_id"] for c in result["commands"]] == [inv]


def test_concurrent_pollers_never_share_an_invocation(control_plane: ControlPlane) -> None:
    submitted = {control_plane.submit("race") for _ in range(24)}

    def drain(_: int) -> list[str]:
        worker = new_ulid()
        got: list[str] = []
        with httpx.Client(
            base_url=control_plane.url,
            timeout=30,
            headers={"Authorization": f"Bearer {control_plane.daemon_token}"},
        ) as c:
            while True:
                body = {"worker_id": worker, "queues": ["race"], "max": 2, "timeout_s": 0}
                r = c.post("/v1/daemon/poll", content=msgpack.packb(body))
                cmds = msgpack.unpackb(r.content)["commands"]
                if not cmds:
                    return got
                got.extend(cmd["body"]["invocation_id"] for cmd in cmds)

    with ThreadPoolExecutor(8) as pool:
        claims = [i for got in pool.map(drain, range(8)) for i in got]
    assert len(claims) == len(set(claims)) == len(submitted)
    assert set(claims) == submitted


def test_ack_bare_string_error_becomes_daemon_error(control_plane: ControlPlane) -> None:
    inv = control_plane.submit()
    worker = new_ulid()
    poll(control_plane, worker)
    lease = {"worker_id": worker, "attempt": 1}
    status, out = control_plane.daemon(
        "/v1/daemon/ack",
        {"invocation_id": inv, "state": "failed", "result_blob": b"", "error": "runner crashed", **lease},
    )
    assert (status, out) == (200, {"ok": True})
    _, row = control_plane.producer(f"/v1/producer/invocations/{inv}", None, method="GET")
    assert row["state"] == "failed"
    assert row["error"] == {"type": "DaemonError", "message": "runner crashed"}
    assert row["finished_at"] is not None
    status, out = control_plane.daemon(
        "/v1/daemon/ack",
        {"invocation_id": inv, "state": "failed", "result_blob": b"", "error": "runner crashed", **lease},
    )
    assert (status, out) == (200, {"ok": True, "duplicate": True})


def test_ack_superseded_is_409_and_unknown_404(control_plane: ControlPlane) -> None:
    inv = control_plane.submit()
    worker = new_ulid()
    poll(control_plane, worker)
    status, out = control_plane.daemon(
        "/v1/daemon/ack",
        {"invocation_id": inv, "state": "succeeded", "result_blob": b"x", "attempt": 7, "worker_id": worker},
    )
    assert status == 409 and out["ok"] is False and "superseded" in out["error"]
    status, out = control_plane.daemon(
        "/v1/daemon/ack",
        {"invocation_id": new_ulid(), "state": "succeeded", "attempt": 1, "worker_id": worker},
    )
    assert status == 404
    status, out = control_plane.daemon("/v1/daemon/ack", {"invocation_id": inv, "state": "running"})
    assert status == 400 and "cannot ack state" in out["error"]


class RecordingFanout:
    """Counts live publishes (the seam the result-chunk route publishes through)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, int, bool]] = []

    async def publish(self, owner_id: str, seq: int, data: bytes, final: bool) -> None:
        self.published.append((owner_id, seq, final))


def test_result_chunk_journals_once_and_publishes_once(tmp_path: Any) -> None:
    fanout = RecordingFanout()
    with running_control_plane(str(tmp_path / "s.db"), fanout=fanout) as cp:
        inv = cp.submit()
        worker = new_ulid()
        poll(cp, worker)
        body = {
            "invocation_id": inv,
            "seq": 0,
            "bytes": frame(0),
            "final": False,
            "attempt": 1,
            "worker_id": worker,
        }
        assert cp.daemon("/v1/daemon/result-chunk", body) == (200, {"ok": True, "seq": 0})
        assert cp.daemon("/v1/daemon/result-chunk", body) == (200, {"ok": True, "seq": 0, "duplicate": True})
        assert fanout.published == [(inv, 0, False)]
        assert [f.seq for f in cp.store.read_frames(inv)] == [0]
        bad = {**body, "seq": 1}  # the frame inside still says seq 0
        status, out = cp.daemon("/v1/daemon/result-chunk", bad)
        assert status == 400 and "seq" in out["error"]
        status, out = cp.daemon("/v1/daemon/result-chunk", {**body, "seq": 1, "bytes": b"\xc1garbage"})
        assert status == 400
        stale = {**body, "seq": 1, "bytes": frame(1), "attempt": 9}
        status, out = cp.daemon("/v1/daemon/result-chunk", stale)
        assert status == 409 and out["ok"] is False
        assert fanout.published == [(inv, 0, False)]


@pytest.mark.parametrize("closing", [wire.FRAME_END, wire.FRAME_ERROR])
def test_end_or_error_closes_the_stream_whatever_final_says(
    control_plane: ControlPlane, closing: int
) -> None:
    """Seed 000: an explicit END/ERROR frame closes the stream, also when posted with "final": false.
    The probe is a frame journaled after it: a stream that stayed open would send it too."""
    from dreamlake.lakeshore.dispatch import Dispatch
    from dreamlake.lakeshore.envelope import Envelope, fn_for

    kinds = [wire.FRAME_VALUE, closing, wire.FRAME_VALUE]
    closed = [(0, wire.FRAME_VALUE), (1, closing)]
    cp = control_plane
    inv = cp.submit()
    worker = new_ulid()
    poll(cp, worker)  # running, and stays so: no ack ends the stream for it
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        live = pool.submit(follow, cp, inv, 20.0, started)  # a follower waiting for the frames
        assert started.wait(30)
        for seq, kind in enumerate(kinds[:2]):
            body = {"invocation_id": inv, "seq": seq, "bytes": frame(seq, kind), "final": False, "attempt": 1}
            body["worker_id"] = worker
            assert cp.daemon("/v1/daemon/result-chunk", body) == (200, {"ok": True, "seq": seq})
        # issue 11: nothing is journaled after a final frame (the probe is refused, and says why)
        body = {
            "invocation_id": inv,
            "seq": 2,
            "bytes": frame(2, kinds[2]),
            "attempt": 1,
            "worker_id": worker,
        }
        status, out = cp.daemon("/v1/daemon/result-chunk", body)
        assert status == 409 and "ended with final frame 1" in out["error"]
        assert live.result() == closed
    assert follow(cp, inv, 20.0) == closed  # a replay stops there too
    assert [f.final for f in cp.store.read_frames(inv)] == [False, True]

    # the local plane agrees
    with Dispatch(":memory:") as local:
        inv = local.submit(Envelope.create(fn_for(len)), "default", {})
        local_worker = new_ulid()
        claim = local.claim(local_worker, ["default"], 5.0)
        assert claim is not None
        for seq, kind in enumerate(kinds[:2]):
            local.append_frame(inv, seq, frame(seq, kind), False, claim.attempt, worker_id=local_worker)
        with pytest.raises(Conflict, match="ended with final frame 1"):
            local.append_frame(inv, 2, frame(2, kinds[2]), False, claim.attempt, worker_id=local_worker)
        assert [(f.seq, f.kind) for f in local.frames(inv, timeout=20.0)] == closed


def test_result_chunk_for_unknown_invocation_is_404(control_plane: ControlPlane) -> None:
    status, _ = control_plane.daemon(
        "/v1/daemon/result-chunk",
        {
            "invocation_id": new_ulid(),
            "seq": 0,
            "bytes": frame(0),
            "final": False,
            "attempt": 1,
            "worker_id": new_ulid(),
        },
    )
    assert status == 404


def test_heartbeat_reports_lost_and_pin(control_plane: ControlPlane) -> None:
    worker = new_ulid()
    control_plane.daemon(
        "/v1/daemon/register", {"worker_id": worker, "queues": ["default"], "namespace": "team-a"}
    )
    inv = control_plane.submit()
    poll(control_plane, worker)
    gone = new_ulid()
    status, out = control_plane.daemon(
        "/v1/daemon/heartbeat",
        {
            "worker_id": worker,
            "free_slots": 0,
            "running": [{"invocation_id": inv, "attempt": 1}, {"invocation_id": gone, "attempt": 1}],
        },
    )
    assert status == 200
    assert out == {"ok": True, "lease_s": 30.0, "commands": [], "lost": [gone]}
    status, _ = control_plane.json(
        "PUT", "/v1/namespaces/team-a/pin", {"nymph_version": "0.1.4"}, control_plane.admin_token
    )
    assert status == 200
    _, out = control_plane.daemon("/v1/daemon/heartbeat", {"worker_id": worker, "running": []})
    assert out["target_nymph_version"] == "0.1.4"
    assert poll(control_plane, worker, timeout_s=0)["target_nymph_version"] == "0.1.4"
    other = new_ulid()
    assert "target_nymph_version" not in poll(control_plane, other, timeout_s=0)


@pytest.mark.parametrize("lease_s", [0.4])
def test_lapsed_lease_requeues_then_fails(tmp_path: Any, lease_s: float) -> None:
    config = ServerConfig(lease_s=lease_s, expire_every_s=0.1, recheck_s=0.2)
    with running_control_plane(str(tmp_path / "s.db"), config=config) as cp:
        inv = cp.submit(run_config={"max_attempts": 2})
        first = new_ulid()
        (cmd,) = poll(cp, first)["commands"]
        assert cmd["body"]["attempt"] == 1
        (cmd,) = poll(cp, new_ulid(), timeout_s=10)["commands"]  # wakes when the lease lapses
        assert cmd["body"]["invocation_id"] == inv and cmd["body"]["attempt"] == 2
        status, out = cp.daemon(
            "/v1/daemon/ack", {"invocation_id": inv, "state": "succeeded", "attempt": 1, "worker_id": first}
        )
        assert status == 409
        status, out = cp.producer("/v1/producer/await", {"invocation_id": inv, "timeout_s": 10})
        assert out["state"] == "failed" and out["error"]["type"] == "LeaseExpired"


def test_poll_of_a_daemon_that_hung_up_claims_nothing(control_plane: ControlPlane) -> None:
    gone, live = new_ulid(), new_ulid()
    body = {"worker_id": gone, "queues": ["hangup"], "max": 1, "timeout_s": 60}
    with (
        httpx.Client(
            base_url=control_plane.url,
            timeout=0.5,  # the daemon gives up long before the poll would end
            headers={"Authorization": f"Bearer {control_plane.daemon_token}"},
        ) as c,
        pytest.raises(httpx.ReadTimeout),
    ):
        c.post("/v1/daemon/poll", content=msgpack.packb(body))
    # The abandoned poll is still waiting server-side; a submit wakes it, and it must not claim.
    inv = control_plane.submit("hangup")
    (cmd,) = poll(control_plane, live, ["hangup"], timeout_s=10)["commands"]
    assert cmd["body"]["invocation_id"] == inv and cmd["body"]["attempt"] == 1
    row = control_plane.store.get(inv)
    assert row is not None and row.worker_id == live and row.attempt == 1


def test_claimed_but_undelivered_work_comes_back_when_the_lease_lapses(tmp_path: Any) -> None:
    """A claim whose answer never reached the daemon (it hung up after the claim) is not lost."""
    config = ServerConfig(lease_s=0.3, expire_every_s=0.1, recheck_s=0.2)
    with running_control_plane(str(tmp_path / "s.db"), config=config) as cp:
        inv = cp.submit()
        lost = new_ulid()
        cp.store.claim(lost, ["default"], 1, 0.3)  # claimed; the answer is dropped on the floor
        (cmd,) = poll(cp, new_ulid(), timeout_s=10)["commands"]
        assert cmd["body"]["invocation_id"] == inv and cmd["body"]["attempt"] == 2


def test_integers_past_their_column_are_400_not_500(control_plane: ControlPlane) -> None:
    inv = control_plane.submit("bounds")
    worker = new_ulid()
    poll(control_plane, worker, ["bounds"], timeout_s=0)
    huge = 2**64 - 1  # msgpack's largest int: the driver overflowed (500) on it
    status, out = control_plane.daemon(
        "/v1/daemon/ack", {"invocation_id": inv, "state": "succeeded", "attempt": huge, "worker_id": worker}
    )
    assert status == 400 and "field 'attempt' must be between 0 and" in out["error"]
    status, out = control_plane.daemon(
        "/v1/daemon/result-chunk",
        {"invocation_id": inv, "seq": huge, "bytes": frame(huge), "attempt": 1, "worker_id": worker},
    )
    assert status == 400 and "field 'seq' must be between 0 and" in out["error"]
    status, out = control_plane.daemon(
        "/v1/daemon/heartbeat", {"worker_id": worker, "running": [{"invocation_id": inv, "attempt": huge}]}
    )
    assert status == 400 and "running[].attempt" in out["error"]
    # PostgreSQL takes at most 65535 bind parameters in one statement (a 500 before the cap)
    many = [{"invocation_id": new_ulid(), "attempt": 1} for _ in range(40_000)]
    status, out = control_plane.daemon("/v1/daemon/heartbeat", {"worker_id": worker, "running": many})
    assert status == 400 and "the limit is 4096" in out["error"]
    status, out = control_plane.daemon("/v1/daemon/register", {"worker_id": worker, "slots": huge})
    assert status == 400 and "field 'slots'" in out["error"]


def test_a_namespace_bound_daemon_claims_only_its_namespaces_exec_jobs(control_plane: ControlPlane) -> None:
    cp = control_plane
    for ns in ("team-b", "team-a"):
        status, _ = cp.json(
            "POST", f"/v1/namespaces/{ns}/exec", {"command": "true", "queue": "nsq"}, cp.admin_token
        )
        assert status == 202
    bound = cp.store.create_token("daemon", "a-daemon", namespace="team-a")
    body = {"worker_id": new_ulid(), "queues": ["nsq"], "max": 4, "timeout_s": 0}
    status, out = cp.call("/v1/daemon/poll", body, bound)
    assert status == 200
    assert [c["body"]["namespace"] for c in out["commands"]] == ["team-a"]
    # an unbound daemon token serves every namespace (as a worker of its own: ids are bound per token)
    _, out = cp.daemon("/v1/daemon/poll", {**body, "worker_id": new_ulid()})
    assert [c["body"]["namespace"] for c in out["commands"]] == ["team-b"]


def test_a_poll_for_run_commands_only_leaves_exec_jobs_queued(control_plane: ControlPlane) -> None:
    cp = control_plane
    status, out = cp.json(
        "POST", "/v1/namespaces/ns/exec", {"command": "true", "queue": "runonly"}, cp.admin_token
    )
    assert status == 202
    body = {"worker_id": new_ulid(), "queues": ["runonly"], "timeout_s": 0, "kinds": ["run"]}
    assert cp.daemon("/v1/daemon/poll", body) == (200, {"commands": []})
    status, err = cp.daemon("/v1/daemon/poll", {**body, "kinds": ["exec"]})
    assert status == 400 and "'kinds' must include 'run'" in err["error"]
    _, got = cp.daemon("/v1/daemon/poll", {**body, "kinds": ["run", "exec"]})
    assert [c["body"]["exec_id"] for c in got["commands"]] == [out["exec_id"]]


# -- exec job leases and the daemon's namespace across replicas ---------------------------------


def _exec(cp: ControlPlane, **extra: Any) -> str:
    status, out = cp.json(
        "POST", "/v1/namespaces/ns/exec", {"command": "true", "queue": "xq", **extra}, cp.admin_token
    )
    assert status == 202
    return str(out["exec_id"])


def _exec_result(cp: ControlPlane, exec_id: str, wait: float = 0) -> tuple[int, Any]:
    return cp.json("GET", f"/v1/namespaces/ns/jobs/{exec_id}/result?wait={wait}", None, cp.admin_token)


def test_a_dead_daemons_exec_job_is_requeued_then_failed(tmp_path: Any) -> None:
    """The review's finding: an exec job whose daemon died stayed ``running`` for ever."""
    config = ServerConfig(lease_s=0.4, expire_every_s=0.1, recheck_s=0.2)
    with running_control_plane(str(tmp_path / "s.db"), config=config) as cp:
        exec_id = _exec(cp, max_attempts=2)
        dead = new_ulid()
        (cmd,) = poll(cp, dead, ["xq"])["commands"]
        assert cmd["kind"] == "exec" and cmd["body"]["attempt"] == 1
        second = new_ulid()
        (cmd,) = poll(cp, second, ["xq"], timeout_s=10)["commands"]  # wakes when the lease lapses
        assert cmd["body"]["exec_id"] == exec_id and cmd["body"]["attempt"] == 2
        route = f"/v1/namespaces/ns/jobs/{exec_id}/result"
        late = {"exit_code": 0, "stdout": "", "stderr": "", "worker_id": dead, "attempt": 1}
        status, out = cp.json("POST", route, late, cp.daemon_token)
        assert status == 409 and out["ok"] is False
        # the second daemon dies too: its last allowed attempt lapses, and the client hears so
        status, out = _exec_result(cp, exec_id, wait=10)
        assert status == 200 and out["exit_code"] == -1
        assert "stopped renewing its lease" in out["stderr"]


def test_the_heartbeat_renews_exec_leases(tmp_path: Any) -> None:
    # a lease long enough that a heartbeat every 0.2 s renews it even on a loaded machine (the suite
    # runs in parallel: a heartbeat's answer can take a second there)
    config = ServerConfig(lease_s=2.5, expire_every_s=0.1, recheck_s=0.2)
    with running_control_plane(str(tmp_path / "s.db"), config=config) as cp:
        exec_id = _exec(cp, max_attempts=1)
        worker = new_ulid()
        (_cmd,) = poll(cp, worker, ["xq"])["commands"]
        gone = new_ulid()
        beat = {"worker_id": worker, "running": [], "running_exec": [{"exec_id": exec_id, "attempt": 1}]}
        for _ in range(38):  # 7.6 s: three leases' worth
            status, out = cp.daemon("/v1/daemon/heartbeat", beat)
            assert status == 200 and out["lost"] == []
            time.sleep(0.2)
        assert cp.store.get_exec("ns", exec_id)["state"] == "running"  # type: ignore[index]
        status, out = cp.daemon(
            "/v1/daemon/heartbeat",
            {"worker_id": worker, "running": [], "running_exec": [{"exec_id": gone, "attempt": 1}]},
        )
        assert status == 200 and out["lost"] == [gone]
        for bad in ([{"exec_id": "x", "attempt": 1}], [{"exec_id": exec_id, "attempt": True}], ["x"], "x"):
            status, out = cp.daemon("/v1/daemon/heartbeat", {"worker_id": worker, "running_exec": bad})
            assert status == 400, bad
        route = f"/v1/namespaces/ns/jobs/{exec_id}/result"
        done = {"exit_code": 0, "stdout": "ok", "stderr": "", "worker_id": worker, "attempt": 1}
        assert cp.json("POST", route, done, cp.daemon_token) == (200, {"ok": True})
        assert _exec_result(cp, exec_id)[1]["stdout"] == "ok"


def test_a_replica_that_missed_the_register_knows_the_daemons_namespace(tmp_path: Any) -> None:
    """The namespace a daemon registered with comes from the store, not one replica's memory."""
    path = str(tmp_path / "shared.db")
    with running_control_plane(path) as a, running_control_plane(path) as b:
        b.daemon_token = a.daemon_token  # one daemon (a worker id is bound to the token that registered it)
        worker = new_ulid()
        status, _ = a.daemon(
            "/v1/daemon/register", {"worker_id": worker, "queues": ["default"], "namespace": "team-a"}
        )
        assert status == 200
        status, _ = a.json("PUT", "/v1/namespaces/team-a/pin", {"nymph_version": "0.1.4"}, a.admin_token)
        assert status == 200
        for replica in (b, a):
            _, out = replica.daemon("/v1/daemon/heartbeat", {"worker_id": worker, "running": []})
            assert out["target_nymph_version"] == "0.1.4"
            assert poll(replica, worker, timeout_s=0)["target_nymph_version"] == "0.1.4"
        # a re-register elsewhere (another namespace) is seen by every replica at once
        b.daemon("/v1/daemon/register", {"worker_id": worker, "queues": ["default"], "namespace": "team-b"})
        _, out = a.daemon("/v1/daemon/heartbeat", {"worker_id": worker, "running": []})
        assert "target_nymph_version" not in out
