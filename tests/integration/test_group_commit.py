"""The group commit: ``store.write_batch`` (many writes, one transaction, each answered alone) and
the server's :class:`GroupWriter` (batches form while a commit runs; answers only after it).

Durability under ``kill -9`` is tested in test_group_commit_crash.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.writer import GroupWriter
from dreamlake.lakeshore.store.api import (
    ANOTHER_WORKER,
    OUT_OF_ORDER,
    SUPERSEDED,
    UNKNOWN,
    AckRequest,
    AckResult,
    ChunkResult,
    FrameRequest,
    FramesRequest,
    FramesResult,
    HeartbeatRequest,
    HeartbeatResult,
    PollRequest,
    PollResult,
    SubmitRequest,
    SubmitResult,
    WriteRequest,
    WriteResult,
)
from dreamlake.lakeshore.store.notify import run_queue_channel
from dreamlake.lakeshore.store.sql import SqlStore

FUNCTION = {"module": "m", "qualname": "f", "version": "v1"}


def _submit(inv: str | None = None, queue: str = "q", **run_config: Any) -> SubmitRequest:
    return SubmitRequest(
        invocation_id=inv or new_ulid(),
        queue=queue,
        function=dict(FUNCTION),
        args_blob=b"\x90",
        run_config={"queue": queue, **run_config},
    )


def _running(store: SqlStore, n: int, worker: str = "w") -> list[tuple[str, int]]:
    ids = [store.submit(_submit()).invocation_id for _ in range(n)]
    claimed = store.claim(worker, ["q"], limit=n)
    assert sorted(i.invocation_id for i in claimed) == sorted(ids)
    return [(i.invocation_id, i.attempt) for i in claimed]


def test_a_batch_answers_each_write_as_its_single_call_would(store: SqlStore) -> None:
    (a, att_a), (b, att_b), (c, _att_c) = _running(store, 3)
    store.expire_leases(now=1e12)  # c, a and b lapse: requeued at attempt 1
    store.claim("w", ["q"], limit=3)  # and claimed again: attempt 2 supersedes attempt 1
    fresh, keyed = new_ulid(), new_ulid()
    store.submit(_submit(keyed, key="k"))
    results = store.write_batch(
        [
            AckRequest(a, "succeeded", attempt=att_a + 1, worker_id="w", result_blob=b"ok"),
            AckRequest(b, "succeeded", attempt=att_b, worker_id="w"),  # superseded: refused alone
            _submit(fresh),
            _submit(fresh),  # the same submit twice in one batch: the second is a duplicate
            _submit(a, priority=5),  # an id taken with other content: a 409 for this submit only
            _submit(key="k"),  # another id under a taken key: the keyed invocation, duplicate
            FrameRequest(c, 0, b"frame", False, attempt=2),
            FrameRequest(c, 0, b"other", False, attempt=2),  # a repeated seq: duplicate
            FrameRequest(c, 1, b"late", False, attempt=1),  # a superseded attempt: refused
            HeartbeatRequest("w", [(c, 2), (a, 2)]),
            AckRequest(new_ulid(), "failed"),  # unknown: refused
        ]
    )
    ack_a, ack_b, sub1, sub2, clash, by_key, f0, f0_again, f_old, beat, unknown = results
    assert ack_a == AckResult(ok=True, state="succeeded")
    assert isinstance(ack_b, AckResult) and not ack_b.ok and "superseded" in (ack_b.reason or "")
    assert sub1 == SubmitResult(invocation_id=fresh, queue="q")
    assert sub2 == SubmitResult(invocation_id=fresh, queue="q", duplicate=True)
    assert isinstance(clash, PlaneError) and clash.status == 409
    assert by_key == SubmitResult(invocation_id=keyed, queue="q", duplicate=True)
    assert f0 == ChunkResult(ok=True, seq=0)
    assert f0_again == ChunkResult(ok=True, seq=0, duplicate=True)
    assert isinstance(f_old, ChunkResult) and not f_old.ok
    # the ack of a earlier in the batch already ended its lease: the heartbeat reports it lost
    assert beat == HeartbeatResult(commands=[], lost=[a], pinned_version=None)
    assert isinstance(unknown, AckResult) and not unknown.ok and unknown.state is None
    got_a = store.get(a)
    assert got_a is not None and got_a.state == "succeeded" and got_a.result_blob == b"ok"
    assert [f.data for f in store.read_frames(c)] == [b"frame"]
    fresh_row = store.get(fresh)
    assert fresh_row is not None and fresh_row.state == "queued"


def test_a_run_of_acks_applies_together_and_answers_each(store: SqlStore) -> None:
    (a, att), (b, _), (c, _), (d, _), (e, _) = _running(store, 5)
    store.ack(e, "failed", attempt=att, worker_id="w", result_blob=None, error={"type": "E", "message": "m"})
    unknown = new_ulid()
    results = store.write_batch(
        [
            AckRequest(a, "succeeded", attempt=att, worker_id="w", result_blob=b"r"),
            AckRequest(b, "failed", error={"type": "E", "message": "m"}),  # neither attempt nor worker
            AckRequest(c, "succeeded", attempt=att + 1, worker_id="w"),  # not its attempt
            AckRequest(d, "succeeded", attempt=att, worker_id="other"),  # not its worker
            AckRequest(e, "failed", attempt=att, worker_id="w", error={"type": "E", "message": "m"}),
            AckRequest(unknown, "succeeded"),
        ]
    )
    assert results[:2] == [AckResult(ok=True, state="succeeded"), AckResult(ok=True, state="failed")]
    assert [(r.ok, r.state) for r in results[2:4]] == [(False, "running"), (False, "running")]  # type: ignore[union-attr]
    assert "superseded" in (results[2].reason or "") and "another worker" in (results[3].reason or "")  # type: ignore[union-attr]
    assert [r.status for r in results[2:4]] == [SUPERSEDED, ANOTHER_WORKER]  # type: ignore[union-attr]
    assert results[4] == AckResult(ok=True, duplicate=True, state="failed")  # the same outcome again
    assert results[5] == AckResult(ok=False, reason=f"unknown invocation {unknown}", status=UNKNOWN)
    states = {i: getattr(store.get(i), "state", None) for i in (a, b, c, d, e)}
    assert states == {a: "succeeded", b: "failed", c: "running", d: "running", e: "failed"}


@contextlib.contextmanager
def _reads_of_invocations(store: SqlStore) -> Iterator[list[str]]:
    """The SELECTs on ``invocations`` the store runs inside the block."""
    seen: list[str] = []

    def on_execute(*args: Any) -> None:
        sql = " ".join(str(args[2]).split())
        if sql.upper().startswith("SELECT") and "FROM invocations" in sql:
            seen.append(sql)

    sa.event.listen(store.db.engine, "before_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        sa.event.remove(store.db.engine, "before_cursor_execute", on_execute)


def test_acks_that_all_hold_their_leases_apply_without_a_read_back(store: SqlStore) -> None:
    """A run of acks whose every update applied (one row each: the lease conditions held) and no
    fleet limit: each answers applied, the rows hold their outcomes, and the store reads nothing
    back (the updates' row count is the proof)."""
    (a, att), (b, _), (c, _) = _running(store, 3)
    with _reads_of_invocations(store) as reads:
        results = store.write_batch(
            [
                AckRequest(a, "succeeded", attempt=att, worker_id="w", result_blob=b"ra"),
                AckRequest(b, "succeeded", attempt=att, worker_id="w", result_ref={"key": "k"}),
                AckRequest(c, "succeeded", result_blob=b"rc"),  # neither attempt nor worker
            ]
        )
    assert results == [AckResult(ok=True, state="succeeded")] * 3
    assert reads == []
    got = [store.get(i) for i in (a, b, c)]
    assert [(g.state, g.result_blob, g.result_ref) for g in got if g is not None] == [
        ("succeeded", b"ra", None),
        ("succeeded", None, {"key": "k"}),
        ("succeeded", b"rc", None),
    ]


def test_in_a_run_of_acks_the_ack_of_a_lost_lease_is_still_refused(store: SqlStore) -> None:
    """Beside acks that apply: an attempt superseded after its lease lapsed, and a lapsed lease
    not yet claimed again, are each refused (409, nothing changed); the others apply."""
    running = _running(store, 3)
    store.expire_leases(now=1e12)  # every lease lapses: all three back to queued
    again = {i.invocation_id: i.attempt for i in store.claim("w", ["q"], limit=2)}
    (now_held, new_attempt), (superseded, _) = list(again.items())
    (lapsed,) = [i for i, _ in running if i not in again]
    old = running[0][1]
    results = store.write_batch(
        [
            AckRequest(now_held, "succeeded", attempt=new_attempt, worker_id="w", result_blob=b"ok"),
            AckRequest(superseded, "succeeded", attempt=old, worker_id="w", result_blob=b"stale"),
            AckRequest(lapsed, "succeeded", attempt=old, worker_id="w", result_blob=b"stale"),
        ]
    )
    held_ack, superseded_ack, lapsed_ack = results
    assert held_ack == AckResult(ok=True, state="succeeded")
    assert isinstance(superseded_ack, AckResult) and (superseded_ack.ok, superseded_ack.status) == (
        False,
        SUPERSEDED,
    )
    assert "superseded" in (superseded_ack.reason or "")
    assert isinstance(lapsed_ack, AckResult) and (lapsed_ack.ok, lapsed_ack.status) == (False, SUPERSEDED)
    assert "lapsed" in (lapsed_ack.reason or "") or "superseded" in (lapsed_ack.reason or "")
    states = {i: getattr(store.get(i), "state", None) for i in (now_held, superseded, lapsed)}
    assert states == {now_held: "succeeded", superseded: "running", lapsed: "queued"}
    assert all(getattr(store.get(i), "result_blob", None) is None for i in (superseded, lapsed))


def test_a_run_of_acks_under_a_fleet_limit_still_frees_its_room(store: SqlStore) -> None:
    """With a fleet-wide limit on the queue, each applied ack of a run says the room it freed and
    the batch wakes the polls held back by the limit."""
    store.set_queue_limit("q", 2)
    (a, att), (b, _) = _running(store, 2)
    heard: list[str] = []
    store.notifier.add_listener(lambda channel, seq, relayed: heard.append(channel))
    results = store.write_batch(
        [
            AckRequest(a, "succeeded", attempt=att, worker_id="w"),
            AckRequest(b, "succeeded", attempt=att, worker_id="w"),
        ]
    )
    assert results == [AckResult(ok=True, state="succeeded")] * 2
    assert [getattr(r, "freed", None) for r in results] == [("default", "q", "")] * 2
    assert run_queue_channel("default", "q") in heard


def test_a_write_that_fails_in_the_transaction_fails_alone(store: SqlStore) -> None:
    """A write that fails inside the transaction (here a frame whose data only the apply finds is
    no bytes; in service, a value a column refuses or a lost connection): the batch is retried write
    by write, and only that write answers an error. A write the store refuses (a frame past the
    next seq) answers its own refusal and fails nothing."""
    ((inv, attempt),) = _running(store, 1)
    good = new_ulid()
    results = store.write_batch(
        [
            _submit(good),
            FrameRequest(inv, 0, None, False),  # type: ignore[arg-type]
            FrameRequest(inv, 2**64, b"x", False),
            FrameRequest(inv, 0, b"fine", False),
            AckRequest(inv, "succeeded", attempt=attempt, worker_id="w"),
        ]
    )
    sub, bad, gap, frame, ack = results
    assert sub == SubmitResult(invocation_id=good, queue="q")
    assert isinstance(bad, PlaneError) and bad.status == 500
    assert isinstance(gap, ChunkResult) and not gap.ok
    assert (gap.status, gap.expected_seq) == (OUT_OF_ORDER, 0)
    assert frame == ChunkResult(ok=True, seq=0)
    assert ack == AckResult(ok=True, state="succeeded")
    assert store.get(good) is not None
    got = store.get(inv)
    assert got is not None and got.state == "succeeded"


def test_lease_and_order_checks_hold_per_write_of_a_batch(store: SqlStore) -> None:
    """Another worker's frame (403), a superseded attempt's frame (409), a gap (409 with the next
    seq) and a frame after the final one are refused each alone; the rest of the batch commits."""
    ((inv, attempt),) = _running(store, 1)
    results = store.write_batch(
        [
            FrameRequest(inv, 0, b"a", False, attempt=attempt, worker_id="w"),
            FrameRequest(inv, 1, b"b", False, attempt=attempt, worker_id="other"),
            FrameRequest(inv, 1, b"b", False, attempt=attempt + 1, worker_id="w"),
            FrameRequest(inv, 2, b"c", False, attempt=attempt, worker_id="w"),
            FrameRequest(inv, 1, b"end", True, attempt=attempt, worker_id="w"),
            FrameRequest(inv, 2, b"late", False, attempt=attempt, worker_id="w"),
            AckRequest(inv, "succeeded", attempt=attempt, worker_id="other"),
            AckRequest(inv, "succeeded", attempt=attempt, worker_id="w"),
        ]
    )
    f0, other, old, gap, end, late, ack_other, ack = results
    assert f0 == ChunkResult(ok=True, seq=0) and end == ChunkResult(ok=True, seq=1)
    assert isinstance(other, ChunkResult) and other.status == ANOTHER_WORKER
    assert isinstance(old, ChunkResult) and old.status == SUPERSEDED
    assert isinstance(gap, ChunkResult) and (gap.ok, gap.status, gap.expected_seq) == (False, OUT_OF_ORDER, 1)
    assert isinstance(late, ChunkResult) and (late.ok, late.status, late.expected_seq) == (
        False,
        OUT_OF_ORDER,
        2,
    )
    assert isinstance(ack_other, AckResult) and (ack_other.ok, ack_other.status) == (False, ANOTHER_WORKER)
    assert ack == AckResult(ok=True, state="succeeded")
    assert [f.data for f in store.read_frames(inv)] == [b"a", b"end"]


def test_frame_batches_in_one_commit_keep_order_duplicates_and_lease_checks(store: SqlStore) -> None:
    """Batches of ``result-chunks`` as writes of one group commit: each sees the journal as the
    writes before it in the transaction left it (order, per-seq duplicates, the first-frame batch
    of one), another worker's and a superseded attempt's batch are refused whole, a batch after
    the ack is refused, and the other writes of the transaction commit."""
    (a, att_a), (b, att_b) = _running(store, 2)

    def batch(inv: str, seqs: list[int], *, attempt: int, worker: str = "w", end: int = -1) -> FramesRequest:
        return FramesRequest(inv, attempt, [(s, f"{inv[-4:]}{s}".encode(), s == end) for s in seqs], worker)

    results = store.write_batch(
        [
            batch(a, [0], attempt=att_a),  # the first frame, alone
            batch(a, [1, 2, 3], attempt=att_a),
            batch(b, [0, 1], attempt=att_b, worker="other"),  # another worker: refused whole
            batch(a, [2, 3, 4, 4], attempt=att_a),  # a retry overlapping the journal
            batch(b, [0, 1], attempt=att_b + 1),  # superseded: refused whole
            batch(a, [6, 7], attempt=att_a),  # a gap: refused, expected 5
            batch(b, [0, 1, 2], attempt=att_b, end=2),
            AckRequest(b, "succeeded", attempt=att_b, worker_id="w"),
            batch(b, [3], attempt=att_b),  # after the ack: the lease is gone
            _submit(),
        ]
    )
    first, more, other, retry, old, gap, b_frames, ack, late, sub = results
    answers = [
        [(c.seq, c.duplicate) for c in r.results if c.ok] if isinstance(r, FramesResult) else r
        for r in (first, more, retry, b_frames)
    ]
    assert answers == [
        [(0, False)],
        [(1, False), (2, False), (3, False)],
        [(2, True), (3, True), (4, False), (4, True)],
        [(0, False), (1, False), (2, False)],
    ]
    assert isinstance(other, FramesResult) and {(c.ok, c.status) for c in other.results} == {
        (False, ANOTHER_WORKER)
    }
    assert isinstance(old, FramesResult) and {(c.ok, c.status) for c in old.results} == {(False, SUPERSEDED)}
    assert isinstance(gap, FramesResult)
    assert [(c.ok, c.status, c.expected_seq) for c in gap.results] == [(False, OUT_OF_ORDER, 5)] * 2
    assert ack == AckResult(ok=True, state="succeeded")
    assert isinstance(late, FramesResult) and not any(c.ok for c in late.results)
    assert isinstance(sub, SubmitResult)
    assert [(f.seq, f.data) for f in store.read_frames(a)] == [(s, f"{a[-4:]}{s}".encode()) for s in range(5)]
    assert [(f.seq, f.final) for f in store.read_frames(b)] == [(0, False), (1, False), (2, True)]


def test_a_malformed_frame_batch_is_refused_before_the_commit(store: SqlStore) -> None:
    ((inv, attempt),) = _running(store, 1)
    bad = FramesRequest(inv, attempt, [(0, b"a", False), (-1, b"b", False)], "w")
    topic = FramesRequest("topic:t", 1, [(0, b"a", False)], "w")
    good = FramesRequest(inv, attempt, [(0, b"a", False)], "w")
    results = store.write_batch([bad, topic, good])
    assert [getattr(r, "status", None) for r in results[:2]] == [400, 400]
    assert isinstance(results[2], FramesResult) and results[2].results == [ChunkResult(ok=True, seq=0)]
    assert [f.seq for f in store.read_frames(inv)] == [0]


def test_a_poll_pass_in_a_batch_claims_what_the_batch_submitted_and_acks_commit_with_it(
    store: SqlStore,
) -> None:
    """A poll pass is a write of the group commit: a submit of the same batch (applied first) is
    claimed by it, an ack of the same batch frees the worker's earlier job, each answered alone."""
    ((held, attempt),) = _running(store, 1)
    fresh = new_ulid()
    store.pin_version("default", "9.9.9")
    results = store.write_batch(
        [
            AckRequest(held, "succeeded", attempt=attempt, worker_id="w"),
            PollRequest("w", ["q"], limit=4, exec_jobs=False),
            _submit(fresh),
            PollRequest("other", ["q"], limit=4, exec_jobs=False),  # nothing left for it
        ]
    )
    ack, polled, submitted, empty = results
    assert ack == AckResult(ok=True, state="succeeded")
    assert isinstance(submitted, SubmitResult) and submitted.invocation_id == fresh
    assert isinstance(polled, PollResult) and [i.invocation_id for i in polled.invocations] == [fresh]
    assert polled.invocations[0].attempt == 1 and polled.pinned_version == "9.9.9"
    assert isinstance(empty, PollResult) and empty.invocations == []
    got = store.get(fresh)
    assert got is not None and (got.state, got.worker_id) == ("running", "w")


def test_a_malformed_write_answers_its_own_error(store: SqlStore) -> None:
    ok = new_ulid()
    results = store.write_batch(
        [_submit(key=["not", "a", "key"]), AckRequest(new_ulid(), "bogus"), _submit(ok)]
    )
    assert [type(r) for r in results] == [PlaneError, PlaneError, SubmitResult]
    assert [getattr(r, "status", None) for r in results[:2]] == [400, 400]
    assert store.get(ok) is not None


def test_a_heartbeat_in_a_batch_reads_the_pinned_version(store: SqlStore) -> None:
    store.register_worker("w", {"namespace": "team-a"})
    store.pin_version("team-a", "0.1.4")
    store.pin_version("default", "0.2.0")
    mine, bound, stranger = store.write_batch(
        [HeartbeatRequest("w", []), HeartbeatRequest("w", [], namespace="default"), HeartbeatRequest("x", [])]
    )
    assert [getattr(r, "pinned_version", None) for r in (mine, bound, stranger)] == [
        "0.1.4",
        "0.2.0",
        "0.2.0",
    ]
    assert store.poll_pass("w", ["q"]).pinned_version == "0.1.4"


def test_a_fleets_polls_and_heartbeats_share_one_batch_and_each_gets_its_own_commands(
    store: SqlStore,
) -> None:
    """A fleet's polls and heartbeats arrive dozens to a batch; their shared duties (touch the
    worker, take its commands, read its pinned version) run once for the batch, and each write
    still answers as its single call would: a worker's command goes to exactly one of its writes,
    each reads its own namespace's pin. The transactions commit in latency's order (submits, then
    polls, then heartbeats) and each but the last is handed to ``on_commit`` as it commits."""
    store.register_worker("w1", {"namespace": "team-a"})
    store.register_worker("w2", {})
    store.pin_version("team-a", "0.1.4")
    store.pin_version("default", "0.2.0")
    (a, att_a), (b, att_b) = _running(store, 1, "w1") + _running(store, 1, "w2")
    assert store.cancel(a) == "running" == store.cancel(b)  # a cancel command for each worker
    fresh = new_ulid()
    committed: list[list[int]] = []
    seen_before = {w.worker_id: w.last_seen for w in store.list_workers().workers}
    results = store.write_batch(
        [
            HeartbeatRequest("w2", [(b, att_b)]),  # 0: w2's first write of the heartbeats' commit
            PollRequest("w1", ["q"], limit=1),  # 1: w1's first write of the polls' commit
            HeartbeatRequest("w1", [(a, att_a)]),  # 2
            _submit(fresh, queue="other"),  # 3
            HeartbeatRequest("w2", [(b, att_b)]),  # 4
            PollRequest("stranger", ["nothing"], limit=1),  # 5: an unregistered worker
        ],
        on_commit=lambda pairs: committed.append([i for i, _ in pairs]),
    )
    assert committed == [[3], [1, 5]]  # the heartbeats' commit, the last, answers with the return
    beat_w2, poll_w1, beat_w1, sub, beat_w2_again, poll_stranger = results
    assert isinstance(sub, SubmitResult) and sub.invocation_id == fresh
    assert isinstance(poll_w1, PollResult) and isinstance(poll_stranger, PollResult)
    assert [(c.kind, c.body["invocation_id"]) for c in poll_w1.commands] == [("cancel", a)]
    assert poll_w1.invocations == [] and poll_w1.pinned_version == "0.1.4"
    assert poll_stranger.commands == [] and poll_stranger.pinned_version == "0.2.0"
    assert isinstance(beat_w1, HeartbeatResult) and beat_w1.lost == []
    assert beat_w1.pinned_version == "0.1.4"
    assert isinstance(beat_w2, HeartbeatResult) and isinstance(beat_w2_again, HeartbeatResult)
    assert [(c.kind, c.body["invocation_id"]) for c in beat_w2.commands] == [("cancel", b)]
    assert beat_w2.lost == [] == beat_w2_again.lost
    # the queued command went to one write of each worker; a beat reporting a cancelled invocation
    # running is asked again (a command of its own), in case the first answer never arrived
    queued = {c.id for c in poll_w1.commands + beat_w2.commands}
    for beat, inv in ((beat_w1, a), (beat_w2_again, b)):
        assert [(c.kind, c.body["invocation_id"]) for c in beat.commands] == [("cancel", inv)]
        assert beat.commands[0].id not in queued
    assert beat_w2.pinned_version == "0.2.0" == beat_w2_again.pinned_version
    seen_after = {w.worker_id: w.last_seen for w in store.list_workers().workers}
    assert all(seen_after[w] > seen_before[w] for w in ("w1", "w2"))  # each touched by the batch
    assert store.poll_pass("w1", ["q"]).commands == []  # taken once, for good


def test_one_daemons_write_takes_its_commands_oldest_first_touches_it_and_reads_its_pin(
    store: SqlStore,
) -> None:
    """A batch with one daemon's write (a warm poll, alone in its group commit) takes that
    daemon's duties by the one-daemon statements (on PostgreSQL one statement for the three):
    every pending command of it, oldest first and once, its ``last_seen`` moved on, and the pin of
    its token's namespace, else of the namespace it registered with, else of ``default``."""
    store.register_worker("w", {"namespace": "team-a"})
    store.pin_version("team-a", "0.1.4")
    store.pin_version("default", "0.2.0")
    (a, _), (b, _) = _running(store, 2)
    assert store.cancel(b) == "running" == store.cancel(a)  # b's command first, then a's
    (seen_before,) = [w.last_seen for w in store.list_workers().workers if w.worker_id == "w"]
    (polled,) = store.write_batch([PollRequest("w", ["q"], limit=1)])
    assert isinstance(polled, PollResult) and polled.pinned_version == "0.1.4"
    assert [(c.kind, c.body["invocation_id"]) for c in polled.commands] == [("cancel", b), ("cancel", a)]
    (seen_after,) = [w.last_seen for w in store.list_workers().workers if w.worker_id == "w"]
    assert seen_after > seen_before
    (again,) = store.write_batch([PollRequest("w", ["q"], limit=1, namespace="default")])
    assert isinstance(again, PollResult) and again.commands == [] and again.pinned_version == "0.2.0"
    (beat,) = store.write_batch([HeartbeatRequest("stranger", [])])  # never registered
    assert isinstance(beat, HeartbeatResult) and beat.commands == [] and beat.pinned_version == "0.2.0"
    store.pin_version("default", None)
    (bare,) = store.write_batch([HeartbeatRequest("stranger", [])])
    assert isinstance(bare, HeartbeatResult) and bare.pinned_version is None


def test_busy_nymphs_polls_each_with_its_ack_land_together_and_each_claims_its_own(
    store: SqlStore,
) -> None:
    """A batch of busy nymphs' polls, each carrying the ack of the call that freed its slot: the
    acks apply together (on PostgreSQL one statement, the other workers' polls after them), each
    answered as its own ack would be (one naming another worker's call refused, the rest landed
    with their results), and each poll claims its own call, none twice."""
    workers = ["w1", "w2", "w3"]
    running = {w: _running(store, 1, w)[0] for w in workers}
    queued = {store.submit(_submit()).invocation_id for _ in range(3)}
    batch: list[WriteRequest] = []
    for w in workers:
        inv, attempt = running[w]
        batch.append(AckRequest(inv, "succeeded", attempt, w, f"result of {w}".encode()))
        batch.append(PollRequest(w, ["q"], limit=1))
    w3_inv, w3_attempt = running["w3"]
    # not their calls: w9's joins the run (the read-back tells it apart), w1's ends the run
    batch.append(AckRequest(w3_inv, "succeeded", w3_attempt, "w9", b"forged by w9"))
    batch.insert(5, AckRequest(w3_inv, "succeeded", w3_attempt, "w1", b"forged by w1"))
    results = store.write_batch(batch)
    acks, polls = [results[k] for k in (0, 2, 4, 5, 7)], [results[k] for k in (1, 3, 6)]
    assert [(a.ok, a.duplicate) for a in acks if isinstance(a, AckResult)][:3] == [(True, False)] * 3
    assert all(isinstance(a, AckResult) and not a.ok for a in acks[3:])
    claimed = [i.invocation_id for poll in polls if isinstance(poll, PollResult) for i in poll.invocations]
    assert sorted(claimed) == sorted(queued)  # one each, none twice
    for w in workers:
        got = store.get(running[w][0])
        assert got is not None and (got.state, got.result_blob) == ("succeeded", f"result of {w}".encode())
    again = store.write_batch([batch[0], batch[2], batch[4]])  # the same acks again: repeats
    assert all(isinstance(a, AckResult) and a.ok and a.duplicate for a in again)


def test_a_submit_remembers_its_queue_and_function_only_once_committed(store: SqlStore) -> None:
    store.submit(_submit(queue="seen"))
    assert "seen" in store._known.queues
    with pytest.raises(RuntimeError), store.db.tx(write=True) as conn:
        store._submit_many_in(conn, [store._prepare_submit(_submit(queue="rolled-back"))], 1.0)
        raise RuntimeError("abort the transaction")
    assert "rolled-back" not in store._known.queues
    store.submit(_submit(queue="rolled-back"))  # the queue row is written by the next submit
    assert "rolled-back" in store._known.queues


# -- the writer ------------------------------------------------------------------------------------


class _GatedStore:
    """A store whose ``write_batch`` records each batch and waits for a gate before answering."""

    def __init__(self) -> None:
        self.batches: list[list[WriteRequest]] = []
        self.started = threading.Event()
        self.gate = threading.Event()

    def write_batch(
        self, requests: Sequence[WriteRequest], on_commit: Any = None
    ) -> list[WriteResult | PlaneError]:
        self.batches.append(list(requests))
        self.started.set()
        assert self.gate.wait(10)
        out: list[WriteResult | PlaneError] = []
        for r in requests:
            if isinstance(r, AckRequest) and r.state == "refuse":
                out.append(PlaneError("refused", status=409))
            else:
                out.append(AckResult(ok=True, state=r.state if isinstance(r, AckRequest) else None))
        return out


def test_the_writer_batches_what_arrives_during_a_commit_and_answers_after_it() -> None:
    async def scenario() -> None:
        store = _GatedStore()
        writer = GroupWriter(store, max_batch=4)  # type: ignore[arg-type]
        first = asyncio.create_task(writer.write(AckRequest("a", "succeeded")))
        await asyncio.to_thread(store.started.wait, 10)
        rest = [
            asyncio.create_task(writer.write(AckRequest(x, "refuse" if x == "c" else "failed")))
            for x in "bcdef"
        ]
        await asyncio.sleep(0.05)
        assert not first.done() and not any(t.done() for t in rest)  # nothing before the commit
        store.gate.set()
        assert (await first).state == "succeeded"
        answers = await asyncio.gather(*rest, return_exceptions=True)
        assert isinstance(answers[1], PlaneError) and answers[1].status == 409
        assert [a.state for a in answers if isinstance(a, AckResult)] == ["failed"] * 4
        # a, then what queued during a's commit up to the cap (b..e), then the rest (f)
        assert [[r.invocation_id for r in b] for b in store.batches] == [  # type: ignore[union-attr]
            ["a"],
            ["b", "c", "d", "e"],
            ["f"],
        ]
        await writer.aclose()
        with pytest.raises(PlaneError):
            await writer.write(AckRequest("g", "failed"))

    asyncio.run(scenario())


def test_the_writer_commits_heartbeats_after_the_claims_and_acks_that_wait_with_them() -> None:
    """A fleet's heartbeats must not hold the one writer while a poll's claim waits: writes that
    are only heartbeats are set aside until nothing else is waiting, and still all land."""

    async def scenario() -> None:
        store = _GatedStore()
        writer = GroupWriter(store)  # type: ignore[arg-type]
        first = asyncio.create_task(writer.write(AckRequest("a", "succeeded")))
        await asyncio.to_thread(store.started.wait, 10)
        beats = [asyncio.create_task(writer.write(HeartbeatRequest(f"w{i}", []))) for i in range(3)]
        await asyncio.sleep(0.02)
        poll = asyncio.create_task(writer.write(PollRequest("p", ["q"])))
        await asyncio.sleep(0.05)
        store.gate.set()
        await first
        await poll
        await asyncio.gather(*beats)
        assert [[type(r).__name__ for r in b] for b in store.batches] == [
            ["AckRequest"],
            ["PollRequest"],  # queued after the heartbeats, committed before them
            ["HeartbeatRequest"] * 3,
        ]
        late = asyncio.create_task(writer.write(HeartbeatRequest("w9", [])))
        await asyncio.sleep(0)  # queued
        await writer.aclose()  # what is set aside is committed before the writer stops
        assert late.done() and store.batches[-1][0] == HeartbeatRequest("w9", [])

    asyncio.run(scenario())


def test_a_batch_of_writes_lands_whole_in_one_group_commit_past_the_cap() -> None:
    """``write_many`` (the submit-batch route): its writes are never split across transactions,
    even past ``max_batch``; each answers its own result, in order, after the commit."""

    async def scenario() -> None:
        store = _GatedStore()
        writer = GroupWriter(store, max_batch=4)  # type: ignore[arg-type]
        first = asyncio.create_task(writer.write(AckRequest("a", "succeeded")))
        await asyncio.to_thread(store.started.wait, 10)
        many = asyncio.create_task(
            writer.write_many([AckRequest(x, "refuse" if x == "d" else "failed") for x in "bcdefg"])
        )
        after = asyncio.create_task(writer.write(AckRequest("h", "failed")))
        await asyncio.sleep(0.05)
        assert not many.done()
        store.gate.set()
        await first
        answers = await many
        assert [a.status if isinstance(a, PlaneError) else a.state for a in answers] == [  # type: ignore[union-attr]
            "failed", "failed", 409, "failed", "failed", "failed",
        ]  # fmt: skip
        assert (await after).state == "failed"
        # the batch of six went whole, past the cap of four; h waited for the next commit
        assert [[r.invocation_id for r in b] for b in store.batches] == [  # type: ignore[union-attr]
            ["a"],
            list("bcdefg"),
            ["h"],
        ]
        assert await writer.write_many([]) == []
        await writer.aclose()

    asyncio.run(scenario())


def test_a_handed_poll_pass_claims_in_its_submits_transaction_and_holds_their_wake(
    store: SqlStore,
) -> None:
    """A pass handed a batch's submits (server/polls.py) runs in their transaction, right after
    them: it claims what they made, commits with them, and their run-queue wake is the pass's
    poll's, so the store does not send it (the in-process workers' ``queue:`` wake still goes)."""
    (running, att), *_ = _running(store, 1)
    heard: list[str] = []
    store.notifier.add_listener(lambda channel, _seq, _relayed: heard.append(channel))
    a, b = new_ulid(), new_ulid()
    early: list[list[tuple[int, Any]]] = []
    results = store.write_batch(
        [
            _submit(a),
            AckRequest(running, "succeeded", attempt=att, worker_id="w"),
            _submit(b),
            PollRequest("handed", ["q"], limit=1, duties=False, handed=(a,)),
        ],
        early.append,
    )
    sub_a, ack, sub_b, polled = results
    assert sub_a == SubmitResult(invocation_id=a, queue="q") and sub_b == SubmitResult(
        invocation_id=b, queue="q"
    )
    assert isinstance(polled, PollResult) and [i.invocation_id for i in polled.invocations] == [a]
    # the first transaction held the submits and the handed pass; the ack came after it
    assert [sorted(i for i, _ in pairs) for pairs in early] == [[0, 2, 3]]
    assert ack == AckResult(ok=True, state="succeeded")
    claimed = store.get(a)
    assert claimed is not None and claimed.state == "running" and claimed.worker_id == "handed"
    wakes = [c for c in heard if c.startswith("run-queue:")]
    assert wakes == ["run-queue:default:q"]  # b's alone: a's is the handed poll's
    assert heard.count("queue:q") == 2 and f"inv:{a}" in heard and f"inv:{b}" in heard


def test_a_handed_pass_of_a_repeated_submit_claims_nothing_new_and_nothing_is_silenced_wrongly(
    store: SqlStore,
) -> None:
    """A repeat makes nothing: the pass handed it finds nothing of its own to claim, and a repeat
    was never notified anyway."""
    first = store.submit(_submit()).invocation_id
    store.claim("w", ["q"], limit=1)
    heard: list[str] = []
    store.notifier.add_listener(lambda channel, _seq, _relayed: heard.append(channel))
    again, polled = store.write_batch(
        [_submit(first), PollRequest("handed", ["q"], limit=1, duties=False, handed=(first,))]
    )
    assert again == SubmitResult(invocation_id=first, queue="q", duplicate=True)
    assert isinstance(polled, PollResult) and polled.invocations == []
    assert heard == []


def test_a_write_that_breaks_its_preparation_fails_alone(store: SqlStore) -> None:
    """A submit whose run_config breaks the store's own checks (nested past the interpreter's
    recursion limit, as a hostile producer sent it before the decode bound) answers its 500; the
    other tenant's submits of the same group commit are written and answered."""
    deep: dict[str, Any] = {}
    cur = deep
    for _ in range(5000):
        cur["x"] = {}
        cur = cur["x"]
    others = [new_ulid() for _ in range(5)]
    results = store.write_batch([_submit(others[0]), _submit(run_config=deep), *map(_submit, others[1:])])
    assert isinstance(results[1], PlaneError) and results[1].status == 500
    good = [results[0], *results[2:]]
    assert good == [SubmitResult(invocation_id=i, queue="q") for i in others]
    assert all(store.get(i) is not None for i in others)


class _PoisonStore:
    """A store whose ``write_batch`` raises outside any one write when the batch holds the ack
    of ``poison`` (a bug one write's value triggers)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def write_batch(
        self, requests: Sequence[WriteRequest], on_commit: Any = None
    ) -> list[WriteResult | PlaneError]:
        ids = [r.invocation_id for r in requests if isinstance(r, AckRequest)]
        self.batches.append(ids)
        if "poison" in ids:
            raise RecursionError("maximum recursion depth exceeded")
        return [AckResult(ok=True, state="succeeded") for _ in requests]


def test_the_writer_answers_a_batch_that_raised_caller_by_caller() -> None:
    async def scenario() -> None:
        store = _PoisonStore()
        writer = GroupWriter(store)  # type: ignore[arg-type]
        names = ["a", "b", "poison", "c", "d"]
        answers = await asyncio.gather(
            *(writer.write(AckRequest(x, "succeeded")) for x in names), return_exceptions=True
        )
        await writer.aclose()
        by_name = dict(zip(names, answers, strict=True))
        bad = by_name.pop("poison")
        assert isinstance(bad, PlaneError) and bad.status == 500
        assert all(isinstance(a, AckResult) and a.ok for a in by_name.values())
        assert len(store.batches[0]) > 1  # they did share a group commit first

    asyncio.run(scenario())
