"""Producer routes over real HTTP: submit, status, await, cancel, result streams and topics."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import ControlPlane, submit_body
from tests.stack.wait import until


def _claim(cp: ControlPlane, worker_id: str, queue: str = "default") -> dict[str, Any]:
    status, out = cp.daemon(
        "/v1/daemon/poll",
        {"worker_id": worker_id, "queues": [queue], "max": 1, "timeout_s": 2, "version": "0.1.0"},
    )
    assert status == 200, out
    assert len(out["commands"]) == 1, out
    return out["commands"][0]  # type: ignore[no-any-return]


def _chunk(
    cp: ControlPlane, inv: str, seq: int, kind: int = wire.FRAME_VALUE, value: Any = None
) -> tuple[int, Any]:
    frame = wire.encode_frame(kind, seq, wire.pack(value if value is not None else seq), {"ts": time.time()})
    holder = cp.store.get(inv)  # the worker holding the lease posts the frames
    assert holder is not None
    return cp.daemon(
        "/v1/daemon/result-chunk",
        {
            "invocation_id": inv,
            "seq": seq,
            "bytes": frame,
            "final": kind in (wire.FRAME_END, wire.FRAME_ERROR),
            "worker_id": holder.worker_id,
            "attempt": holder.attempt,
        },
    )


def _read_stream(cp: ControlPlane, url: str) -> list[wire.Frame]:
    reader = wire.FrameReader()
    frames: list[wire.Frame] = []
    with (
        httpx.Client(base_url=cp.url, timeout=30) as c,
        c.stream("GET", url, headers={"Authorization": f"Bearer {cp.producer_token}"}) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-msgpack-stream")
        for chunk in resp.iter_bytes():
            frames.extend(reader.feed(chunk))
    return frames


def _serve(cp: ControlPlane, queue: str) -> None:
    """A live worker serving ``queue``: a submit to it answers the seed's body, with no warning."""
    status, _ = cp.daemon("/v1/daemon/register", {"worker_id": new_ulid(), "queues": [queue]})
    assert status == 200


def test_submit_answers_seed_body_and_status_shows_row(control_plane: ControlPlane) -> None:
    _serve(control_plane, "gpu")
    inv = new_ulid()
    status, out = control_plane.producer(
        "/v1/producer/submit", submit_body(inv, "gpu", run_config={"priority": 2.7})
    )
    assert (status, out) == (200, {"invocation_id": inv, "queue": "gpu"})
    status, row = control_plane.producer(f"/v1/producer/invocations/{inv}", None, method="GET")
    assert status == 200
    assert row["state"] == "queued" and row["queue"] == "gpu" and row["priority"] == 2
    assert row["attempt"] == 0 and row["max_attempts"] == 3
    assert set(row) == {
        "invocation_id",
        "state",
        "queue",
        "priority",
        "attempt",
        "max_attempts",
        "worker_id",
        "submitted_at",
        "started_at",
        "finished_at",
        "error",
        "parent_invocation_id",
        "root_invocation_id",
        "retry_at",  # issue 12: when a retry waiting for its backoff becomes claimable
        "attempts",  # issue 12: each attempt's outcome
        "children",
        "preemptions",  # issue 30: attempts a stopping host handed back (they spend no max_attempts)
        "handbacks",  # attempts handed back before they started (they spend nothing)
    }
    assert row["children"] == [] and row["preemptions"] == 0 and row["handbacks"] == 0


def test_submit_with_same_key_is_duplicate(control_plane: ControlPlane) -> None:
    _serve(control_plane, "default")
    first = control_plane.submit(run_config={"key": "k-1"})
    status, out = control_plane.producer(
        "/v1/producer/submit", submit_body(new_ulid(), run_config={"key": "k-1"})
    )
    assert status == 200
    assert out == {"invocation_id": first, "queue": "default", "duplicate": True}


def test_submit_defaults_queue_and_resolves_root(control_plane: ControlPlane) -> None:
    parent = control_plane.submit()
    body = submit_body(new_ulid(), parent_invocation_id=parent)
    del body["queue"]
    body["run_config"] = {}
    status, out = control_plane.producer("/v1/producer/submit", body)
    assert status == 200 and out["queue"] == "default"
    _, row = control_plane.producer(f"/v1/producer/invocations/{out['invocation_id']}", None, method="GET")
    assert row["parent_invocation_id"] == parent and row["root_invocation_id"] == parent


def test_await_answers_pending_on_timeout_then_outcome(control_plane: ControlPlane) -> None:
    _serve(control_plane, "default")
    inv = control_plane.submit()
    status, out = control_plane.producer("/v1/producer/await", {"invocation_id": inv, "timeout_s": 0.2})
    assert (status, out) == (200, {"state": "pending"})
    worker = new_ulid()
    _claim(control_plane, worker)
    answer: dict[str, Any] = {}

    def wait() -> None:
        answer["r"] = control_plane.producer("/v1/producer/await", {"invocation_id": inv, "timeout_s": 20})

    t = threading.Thread(target=wait)
    t.start()
    until(lambda: _awaiting(control_plane, inv), "the await to be waiting")
    status, _ = control_plane.daemon(
        "/v1/daemon/ack",
        {
            "invocation_id": inv,
            "state": "succeeded",
            "result_blob": wire.pack(42),
            "error": None,
            "worker_id": worker,
            "attempt": 1,
        },
    )
    assert status == 200
    t.join(20)
    assert answer["r"] == (200, {"state": "succeeded", "result_blob": wire.pack(42), "error": None})


