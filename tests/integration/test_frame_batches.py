"""Frames in batches: ``POST /v1/daemon/result-chunks`` and ``store.append_frames`` (both stores),
and live followers fed from memory (the fan-out), falling back to the journal when they lag."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.fanout import POKE, LocalFanout
from tests.integration.conftest import ControlPlane, running_control_plane
from tests.integration.daemon_kit import follow, frame, poll

CHUNKS = "/v1/daemon/result-chunks"


def _claimed(cp: ControlPlane) -> tuple[str, str]:
    inv = cp.submit()
    worker = new_ulid()
    assert len(poll(cp, worker)["commands"]) == 1
    return inv, worker


def _batch(cp: ControlPlane, inv: str, worker: str, seqs: list[int], **extra: Any) -> tuple[int, Any]:
    kinds = extra.pop("kinds", {})
    body = {
        "invocation_id": inv,
        "attempt": 1,
        "worker_id": worker,
        "frames": [frame(s, kinds.get(s, wire.FRAME_VALUE)) for s in seqs],
        **extra,
    }
    return cp.daemon(CHUNKS, body)


def _answers(out: dict[str, Any]) -> list[tuple[int, bool]]:
    return [(r["seq"], r["duplicate"]) for r in out["results"]]


def test_a_batch_is_journaled_in_order_and_answers_per_seq(control_plane: ControlPlane) -> None:
    cp = control_plane
    inv, worker = _claimed(cp)
    status, out = _batch(cp, inv, worker, [0])  # the first frame goes alone, at once
    assert status == 200 and out["ok"] is True and _answers(out) == [(0, False)]
    status, out = _batch(cp, inv, worker, [1, 2, 3])
    assert _answers(out) == [(1, False), (2, False), (3, False)]
    # a retried batch overlapping the journal, with a repeat inside the batch
    status, out = _batch(cp, inv, worker, [2, 3, 4, 4, 5])
    assert status == 200
    assert _answers(out) == [(2, True), (3, True), (4, False), (4, True), (5, False)]
    status, out = _batch(cp, inv, worker, [5, 6], kinds={6: wire.FRAME_END})
    assert _answers(out) == [(5, True), (6, False)]
    frames = cp.store.read_frames(inv)
    assert [f.seq for f in frames] == list(range(7))
    assert [f.final for f in frames] == [False] * 6 + [True]
    assert [wire.unpack(wire.decode_frame(f.data).body) for f in frames[:6]] == list(range(6))
    # the seed's one-frame route still answers its per-frame duplicate
    single = {
        "invocation_id": inv,
        "seq": 3,
        "bytes": frame(3),
        "final": False,
        "attempt": 1,
        "worker_id": worker,
    }
    assert cp.daemon("/v1/daemon/result-chunk", single) == (200, {"ok": True, "seq": 3, "duplicate": True})


def test_a_batch_that_breaks_the_order_is_refused_from_there(control_plane: ControlPlane) -> None:
    cp = control_plane
    inv, worker = _claimed(cp)
    assert _batch(cp, inv, worker, [0, 1])[0] == 200
    status, out = _batch(cp, inv, worker, [2, 4, 5])  # a gap: 2 is kept, 4 and 5 are refused
    assert status == 409 and out["ok"] is False and "the next frame is 3" in out["error"]
    assert _answers(out) == [(2, False)] and out["expected_seq"] == 3
    status, out = _batch(cp, inv, worker, [5])
    assert status == 409 and "skips ahead" in out["error"] and out["results"] == []
    assert [f.seq for f in cp.store.read_frames(inv)] == [0, 1, 2]
    assert _batch(cp, inv, worker, [2, 3], kinds={3: wire.FRAME_ERROR})[0] == 200
    status, out = _batch(cp, inv, worker, [3, 4])  # after the final frame
    assert status == 409 and "ended with final frame 3" in out["error"] and out["expected_seq"] == 4
    status, out = _batch(cp, inv, worker, [3])  # a repeat of the final frame is still a duplicate
    assert status == 200 and _answers(out) == [(3, True)]


def test_a_batch_from_another_attempt_or_worker_is_refused(control_plane: ControlPlane) -> None:
    cp = control_plane
    inv, worker = _claimed(cp)
    status, out = _batch(cp, inv, worker, [0], attempt=2)
    assert status == 409 and "superseded" in out["error"]
    other = new_ulid()
    assert len(poll(cp, other, timeout_s=0)["commands"]) == 0  # a registered worker, not the holder
    status, out = _batch(cp, inv, other, [0])
    assert status == 403 and "held by another worker" in out["error"]
    status, out = _batch(cp, new_ulid(), worker, [0])
    assert status == 404
    assert cp.store.read_frames(inv) == []


def _written_batches(cp: ControlPlane) -> float:
    """How many writes the group commit took so far (``lakeshore_write_batch_size``'s sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    assert resp.status_code == 200
    for family in text_string_to_metric_families(resp.text):
        if family.name == "lakeshore_write_batch_size":
            return sum(s.value for s in family.samples if s.name.endswith("_sum"))
    raise AssertionError("no lakeshore_write_batch_size histogram on /metrics")


def test_batches_and_acks_of_many_invocations_at_once_go_through_the_group_commit(
    control_plane: ControlPlane,
) -> None:
    """Daemons posting batches and acking concurrently: every batch and ack is answered 200 once
    written by the group commit (counted by its histogram), every journal is whole and in order
    and every invocation ends succeeded."""
    cp = control_plane
    claimed = [_claimed(cp) for _ in range(12)]
    before = _written_batches(cp)

    def one(inv: str, worker: str) -> None:
        for seqs in ([0], [1, 2, 3], [3, 4, 5], [6, 7]):
            status, out = _batch(cp, inv, worker, seqs, kinds={7: wire.FRAME_END})
            assert status == 200 and out["ok"] is True, out
        ack = {
            "invocation_id": inv,
            "state": "succeeded",
            "result_blob": b"\xc0",
            "worker_id": worker,
            "attempt": 1,
        }
        assert cp.daemon("/v1/daemon/ack", ack) == (200, {"ok": True})

    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(one, inv, worker) for inv, worker in claimed]:
            f.result()
    assert _written_batches(cp) - before >= len(claimed) * 5  # 4 batches and an ack each
    for inv, _worker in claimed:
        assert [(f.seq, f.final) for f in cp.store.read_frames(inv)] == [(s, s == 7) for s in range(8)]
        got = cp.store.get(inv)
        assert got is not None and got.state == "succeeded"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"frames": []}, "1 to"),
        ({"frames": [b"\xc1nope"]}, "frames"),
        ({"frames": ["text"]}, "frames[0]"),
        ({"attempt": None}, "attempt"),
        ({"worker_id": None}, "worker_id"),
    ],
)
def test_a_malformed_batch_is_a_400(
    sqlite_control_plane: ControlPlane, change: dict[str, Any], needle: str
) -> None:
    cp = sqlite_control_plane
    inv, worker = _claimed(cp)
    body = {"invocation_id": inv, "attempt": 1, "worker_id": worker, "frames": [frame(0)]}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    status, out = cp.daemon(CHUNKS, body)
    assert status == 400 and needle in out["error"]


