"""Per-namespace quotas as every store keeps and counts them (SQLite file and memory, PostgreSQL):
the three limits set, replaced and lifted together; the counts the server's checks read
(queued invocations, topics a namespace made, bytes presigned within a window), each confined to
its namespace and bounded by ``up_to``; and ``max_queued`` held strictly by the store itself, in
the transaction of the submits that carry it (``SubmitRequest.max_queued``), however many come
together or at once. The server's 429s: tests/security/test_quotas.py plays them from the
attacker's side, tests/integration/test_quota_strict.py under concurrent submits."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from dreamlake.lakeshore.errors import QuotaExceeded
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.api import Quota, SubmitRequest, SubmitResult
from dreamlake.lakeshore.store.sql import SqlStore

FN = {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"}


def _submit(store: SqlStore, namespace: str) -> str:
    inv = new_ulid()
    store.submit(
        SubmitRequest(
            invocation_id=inv, queue="q", function=FN, args_blob=b"x", run_config={}, namespace=namespace
        )
    )
    return inv


def test_a_namespaces_limits_are_set_replaced_and_lifted_together(store: SqlStore) -> None:
    assert store.quotas() == {}
    store.set_quota("team-b", Quota(max_queued=3, max_topics=2, max_payload_bytes=10 * 2**30))
    store.set_quota("team-c", Quota(max_topics=1))
    assert store.quotas() == {
        "team-b": Quota(max_queued=3, max_topics=2, max_payload_bytes=10 * 2**30),
        "team-c": Quota(max_topics=1),
    }
    store.set_quota("team-b", Quota(max_payload_bytes=5))  # replaces all three
    assert store.quotas()["team-b"] == Quota(max_payload_bytes=5)
    store.set_quota("team-b", Quota())  # no limit left: the namespace has no quota
    store.set_quota("team-c", None)
    assert store.quotas() == {}


def test_queued_invocations_are_counted_per_namespace_up_to_the_quota(store: SqlStore) -> None:
    for _ in range(4):
        _submit(store, "team-b")
    _submit(store, "team-a")
    assert store.count_queued("team-b", 10) == 4
    assert store.count_queued("team-b", 2) == 2  # stops at the quota
    assert store.count_queued("team-a", 10) == 1 and store.count_queued("team-c", 10) == 0


def test_a_topic_belongs_to_the_namespace_whose_post_made_it(store: SqlStore) -> None:
    store.topic_append("b-progress", b"\x01", namespace="team-b")
    store.topic_append("b-progress", b"\x02", namespace="team-a")  # a later post does not move it
    store.topic_append("b-logs", b"\x01", namespace="team-b")
    store.topic_append("a-progress", b"\x01", namespace="team-a")
    store.topic_post("local", b"\x01")  # the local plane's posts belong to no namespace
    assert store.count_topics("team-b", 10) == 2 and store.count_topics("team-b", 1) == 1
    assert store.count_topics("team-a", 10) == 1 and store.count_topics("default", 10) == 0
    assert store.topic_exists("b-progress") and not store.topic_exists("never-posted")


def test_presigned_bytes_are_summed_per_namespace_within_the_window(store: SqlStore) -> None:
    start = time.time()
    store.record_payload("team-b", "payloads/team-b/2026/01/01/j1/args", 1000, keep_s=3600)
    store.record_payload("team-b", "payloads/team-b/2026/01/01/j2/args", 500, keep_s=3600)
    store.record_payload("team-a", "payloads/team-a/2026/01/01/j1/args", 7, keep_s=3600)
    assert store.payload_bytes("team-b", start - 1) == 1500
    assert store.payload_bytes("team-a", start - 1) == 7 and store.payload_bytes("team-c", 0) == 0
    # the same key presigned again counts once, at its latest size
    store.record_payload("team-b", "payloads/team-b/2026/01/01/j2/args", 100, keep_s=3600)
    assert store.payload_bytes("team-b", start - 1) == 1100
    assert store.payload_bytes("team-b", time.time() + 1) == 0  # older than the window: not counted
    # a window of 0 s forgets the namespace's older presigns as the next one is recorded
    time.sleep(0.01)
    store.record_payload("team-b", "payloads/team-b/2026/01/01/j3/args", 1, keep_s=0.001)
    assert store.payload_bytes("team-b", 0) == 1
    assert store.payload_bytes("team-a", 0) == 7  # another namespace's ledger is left alone


def _req(
    namespace: str, max_queued: int | None = None, *, group: int | None = None, **rc: Any
) -> SubmitRequest:
    return SubmitRequest(
        invocation_id=new_ulid(),
        queue="q",
        function=FN,
        args_blob=b"x",
        run_config=rc,
        namespace=namespace,
        max_queued=max_queued,
        quota_group=group,
    )


def test_a_group_commit_past_max_queued_queues_up_to_it_and_refuses_the_rest(store: SqlStore) -> None:
    _submit(store, "team-b")  # one queued already, without a check
    reqs = [_req("team-b", 3) for _ in range(5)]
    repeat = dataclasses.replace(reqs[4])  # a repeat of a refused one is refused with it
    results = store.write_batch([*reqs, repeat, _req("team-a", 1)])
    assert results[:2] == [SubmitResult(r.invocation_id, "q") for r in reqs[:2]]
    refused = results[2:6]
    assert all(isinstance(r, QuotaExceeded) for r in refused), results
    e = refused[0]
    assert isinstance(e, QuotaExceeded)
    assert (e.status, e.quota, e.limit, e.retry_after) == (429, "max_queued", 3, 5)
    assert str(e).startswith(
        "namespace 'team-b' is at its quota max_queued of 3 queued invocations (3 queued, 1 more asked): "
        "retry once some have run"
    )
    assert isinstance(results[6], SubmitResult)  # another namespace's room is its own
    assert store.count_queued("team-b", 100) == 3  # nothing over the quota stayed
    assert [store.get(r.invocation_id) for r in reqs[2:]] == [None] * 3
    with pytest.raises(QuotaExceeded, match="max_queued of 3"):  # the lone submit holds it too
        store.submit(_req("team-b", 3))


def test_repeats_and_delayed_submits_add_nothing_and_a_group_goes_whole_or_not_at_all(
    store: SqlStore,
) -> None:
    first = _req("team-b", 2, key="k1")
    assert store.write_batch([first]) == [SubmitResult(first.invocation_id, "q")]
    same_key = _req("team-b", 2, key="k1")  # an idempotent repeat by key
    delayed = _req("team-b", 2, not_before=time.time() + 3600)  # not due: not queued yet
    fresh = _req("team-b", 2)
    results = store.write_batch([dataclasses.replace(first), same_key, delayed, fresh])
    assert results == [
        SubmitResult(first.invocation_id, "q", duplicate=True),
        SubmitResult(first.invocation_id, "q", duplicate=True),
        SubmitResult(delayed.invocation_id, "q"),
        SubmitResult(fresh.invocation_id, "q"),
    ]
    assert store.count_queued("team-b", 100) == 2  # full, at a limit of 2
    # room for one at a limit of 3: a submit-batch of two is refused whole, the lone one after it passes
    group = [_req("team-b", 3, group=7) for _ in range(2)]
    alone = _req("team-b", 3)
    results = store.write_batch([*group, alone])
    assert [type(r) for r in results] == [QuotaExceeded, QuotaExceeded, SubmitResult]
    assert "(2 queued, 2 more asked)" in str(results[0])
    assert [store.get(r.invocation_id) for r in group] == [None, None]
    assert store.count_queued("team-b", 100) == 3
    # a group of repeats asks for nothing more: answered as duplicates at a full quota
    again = store.write_batch([dataclasses.replace(r, quota_group=8) for r in (fresh, alone)])
    assert [(r.invocation_id, r.duplicate) for r in again if isinstance(r, SubmitResult)] == [
        (fresh.invocation_id, True),
        (alone.invocation_id, True),
    ]
    assert store.write_batch([_req("team-b")]) != []  # no limit passed: no check (the caller's choice)


def test_concurrent_submits_of_two_stores_never_pass_max_queued(store: SqlStore, store_url: str) -> None:
    """Two stores on one database (two server processes), eight threads each submitting at once:
    on PostgreSQL (READ COMMITTED, writers side by side) only the namespace's lock keeps their
    counts from passing together."""
    other = store if store_url == ":memory:" else open_store(store_url)  # (memory: the process's own)
    answers: list[Any] = []
    start = threading.Barrier(8)

    def submit(s: SqlStore) -> None:
        start.wait()
        for _ in range(5):
            answers.extend(s.write_batch([_req("team-b", 6), _req("team-b", 6)]))

    try:
        threads = [threading.Thread(target=submit, args=(s,)) for s in (store, other) * 4]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    finally:
        if other is not store:
            other.close()
    assert len(answers) == 80
    assert sum(isinstance(a, SubmitResult) for a in answers) == 6
    assert sum(isinstance(a, QuotaExceeded) for a in answers) == 74
    assert store.count_queued("team-b", 100) == 6


def test_quota_locks_of_namespaces_sharing_a_lock_key_never_deadlock(store: SqlStore) -> None:
    """PostgreSQL serialises quota-checked submits with one advisory lock per namespace, keyed by
    a 32-bit hash of its name. "ns3588" and "ns4110" share a key and "ns4" sorts between them, so
    taken in the names' order, {ns3588, ns4} and {ns4, ns4110} took the same two locks in opposite
    orders: a deadlock (40P01), every write of both group commits answered 503. In key order, never."""
    from dreamlake.lakeshore.store.quotas import _lock_key, lock_queued_in

    if store.db.dialect != "postgresql":
        pytest.skip("SQLite's writes are one at a time: no advisory locks")
    a, b, c = "ns3588", "ns4", "ns4110"
    assert a < b < c and _lock_key(a) == _lock_key(c) != _lock_key(b)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def tx(namespaces: list[str]) -> None:
        for _ in range(15):
            try:
                with store.db.engine.connect() as conn, conn.begin():
                    barrier.wait(10)
                    lock_queued_in(conn, "postgresql", namespaces)
                    time.sleep(0.002)  # held a moment, as a submit's count and insert hold them
            except Exception as exc:
                errors.append(exc)
                barrier.abort()
                return

    threads = [threading.Thread(target=tx, args=(ns,)) for ns in ([a, b], [b, c])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
