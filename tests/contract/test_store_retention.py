"""Retention (issue 12, item 7), on every store: before, nothing was ever deleted (results, frames
and finished invocations grew for ever). Now ``gc_batch`` deletes finished work older than its
queue's retention, with its journal and attempts, a bounded batch per transaction, and names the S3
payload keys expired exec jobs referenced; live work and recent work stay.
"""

from __future__ import annotations

import time

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.store.exec_jobs import archive_keys
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import ack, submit

DAY = 86400.0


def _finished(store: SqlStore, queue: str = "q", frames: int = 3) -> str:
    inv = submit(store, queue)
    store.claim("w", [queue])
    batch = [(s, wire.encode_frame(wire.FRAME_VALUE, s, wire.pack(s)), False) for s in range(frames)]
    store.append_frames(inv, 1, batch, worker_id="w")
    ack(store, inv, "succeeded", attempt=1, worker_id="w", result_blob=b"\xc0")
    return inv


def test_finished_work_past_its_retention_is_deleted_with_its_frames_and_attempts(store: SqlStore) -> None:
    old = _finished(store)
    queued = submit(store)  # waiting: never expires
    later = time.time() + 8 * DAY  # a week and a day on
    assert store.gc_batch(time.time(), 7 * DAY).rows == 0  # nothing is a week old yet
    got = store.gc_batch(later, 7 * DAY)
    assert (got.invocations, got.frames, got.exec_jobs) == (1, 3, 0)
    assert store.get(old) is None and store.read_frames(old) == []
    assert store.get(queued) is not None
    assert store.gc_batch(later, 7 * DAY).rows == 0  # idempotent


def test_a_tree_is_kept_whole_while_any_call_of_it_runs(store: SqlStore) -> None:
    """A finished parent (and a finished sibling) past retention stay while a child of their tree
    still runs: deleted, the tree's status and its cancel (walked from the root down its parent
    links) would lose the running child. Once the tree is done, all of it goes."""
    parent = submit(store, "tree")
    store.claim("w", ["tree"])
    done_child = submit(store, "tree", parent=parent)
    store.claim("w", ["tree"])
    ack(store, done_child, "succeeded", attempt=1, worker_id="w", result_blob=b"\xc0")
    running = submit(store, "tree", parent=parent)
    store.claim("w", ["tree"])
    ack(store, parent, "succeeded", attempt=1, worker_id="w", result_blob=b"\xc0")
    other = _finished(store, "tree")  # a call of no tree: expires as before
    later = time.time() + 8 * DAY
    got = store.gc(later, 7 * DAY)
    assert got.invocations == 1 and store.get(other) is None
    assert store.get(parent) is not None and store.get(done_child) is not None
    assert [d[0] for d in store.descendants(parent)] == [done_child, running]  # its cancel reaches it
    ack(store, running, "succeeded", attempt=1, worker_id="w", result_blob=b"\xc0")
    assert store.gc(later, 7 * DAY).invocations == 3
    assert store.get(parent) is None and store.get(running) is None


def test_a_queue_keeps_its_own_retention_and_off_keeps_for_ever(store: SqlStore) -> None:
    gpu, scratch, audit, plain = (_finished(store, q) for q in ("gpu", "scratch", "audit", "plain"))
    rules = {"gpu": 30 * DAY, "scratch": 3600.0, "audit": 0}
    got = store.gc(time.time() + 2 * 3600, 7 * DAY, rules)  # two hours on: only scratch expired
    assert got.invocations == 1 and store.get(scratch) is None
    got = store.gc(time.time() + 8 * DAY, 7 * DAY, rules)  # eight days on: the default too
    assert got.invocations == 1 and store.get(plain) is None and store.get(gpu) is not None
    got = store.gc(time.time() + 31 * DAY, 7 * DAY, rules)
    assert got.invocations == 1 and store.get(gpu) is None
    assert store.gc(time.time() + 3650 * DAY, 7 * DAY, rules).rows == 0 and store.get(audit) is not None
    assert store.gc(time.time() + 3650 * DAY, None, {}).rows == 0  # no default: everything kept


def test_a_batch_is_bounded_and_gc_runs_batches_until_done(store: SqlStore) -> None:
    ids = [_finished(store, frames=1) for _ in range(7)]
    later = time.time() + 8 * DAY
    first = store.gc_batch(later, 7 * DAY, limit=3)
    assert first.invocations == 3
    rest = store.gc(later, 7 * DAY, limit=3)
    assert rest.invocations == 4 and all(store.get(i) is None for i in ids)


def test_expired_exec_jobs_name_the_payload_keys_they_referenced(store: SqlStore) -> None:
    ref = {"key": "payloads/2026/01/01/job/args", "sha256": "0" * 64, "size": 10}
    job = store.create_exec(
        "ns", "cat", payload_inline=None, payload_ref=ref, queue="q", worker_id=None, timeout_s=None
    )
    created_at = store.get_exec("ns", job)["created_at"]  # type: ignore[index]
    store.claim_exec("w", ["q"])
    result = {"exit_code": 0, "payload_ref": {"key": "payloads/2026/01/01/job/stdout"}}
    assert store.publish_exec_result("ns", job, result, worker_id="w").ok
    running = store.create_exec(
        "ns", "sleep 9", payload_inline=None, payload_ref=ref, queue="q", worker_id=None, timeout_s=None
    )
    got = store.gc(time.time() + 8 * DAY, 7 * DAY)
    assert got.exec_jobs == 1 and store.get_exec("ns", job) is None
    archived = archive_keys(job, float(created_at))  # its output archive (issue 36) goes too
    # its args are still the queued job's (the same payloadRef sent twice): kept for it
    assert sorted(got.payload_keys) == sorted(["payloads/2026/01/01/job/stdout", *archived])
    assert store.get_exec("ns", running) is not None  # not done: kept
    store.claim_exec("w", ["q"])
    published = {"exit_code": 0, "resultRef": {"key": "payloads/2026/01/01/running/result"}}
    assert store.publish_exec_result("ns", running, published, worker_id="w").ok
    later = store.gc(time.time() + 8 * DAY, 7 * DAY)  # the last job naming the args: they go now
    assert later.exec_jobs == 1 and {
        "payloads/2026/01/01/job/args",
        "payloads/2026/01/01/running/result",  # what the daemon published (resultRef) goes too
    } <= set(later.payload_keys)
