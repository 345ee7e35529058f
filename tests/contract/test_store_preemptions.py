"""A preempted attempt is its own outcome (issue 30, item 1), on every store (SQLite file and
memory, PostgreSQL).

A ``preempted`` ack (nymph stopped under the attempt and its grace expired) requeues the call at
once, attempt + 1, without spending one of its ``max_attempts``; ``run_config.max_preemptions``
(default 10) bounds the loop; the history keeps the attempt as ``preempted``; a repeat is a
duplicate; a superseded attempt's ack changes nothing; an old nymph's ``killed`` keeps its meaning.
"""

from __future__ import annotations

from typing import Any

import pytest

from dreamlake.lakeshore.store.api import AckRequest, AckResult
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import ack, submit

PREEMPTED = {"type": "Preempted", "message": "daemon shutdown grace expired", "reason": "shutdown"}


def _preempt(store: SqlStore, inv: str, attempt: int, worker: str = "w") -> AckResult:
    return ack(store, inv, "preempted", attempt=attempt, worker_id=worker, error=PREEMPTED)  # type: ignore[no-any-return]


def test_a_preempted_attempt_requeues_at_once_and_spends_no_attempt(store: SqlStore) -> None:
    inv = submit(store, max_attempts=1)
    assert store.claim("a", ["q"])[0].attempt == 1
    got = _preempt(store, inv, 1, "a")
    assert got.ok and got.state == "queued" and got.requeued == "q" and not got.duplicate
    row = store.get(inv)
    assert row is not None and (row.state, row.worker_id, row.not_before, row.preemptions) == (
        "queued",
        None,
        None,
        1,
    )
    again = store.claim("b", ["q"])
    assert [i.attempt for i in again] == [2]  # claimable at once, although max_attempts is 1
    ack(store, inv, "succeeded", attempt=2, worker_id="b", result_blob=b"\xc0")
    history = store.attempts(inv)
    assert [(a["attempt"], a["state"], a["worker_id"]) for a in history] == [
        (1, "preempted", "a"),
        (2, "succeeded", "b"),
    ]
    assert history[0]["error"] == PREEMPTED and history[0]["retry_at"] is not None


def test_preemptions_do_not_count_against_max_attempts_for_failures_and_lapsed_leases(
    store: SqlStore,
) -> None:
    inv = submit(store, max_attempts=2, retry_on=["TimeoutError"], backoff_s=0)
    store.claim("a", ["q"])
    _preempt(store, inv, 1, "a")
    store.claim("b", ["q"])  # attempt 2: the first one spent
    err = {"type": "TimeoutError", "message": "x"}
    assert ack(store, inv, "failed", attempt=2, worker_id="b", error=err).state == "queued"
    assert store.claim("c", ["q"])[0].attempt == 3  # the second one spent: its lease lapses
    assert store.expire_leases(now=10**10) == [inv]
    row = store.get(inv)
    assert row is not None and row.state == "failed" and row.error["type"] == "LeaseExpired"  # type: ignore[index]
    lapsed = submit(store, max_attempts=1)
    store.claim("a", ["q"])
    _preempt(store, lapsed, 1, "a")
    store.claim("b", ["q"])
    store.expire_leases(now=10**10)  # attempt 2 is the one allowed attempt: no requeue
    assert store.get(lapsed).state == "failed"  # type: ignore[union-attr]


def test_max_preemptions_stops_a_loop(store: SqlStore) -> None:
    inv = submit(store, max_attempts=1, max_preemptions=2)
    for n in (1, 2):
        store.claim("a", ["q"])
        assert _preempt(store, inv, n, "a").state == "queued"
    store.claim("a", ["q"])
    last = _preempt(store, inv, 3, "a")
    assert last.ok and last.state == "failed"
    row = store.get(inv)
    assert row is not None and row.state == "failed" and row.finished_at is not None
    assert row.error is not None and row.error["type"] == "Preempted"
    assert "max_preemptions (2)" in row.error["message"]
    assert store.claim("a", ["q"]) == []
    assert [a["state"] for a in store.attempts(inv)] == ["preempted", "preempted", "failed"]