def test_await_unknown_is_404(control_plane: ControlPlane) -> None:
    status, out = control_plane.producer("/v1/producer/await", {"invocation_id": new_ulid(), "timeout_s": 0})
    assert status == 404 and "unknown invocation" in out["error"]


def test_cancel_queued_is_immediate(control_plane: ControlPlane) -> None:
    inv = control_plane.submit()
    status, out = control_plane.producer(f"/v1/producer/invocations/{inv}/cancel", {})
    assert (status, out) == (200, {"invocation_id": inv, "state": "cancelled"})
    status, out = control_plane.producer("/v1/producer/await", {"invocation_id": inv, "timeout_s": 1})
    assert out["state"] == "cancelled"


def test_cancel_running_reaches_worker_by_heartbeat(control_plane: ControlPlane) -> None:
    inv = control_plane.submit()
    worker = new_ulid()
    _claim(control_plane, worker)
    status, out = control_plane.producer(f"/v1/producer/invocations/{inv}/cancel", {})
    assert (status, out["state"]) == (200, "running")
    status, hb = control_plane.daemon(
        "/v1/daemon/heartbeat",
        {"worker_id": worker, "free_slots": 0, "running": [{"invocation_id": inv, "attempt": 1}]},
    )
    assert status == 200 and hb["ok"] is True and hb["lost"] == []
    assert [(c["kind"], c["body"]["invocation_id"]) for c in hb["commands"]] == [("cancel", inv)]
    status, _ = control_plane.daemon(
        "/v1/daemon/ack",
        {
            "invocation_id": inv,
            "state": "killed",
            "attempt": 1,
            "worker_id": worker,
            "error": {"type": "Cancelled", "message": "cancelled by producer"},
        },
    )
    assert status == 200
    _, row = control_plane.producer(f"/v1/producer/invocations/{inv}", None, method="GET")
    assert row["state"] == "killed" and row["error"]["type"] == "Cancelled"


def test_stream_replays_then_follows_and_ends_on_end(control_plane: ControlPlane) -> None:
    inv = control_plane.submit()
    _claim(control_plane, new_ulid())
    for seq in (0, 1):
        assert _chunk(control_plane, inv, seq)[0] == 200
    got: list[wire.Frame] = []
    t = threading.Thread(
        target=lambda: got.extend(
            _read_stream(control_plane, f"/v1/producer/invocations/{inv}/result/stream?since=-1&timeout=20")
        )
    )
    t.start()
    until(lambda: _subscribers(control_plane, inv), "the stream to follow")
    assert _chunk(control_plane, inv, 2)[0] == 200
    assert _chunk(control_plane, inv, 3, wire.FRAME_END, "done")[0] == 200
    t.join(25)
    assert not t.is_alive()
    assert [(f.kind, f.seq) for f in got] == [(1, 0), (1, 1), (1, 2), (2, 3)]
    tail = _read_stream(control_plane, f"/v1/producer/invocations/{inv}/result/stream?since=1&timeout=5")
    assert [f.seq for f in tail] == [2, 3]


def test_stream_ends_on_silence_and_on_terminal_state(control_plane: ControlPlane) -> None:
    inv = control_plane.submit()
    frames = _read_stream(control_plane, f"/v1/producer/invocations/{inv}/result/stream?timeout=0.3")
    assert frames == []
    control_plane.producer(f"/v1/producer/invocations/{inv}/cancel", {})
    frames = _read_stream(control_plane, f"/v1/producer/invocations/{inv}/result/stream?timeout=30")
    assert frames == []  # cancelled, nothing journaled: ends at once instead of waiting 30 s


def test_topic_post_and_stream(control_plane: ControlPlane) -> None:
    for i in range(3):
        status, out = control_plane.producer("/v1/producer/topics/progress/post", {"body": wire.pack(i)})
        assert (status, out) == (200, {"seq": i})
    status, out = control_plane.producer(
        "/v1/producer/topics/progress/post", {"body": wire.pack(None), "final": True}
    )
    assert out == {"seq": 3}
    frames = _read_stream(control_plane, "/v1/producer/topics/progress/stream?since=0&timeout=5")
    seen = [(f.kind, f.seq, wire.unpack(f.body)) for f in frames if isinstance(f.body, bytes)]
    assert seen == [(1, 1, 1), (1, 2, 2), (2, 3, None)]


def test_topic_stream_follows_live_posts(control_plane: ControlPlane) -> None:
    got: list[wire.Frame] = []
    t = threading.Thread(
        target=lambda: got.extend(_read_stream(control_plane, "/v1/producer/topics/live.1/stream?timeout=20"))
    )
    t.start()
    until(lambda: _subscribers(control_plane, "topic:live.1"), "the topic's stream to follow")
    control_plane.producer("/v1/producer/topics/live.1/post", {"body": wire.pack("a")})
    control_plane.producer("/v1/producer/topics/live.1/post", {"body": wire.pack(None), "final": True})
    t.join(25)
    assert [f.kind for f in got] == [wire.FRAME_VALUE, wire.FRAME_END]


def _awaiting(cp: ControlPlane, invocation_id: str) -> bool:
    """Whether an ``/await`` of ``invocation_id`` waits on the server's wake-ups now."""
    return bool(cp.app.state.ctx.wake.notifier._async.get(f"inv:{invocation_id}"))


def _subscribers(cp: ControlPlane, owner_id: str) -> int:
    """How many streams follow ``owner_id`` live (an invocation id, or ``topic:<name>``)."""
    return int(cp.app.state.ctx.fanout.subscriber_count(owner_id))
