"""Per-namespace quotas as every store keeps and counts them (SQLite file and memory, PostgreSQL):
the three limits set, replaced and lifted together; the counts the server's checks read
(queued invocations, topics a namespace made, bytes presigned within a window), each confined to
its namespace and bounded by ``up_to``. The 429s are the server's: tests/security/test_quotas.py
plays them from the attacker's side."""

from __future__ import annotations

import time

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.api import Quota, SubmitRequest
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