def test_a_cancel_requested_ends_a_preempted_call(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("a", ["q"])
    store.cancel(inv)
    assert _preempt(store, inv, 1, "a").state == "cancelled"
    assert store.get(inv).state == "cancelled"  # type: ignore[union-attr]
    assert store.claim("a", ["q"]) == []


def test_a_repeat_is_a_duplicate_and_a_superseded_preempt_changes_nothing(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("a", ["q"])
    assert _preempt(store, inv, 1, "a").state == "queued"
    assert _preempt(store, inv, 1, "a").duplicate  # the outbox re-sends a lost answer
    store.claim("b", ["q"])
    stale = _preempt(store, inv, 1, "b")  # attempt 1 from the wrong worker
    assert not stale.ok
    wrong = ack(store, inv, "preempted", attempt=2, worker_id="a", error=PREEMPTED)  # not a's lease
    assert not wrong.ok
    row = store.get(inv)
    assert row is not None and (row.state, row.attempt, row.worker_id, row.preemptions) == (
        "running",
        2,
        "b",
        1,
    )


def test_an_old_nymphs_killed_keeps_its_meaning(store: SqlStore) -> None:
    inv = submit(store, max_attempts=3)
    store.claim("a", ["q"])
    err = {"type": "Cancelled", "message": "daemon shutdown grace expired"}
    assert ack(store, inv, "killed", attempt=1, worker_id="a", error=err).state == "killed"
    assert store.get(inv).state == "killed"  # type: ignore[union-attr]


def test_the_group_commit_preempts_as_a_single_ack_does(store: SqlStore) -> None:
    pre = submit(store, max_attempts=1)
    done = submit(store)
    store.claim("w", ["q"], limit=2)
    results = store.write_batch(
        [
            AckRequest(pre, "preempted", 1, "w", None, PREEMPTED),
            AckRequest(done, "succeeded", 1, "w", b"\xc0", None),
        ]
    )
    assert [(r.ok, r.state) for r in results if isinstance(r, AckResult)] == [
        (True, "queued"),
        (True, "succeeded"),
    ]
    assert store.claim("w2", ["q"])[0].invocation_id == pre


NOT_STARTED = {**PREEMPTED, "started": False}


def test_an_attempt_handed_back_before_it_started_spends_neither_attempts_nor_preemptions(
    store: SqlStore,
) -> None:
    """A call claimed by a poll in flight as nymph stopped, or by a nymph that restarted between the
    claim and the start, is handed back ``preempted`` with ``error.started`` false: requeued at
    once, ``handbacks`` + 1, and neither ``max_attempts`` nor ``max_preemptions`` is spent (before,
    it was a preemption: with ``max_preemptions=0`` the call failed without ever running)."""
    inv = submit(store, max_attempts=1, max_preemptions=0)
    store.claim("a", ["q"])
    got = ack(store, inv, "preempted", attempt=1, worker_id="a", error=NOT_STARTED)
    assert got.ok and got.state == "queued" and got.requeued == "q"
    assert ack(store, inv, "preempted", attempt=1, worker_id="a", error=NOT_STARTED).duplicate
    row = store.get(inv)
    assert row is not None and (row.state, row.preemptions, row.handbacks) == ("queued", 0, 1)
    assert row.status()["handbacks"] == 1
    assert store.claim("b", ["q"])[0].attempt == 2  # claimable at once, although max_attempts is 1
    ack(store, inv, "succeeded", attempt=2, worker_id="b", result_blob=b"\xc0")
    assert [(a["attempt"], a["state"]) for a in store.attempts(inv)] == [(1, "preempted"), (2, "succeeded")]
    lapses = submit(store, max_attempts=2)  # attempts spent: attempt - preemptions - handbacks
    store.claim("a", ["q"])
    ack(store, lapses, "preempted", attempt=1, worker_id="a", error=NOT_STARTED)
    store.claim("b", ["q"])
    store.expire_leases(now=10**10)  # attempt 2 is the first one spent: requeued
    assert store.get(lapses).state == "queued"  # type: ignore[union-attr]
    store.claim("c", ["q"])
    store.expire_leases(now=10**10)  # attempt 3 is the second: no more
    assert store.get(lapses).error["type"] == "LeaseExpired"  # type: ignore[union-attr,index]
    assert store.attempts(inv)[0]["error"] == NOT_STARTED


def test_hand_backs_past_the_cap_count_as_preemptions_and_a_cancel_still_ends_the_call(
    store: SqlStore,
) -> None:
    from dreamlake.lakeshore.store import retry

    inv = submit(store, max_attempts=1, max_preemptions=0)
    for n in range(1, retry.MAX_HANDBACKS + 1):
        store.claim("a", ["q"])
        assert ack(store, inv, "preempted", attempt=n, worker_id="a", error=NOT_STARTED).state == "queued"
    store.claim("a", ["q"])  # a nymph that dies each time it prepares the call ends no loop
    last = ack(store, inv, "preempted", attempt=retry.MAX_HANDBACKS + 1, worker_id="a", error=NOT_STARTED)
    assert last.state == "failed" and "max_preemptions (0)" in store.get(inv).error["message"]  # type: ignore[union-attr,index]
    cancelled = submit(store)
    store.claim("a", ["q"])
    store.cancel(cancelled)
    assert (
        ack(store, cancelled, "preempted", attempt=1, worker_id="a", error=NOT_STARTED).state == "cancelled"
    )
    stale = submit(store)
    store.claim("a", ["q"])
    assert not ack(store, stale, "preempted", attempt=1, worker_id="b", error=NOT_STARTED).ok  # not b's
    assert store.get(stale).handbacks == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("value", [-1, 1001, "3", True, 2.5])
def test_a_malformed_max_preemptions_is_refused_at_submit(value: Any) -> None:
    from dreamlake.lakeshore.errors import PlaneError
    from dreamlake.lakeshore.store.values import check_run_config

    with pytest.raises(PlaneError, match="max_preemptions must be a whole number from 0 to 1000") as refused:
        check_run_config({"max_preemptions": value})
    assert refused.value.status == 400


REF = {"bucket": None, "key": "payloads/2026/12/04/x.1/checkpoint", "size": 10, "sha256": "0" * 64}


def test_a_checkpoint_is_kept_for_the_next_attempt_and_a_stale_attempts_is_refused(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("a", ["q"])
    assert store.set_checkpoint(inv, 1, "a", REF) is None
    _preempt(store, inv, 1, "a")
    (again,) = store.claim("b", ["q"])
    assert again.checkpoint_ref == REF  # the run command of attempt 2 carries it
    newer = {**REF, "key": "payloads/2026/12/04/x.2/checkpoint"}
    stale = store.set_checkpoint(inv, 1, "a", newer)  # attempt 1, after attempt 2 started
    assert stale is not None and stale[0] == 409 and "superseded" in stale[1]
    other = store.set_checkpoint(inv, 2, "a", newer)  # attempt 2 is b's
    assert other is not None and other[0] == 403
    assert store.get(inv).checkpoint_ref == REF  # type: ignore[union-attr]
    assert store.set_checkpoint(inv, 2, "b", newer) is None
    ack(store, inv, "succeeded", attempt=2, worker_id="b", result_blob=b"\xc0")
    done = store.set_checkpoint(inv, 2, "b", REF)  # finished: nothing to carry it to
    assert done is not None and done[0] == 409
    assert store.set_checkpoint("01" + "0" * 24, 1, "a", REF) == (
        404,
        f"unknown invocation {'01' + '0' * 24}",
    )


def test_retention_deletes_a_finished_calls_checkpoint(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("a", ["q"])
    store.set_checkpoint(inv, 1, "a", REF)
    ack(store, inv, "succeeded", attempt=1, worker_id="a", result_blob=b"\xc0")
    got = store.gc(now=10**10, default_s=1)
    assert got.invocations == 1 and REF["key"] in got.payload_keys