def test_live_followers_get_batches_from_memory_and_end_on_the_ack(tmp_path: Any) -> None:
    fanout = LocalFanout()
    with running_control_plane(str(tmp_path / "s.db"), fanout=fanout) as cp:
        inv, worker = _claimed(cp)
        started = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            live = [pool.submit(follow, cp, inv, 30.0, started) for _ in range(2)]
            assert started.wait(30)
            _until_subscribed(fanout, inv, 2)
            for first in range(0, 300, 100):
                assert _batch(cp, inv, worker, list(range(first, first + 100)))[0] == 200
            ack = {
                "invocation_id": inv,
                "state": "succeeded",
                "result_blob": b"",
                "attempt": 1,
                "worker_id": worker,
            }
            assert cp.daemon("/v1/daemon/ack", ack)[0] == 200  # no final frame: the ack ends the streams
            for follower in live:
                assert follower.result() == [(s, wire.FRAME_VALUE) for s in range(300)]
        assert fanout.subscriber_count(inv) == 0


def _until_subscribed(fanout: LocalFanout, owner: str, count: int) -> None:
    end = time.monotonic() + 30
    while fanout.subscriber_count(owner) < count:
        assert time.monotonic() < end, "the followers never subscribed"
        time.sleep(0.01)


def test_a_follower_that_lags_catches_up_from_the_journal(tmp_path: Any) -> None:
    # A buffer of 8 frames: a burst of 300 overflows it; the follower still sees every frame once.
    fanout = LocalFanout(max_pending=8)
    with running_control_plane(str(tmp_path / "s.db"), fanout=fanout) as cp:
        inv, worker = _claimed(cp)
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            live = pool.submit(follow, cp, inv, 30.0, started)
            assert started.wait(30)
            _until_subscribed(fanout, inv, 1)
            seqs = list(range(300))
            assert _batch(cp, inv, worker, seqs[:-1])[0] == 200
            assert _batch(cp, inv, worker, seqs[-1:], kinds={299: wire.FRAME_END})[0] == 200
            assert live.result() == [(s, wire.FRAME_VALUE) for s in seqs[:-1]] + [(299, wire.FRAME_END)]


def test_local_fanout_bounds_a_subscriber_by_bytes_and_pokes() -> None:
    async def body() -> list[Any]:
        fan = LocalFanout(max_pending=100, max_pending_bytes=10)
        sub = fan.subscribe("o")
        await fan.publish_many("o", [(0, b"12345", False), (1, b"12345", False), (2, b"12345", False)])
        got = [await sub.get(timeout=0), await sub.get(timeout=0), await sub.get(timeout=0)]
        await fan.poke("o")
        got.append(await sub.get(timeout=0))
        await sub.aclose()
        return got

    # the third frame overflowed 10 bytes: the queue was emptied (lag: None), then it kept coming
    assert asyncio.run(body()) == [None, (2, b"12345", False), None, (POKE, b"", False)]
