"""A requeued generator never splices two executions into one stream (issue 12, item 5), on every store.

Before: nymph died at seq 33, attempt 2 reran; its frames 0-33 were dropped as duplicates and
34-99 appended, so a consumer got 0-33 of attempt 1 then 34-99 of attempt 2 with nothing to mark
it. Now the journal is keyed by position: attempt 2's frames follow a RESTART marker (a LOG frame,
``meta.restart``), re-encoded with their position as seq and ``meta.attempt`` / ``meta.aseq``,
while the sender still speaks its own seqs. Cursors (positions) never go back.
"""

from __future__ import annotations

from typing import Any

import msgpack

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import FUTURE, ack, submit


def _value(seq: int, value: Any) -> tuple[int, bytes, bool]:
    return seq, wire.encode_frame(wire.FRAME_VALUE, seq, wire.pack(value)), False


def _end(seq: int) -> tuple[int, bytes, bool]:
    return seq, wire.encode_frame(wire.FRAME_END, seq, wire.pack(None)), True


def _journal(store: SqlStore, inv: str, since: int = -1) -> list[wire.Frame]:
    return [wire.decode_frame(f.data) for f in store.read_frames(inv, since)]


def _values(frames: list[wire.Frame]) -> list[Any]:
    return [wire.unpack(f.body) if f.kind == wire.FRAME_VALUE else ("restart", f.meta["restart"])
            if f.kind == wire.FRAME_LOG else f.kind for f in frames]  # fmt: skip


def test_a_requeued_attempt_restarts_the_stream_after_a_marker(store: SqlStore) -> None:
    inv = submit(store, max_attempts=3)
    store.claim("w1", ["q"])
    first = store.append_frames(inv, 1, [_value(s, f"a1-{s}") for s in range(34)], worker_id="w1")
    assert all(r.ok and not r.duplicate for r in first) and [r.pos for r in first] == list(range(34))
    assert store.expire_leases(now=FUTURE) == [inv]  # nymph died at seq 33
    store.claim("w2", ["q"])
    second = store.append_frames(
        inv, 2, [*(_value(s, f"a2-{s}") for s in range(100)), _end(100)], worker_id="w2"
    )
    assert [r.seq for r in second] == list(range(101))  # the sender's own seqs...
    assert [r.pos for r in second] == list(range(35, 136))  # ...at positions after the marker
    assert all(r.ok and not r.duplicate for r in second)
    frames = _journal(store, inv)
    assert [f.seq for f in frames] == list(range(136))  # positions: gap-free, monotonic
    assert _values(frames[:34]) == [f"a1-{s}" for s in range(34)]
    marker = frames[34]
    assert marker.kind == wire.FRAME_LOG and marker.meta["restart"] == 2 and marker.meta["attempt"] == 2
    assert _values(frames[35:135]) == [f"a2-{s}" for s in range(100)]  # from its own seq 0: no splice
    assert [(f.meta["attempt"], f.meta["aseq"]) for f in frames[35:38]] == [(2, 0), (2, 1), (2, 2)]
    assert frames[-1].kind == wire.FRAME_END and frames[-1].meta["aseq"] == 100
    assert _values(_journal(store, inv, since=34))[:2] == ["a2-0", "a2-1"]  # a cursor resumes after it
    again = store.append_frames(inv, 2, [_value(5, "a2-5")], worker_id="w2")  # an outbox re-send
    assert again[0].ok and again[0].duplicate and again[0].pos == 40
    stale = store.append_frames(inv, 1, [_value(34, "late")], worker_id="w1")
    assert not stale[0].ok  # attempt 1 was superseded


def test_the_single_frame_route_restarts_the_same_way(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2)
    store.claim("w1", ["q"])
    for s in range(3):
        assert store.append_frame(inv, *_value(s, s), attempt=1, worker_id="w1").ok
    store.expire_leases(now=FUTURE)
    store.claim("w2", ["q"])
    got = store.append_frame(inv, *_value(0, "again"), attempt=2, worker_id="w2")
    assert got.ok and (got.seq, got.pos) == (0, 4) and got.data is not None
    gap = store.append_frame(inv, *_value(2, "skip"), attempt=2, worker_id="w2")
    assert not gap.ok and gap.expected_seq == 1  # in the attempt's own seqs
    assert _values(_journal(store, inv)) == [0, 1, 2, ("restart", 2), "again"]


def test_an_attempt_writing_to_an_empty_journal_needs_no_marker(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2)
    store.claim("w1", ["q"])
    store.expire_leases(now=FUTURE)  # attempt 1 never yielded
    store.claim("w2", ["q"])
    got = store.append_frames(inv, 2, [_value(0, "x"), _end(1)], worker_id="w2")
    assert [r.pos for r in got] == [0, 1]
    frames = _journal(store, inv)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE, wire.FRAME_END]
    assert frames[0].meta["attempt"] == 2  # frames carry their attempt


def test_a_retried_failure_s_error_frame_is_followed_by_the_restart(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2, retry_on=["TimeoutError"], backoff_s=0)
    store.claim("w", ["q"])
    error = {"type": "TimeoutError", "message": "slow"}
    error_frame = wire.encode_frame(wire.FRAME_ERROR, 2, error)
    store.append_frames(inv, 1, [_value(0, 0), _value(1, 1), (2, error_frame, True)], worker_id="w")
    assert ack(store, inv, "failed", attempt=1, worker_id="w", error=error).state == "queued"
    store.claim("w", ["q"])
    got = store.append_frames(inv, 2, [_value(0, 0), _end(1)], worker_id="w")
    assert all(r.ok for r in got)  # the ERROR closed attempt 1's part only
    assert _values(_journal(store, inv)) == [0, 1, wire.FRAME_ERROR, ("restart", 2), 0, wire.FRAME_END]
    raw = store.read_frames(inv)[3].data
    assert msgpack.unpackb(raw)[0] == wire.FRAME_LOG


def test_a_resumable_generator_continues_instead_of_restarting(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2, resumable=True)
    store.claim("w1", ["q"])
    store.append_frames(inv, 1, [_value(s, s) for s in range(34)], worker_id="w1")
    store.expire_leases(now=FUTURE)
    store.claim("w2", ["q"])
    got = store.append_frames(inv, 2, [*(_value(s, s) for s in range(100)), _end(100)], worker_id="w2")
    assert [r.duplicate for r in got] == [True] * 34 + [False] * 67  # what attempt 1 journaled is kept
    frames = _journal(store, inv)
    assert _values(frames) == [*range(100), wire.FRAME_END]  # one stream, no marker
    assert [f.seq for f in frames] == list(range(101))
