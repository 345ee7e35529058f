"""The store contract, run against SQLite (file and :memory:) and PostgreSQL."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from typing import Any

import pytest

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.api import SubmitRequest
from dreamlake.lakeshore.store.claims import MERGED_QUEUES_MAX
from dreamlake.lakeshore.store.notify import exec_queue_channel
from dreamlake.lakeshore.store.sql import SqlStore
from dreamlake.lakeshore.store.values import normalize_max_attempts, normalize_priority
from tests.contract.store_kit import FN, FUTURE, ack, submit

# -- submit -----------------------------------------------------------------------------------


def test_submit_stores_the_row_with_queue_stamped(store: SqlStore) -> None:
    inv = submit(store, "gpu", priority=2.9, extra={"a": [1, 2]})
    row = store.get(inv)
    assert row is not None
    assert (row.state, row.queue, row.priority, row.attempt, row.max_attempts) == ("queued", "gpu", 2, 0, 3)
    assert row.run_config == {"priority": 2.9, "extra": {"a": [1, 2]}, "queue": "gpu"}
    assert row.args_blob == b"env-" + inv.encode()
    assert row.function == FN
    assert store.get(new_ulid()) is None


def test_empty_queue_defaults_to_default(store: SqlStore) -> None:
    inv = submit(store, "")
    assert store.get(inv).queue == "default"  # type: ignore[union-attr]
    assert store.claim("w", ["default"])[0].invocation_id == inv


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, 5),
        (-3, -3),
        (2.9, 2),
        (-2.9, -2),
        (True, 0),
        ("7", 0),
        (None, 0),
        (math.nan, 0),
        (math.inf, 0),
        (-math.inf, 0),
        ([1], 0),
        (10**30, 2**63 - 1),
    ],
)
def test_priority_normalisation(value: Any, expected: int) -> None:
    assert normalize_priority(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 3), (1, 1), (0, 1), (-5, 1), (7.8, 7), (1000, 100), ("9", 3), (True, 3)]
)
def test_max_attempts_normalisation(value: Any, expected: int) -> None:
    assert normalize_max_attempts(value) == expected


def test_non_finite_priority_is_stored_and_sorts_as_zero(store: SqlStore) -> None:
    a = submit(store, priority=math.nan)
    b = submit(store, priority=1)
    assert store.get(a).priority == 0  # type: ignore[union-attr]
    assert [i.invocation_id for i in store.claim("w", ["q"], limit=2)] == [b, a]


def test_idempotency_key_returns_existing_invocation_of_same_queue(store: SqlStore) -> None:
    first = submit(store, "q", key="k1")
    again = store.submit(SubmitRequest(new_ulid(), "q", FN, b"other", {"key": "k1"}))
    assert (again.invocation_id, again.duplicate) == (first, True)
    other_queue = store.submit(SubmitRequest(new_ulid(), "q2", FN, b"x", {"key": "k1"}))
    assert other_queue.duplicate is False and other_queue.invocation_id != first
    assert len(store.claim("w", ["q", "q2"], limit=10)) == 2


def test_resubmit_same_id_is_idempotent_and_different_content_conflicts(store: SqlStore) -> None:
    inv = new_ulid()
    req = SubmitRequest(inv, "q", FN, b"abc", {"priority": 1})
    assert store.submit(req).duplicate is False
    assert store.submit(req).duplicate is True
    with pytest.raises(PlaneError) as err:
        store.submit(SubmitRequest(inv, "q", FN, b"different", {"priority": 1}))
    assert err.value.status == 409
    assert len(store.claim("w", ["q"], limit=5)) == 1


def test_non_json_run_config_is_refused_clearly(store: SqlStore) -> None:
    with pytest.raises(PlaneError, match="run_config must hold JSON data") as err:
        store.submit(SubmitRequest(new_ulid(), "q", FN, b"x", {"blob": b"\x00"}))
    assert err.value.status == 400


def test_root_resolution(store: SqlStore) -> None:
    root = submit(store)
    child = submit(store, parent=root)
    grandchild = submit(store, parent=child)
    orphan_parent = new_ulid()
    orphan = submit(store, parent=orphan_parent)
    assert store.get(root).root_invocation_id is None  # type: ignore[union-attr]
    assert store.get(child).root_invocation_id == root  # type: ignore[union-attr]
    g = store.get(grandchild)
    assert g is not None and (g.parent_invocation_id, g.root_invocation_id) == (child, root)
    assert store.get(orphan).root_invocation_id == orphan_parent  # type: ignore[union-attr]


def test_lineage_and_descendants_walk_the_tree(store: SqlStore) -> None:
    root = submit(store)
    a, b = submit(store, parent=root), submit(store, parent=root)
    a1 = submit(store, parent=a)
    a11 = submit(store, parent=a1)
    other = submit(store)
    submit(store, parent=other)
    assert store.lineage(a11) == [a11, a1, a, root]
    assert store.lineage(a11, limit=2) == [a11, a1]
    assert store.lineage(other) == [other]
    unknown = new_ulid()
    assert store.lineage(unknown) == [unknown]
    assert store.descendants(root) == [
        (a, root, "queued"),
        (b, root, "queued"),
        (a1, a, "queued"),
        (a11, a1, "queued"),
    ]
    assert store.descendants(a) == [(a1, a, "queued"), (a11, a1, "queued")]
    assert store.descendants(a11) == [] and store.descendants(unknown) == []


def test_server_key_is_made_once_and_kept(store: SqlStore) -> None:
    key = store.server_key("task-token")
    assert isinstance(key, bytes) and len(key) == 32
    assert store.server_key("task-token") == key
    assert store.server_key("another") != key


# -- claim ------------------------------------------------------------------------------------


def test_claim_order_priority_then_submission_then_id(store: SqlStore) -> None:
    low = submit(store, priority=0)
    high1 = submit(store, priority=5)
    high2 = submit(store, priority=5)
    mid = submit(store, priority=1.5)
    submit(store, "elsewhere", priority=100)
    got = store.claim("w", ["q"], limit=10, lease_s=60)
    assert [i.invocation_id for i in got] == [high1, high2, mid, low]
    first = got[0]
    assert (first.state, first.worker_id, first.attempt) == ("running", "w", 1)
    assert first.started_at is not None and first.lease_expires_at is not None
    assert store.claim("w", ["q"]) == []


def test_claim_respects_limit_and_queues(store: SqlStore) -> None:
    for _ in range(3):
        submit(store, "a")
    submit(store, "b")
    assert store.claim("w", [], limit=5) == []
    assert len(store.claim("w", ["a"], limit=2)) == 2
    assert len(store.claim("w", ["a", "b"], limit=5)) == 2


def test_a_claim_of_several_queues_takes_the_best_across_them(store: SqlStore) -> None:
    a_low = submit(store, "a", priority=0)
    b_high = submit(store, "b", priority=5)
    a_high = submit(store, "a", priority=5)
    c_mid = submit(store, "c", priority=2)
    submit(store, "elsewhere", priority=100)
    got = store.claim("w", ["c", "a", "b", "a"], limit=3)  # a queue named twice counts once
    assert [i.invocation_id for i in got] == [b_high, a_high, c_mid]
    assert [i.invocation_id for i in store.claim("w", ["a", "b", "c"], limit=3)] == [a_low]


def test_a_claim_of_more_queues_than_merged_keeps_the_order(store: SqlStore) -> None:
    queues = [f"q{n:02d}" for n in range(MERGED_QUEUES_MAX + 4)]
    ids = {q: submit(store, q, priority=n % 3) for n, q in enumerate(queues)}
    got = store.claim("w", queues, limit=len(queues))
    expected = sorted(queues, key=lambda q: -(queues.index(q) % 3))  # priority desc, then submission
    assert [i.invocation_id for i in got] == [ids[q] for q in expected]


def test_a_claim_of_more_heads_than_merged_takes_the_best_of_every_group_and_leaves_the_rest(
    store: SqlStore,
) -> None:
    """Past ``MERGED_QUEUES_MAX`` heads the claim picks each head's first rows in groups (before:
    one statement that read and sorted every queued row of those heads, at any backlog)."""
    queues = [f"q{n:02d}" for n in range(2 * MERGED_QUEUES_MAX + 3)]  # three groups of heads
    backlog = {q: [submit(store, q) for _ in range(3)] for q in queues}
    best = [
        submit(store, queues[-1], priority=9),  # the last group
        submit(store, queues[MERGED_QUEUES_MAX], priority=8),  # the middle one
        submit(store, queues[0], priority=7),  # the first
    ]
    assert [i.invocation_id for i in store.claim("w", queues, limit=3)] == best
    # then the oldest of priority 0: the first queue's backlog, submitted first
    assert [i.invocation_id for i in store.claim("w", queues, limit=2)] == backlog[queues[0]][:2]
    left = store.claim("w", list(reversed(queues)), limit=1000)
    assert len(left) == 3 * len(queues) - 2 and len({i.invocation_id for i in left}) == len(left)


def _drain_concurrently(store: SqlStore, queues: list[str]) -> list[str]:
    """Six threads claim two at a time from ``queues`` until a claim comes back empty."""
    claimed: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            while True:
                got = store.claim(f"w{n}", queues, limit=2)
                if not got:
                    return
                with lock:
                    claimed.extend(i.invocation_id for i in got)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    return claimed


def test_no_double_claim_under_concurrency(store: SqlStore) -> None:
    ids = {submit(store) for _ in range(60)}
    claimed = _drain_concurrently(store, ["q"])
    assert Counter(claimed).most_common(1)[0][1] == 1
    assert set(claimed) == ids


def test_no_double_claim_across_queues_under_concurrency(store: SqlStore) -> None:
    ids = {submit(store, f"q{n % 3}", priority=n % 4) for n in range(60)}
    claimed = _drain_concurrently(store, ["q0", "q1", "q2"])
    assert Counter(claimed).most_common(1)[0][1] == 1
    assert set(claimed) == ids


# -- ack --------------------------------------------------------------------------------------


def test_ack_records_outcome_and_repeat_is_duplicate(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("w", ["q"])
    res = ack(store, inv, attempt=1, worker_id="w", result_blob=b"R")
    assert (res.ok, res.duplicate, res.state) == (True, False, "succeeded")
    row = store.get(inv)
    assert row is not None and row.result_blob == b"R" and row.finished_at is not None
    assert row.lease_expires_at is None
    again = ack(store, inv, attempt=1, worker_id="w", result_blob=b"R")
    assert (again.ok, again.duplicate) == (True, True)
    other = ack(store, inv, "failed", attempt=1, worker_id="w", error={"type": "X", "message": "m"})
    assert other.ok is False and other.reason
    assert store.get(inv).state == "succeeded"  # type: ignore[union-attr]


def test_ack_refusals(store: SqlStore) -> None:
    inv = submit(store)
    queued = ack(store, inv)
    assert queued.ok is False and queued.state == "queued"
    store.claim("w1", ["q"])
    wrong_worker = ack(store, inv, worker_id="w2")
    assert wrong_worker.ok is False
    unknown = ack(store, new_ulid())
    assert unknown.ok is False and unknown.state is None
    with pytest.raises(PlaneError) as err:
        ack(store, inv, "running")
    assert err.value.status == 400
    assert store.get(inv).state == "running"  # type: ignore[union-attr]


def test_acks_in_one_batch_compare_whole_ids_as_a_lone_ack_does(store: SqlStore) -> None:
    """An ack from a worker whose id only begins with the holder's is refused, alone or several in
    one group commit (on PostgreSQL one ``UPDATE ... FROM (VALUES ...)``, whose values were once
    cast to ``VARCHAR(64)``: a longer id was cut to the holder's and its acks landed)."""
    from dreamlake.lakeshore.store.api import AckRequest

    holder = "w" * 64  # an id of the column's whole length
    other = holder + "-not-the-holder"
    invs = [submit(store) for _ in range(3)]
    claimed = store.claim(holder, ["q"], limit=3)
    assert {c.invocation_id for c in claimed} == set(invs)
    lone, *pair = claimed
    alone = store.write_batch([AckRequest(lone.invocation_id, "succeeded", lone.attempt, other, b"forged")])
    batch = store.write_batch(
        [AckRequest(i.invocation_id, "succeeded", i.attempt, other, b"forged") for i in pair]
    )
    assert [(r.ok, r.status) for r in (*alone, *batch)] == [(False, 403)] * 3  # type: ignore[union-attr]
    for inv in claimed:
        row = store.get(inv.invocation_id)
        assert row is not None and (row.state, row.worker_id, row.result_blob) == ("running", holder, None)


def test_an_ack_of_a_call_finished_earlier_in_the_same_group_commit_is_refused_to_another_worker(
    store: SqlStore,
) -> None:
    """One group commit: the holder's ack of a call, then (after another write) acks of the same
    call and of an unknown one from another worker. The others' acks are refused and the holder's
    result stands. Once, a run of acks that matched fewer rows than it had read its rows back and
    took an ack as applied when its row held its state with this transaction's time: the holder's
    ack, earlier in the transaction, made the forger's look applied (answered ok, its forged
    result handed to the call's waiters)."""
    from dreamlake.lakeshore.store.api import AckRequest, FramesRequest

    inv = submit(store)
    (claimed,) = store.claim("holder", ["q"])
    out = store.write_batch(
        [
            AckRequest(inv, "succeeded", claimed.attempt, "holder", b"genuine"),
            FramesRequest(new_ulid(), 1, [(0, b"frame", False)], "forger"),  # ends the run of acks
            AckRequest(inv, "succeeded", claimed.attempt, "forger", b"forged"),
            AckRequest(new_ulid(), "succeeded", 1, "forger", b"forged"),
        ]
    )
    genuine, _frames, forged, unknown = out
    assert genuine.ok and not genuine.duplicate  # type: ignore[union-attr]
    assert (forged.ok, forged.status) == (False, 403), forged  # type: ignore[union-attr]
    assert not unknown.ok  # type: ignore[union-attr]
    row = store.get(inv)
    assert row is not None
    assert (row.state, row.worker_id, row.result_blob) == ("succeeded", "holder", b"genuine")
    # the holder's own ack read back the same way is applied, its error as JSON keeps it (a tuple
    # comes back a list)
    killed = submit(store)
    (held,) = store.claim("holder", ["q"])
    error = {"type": "Killed", "message": "by the test", "args": (1, 2)}
    mine, stranger = store.write_batch(
        [
            AckRequest(killed, "killed", held.attempt, "holder", None, error),
            AckRequest(new_ulid(), "succeeded", 1, "holder", b"x"),  # matches no row: a read back
        ]
    )
    assert (mine.ok, mine.duplicate) == (True, False) and not stranger.ok  # type: ignore[union-attr]


def test_ack_from_superseded_attempt_is_refused(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("w1", ["q"])
    assert store.expire_leases(now=FUTURE) == [inv]
    again = store.claim("w2", ["q"])
    assert again[0].attempt == 2
    stale = ack(store, inv, attempt=1, worker_id="w1", result_blob=b"old")
    assert stale.ok is False and "superseded" in (stale.reason or "")
    assert ack(store, inv, attempt=2, worker_id="w2", result_blob=b"new").ok
    assert store.get(inv).result_blob == b"new"  # type: ignore[union-attr]


def test_bare_string_error_is_stored_as_error_info(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("w", ["q"])
    assert ack(store, inv, "failed", error="boom").ok
    assert store.get(inv).error == {"type": "DaemonError", "message": "boom"}  # type: ignore[union-attr]


# -- frames -----------------------------------------------------------------------------------


def test_frames_duplicate_and_since(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("w", ["q"])
    for seq in range(4):
        assert store.append_frame(inv, seq, b"f%d" % seq, seq == 3, attempt=1).ok
    dup = store.append_frame(inv, 1, b"changed", False, attempt=1)
    assert (dup.ok, dup.duplicate, dup.seq) == (True, True, 1)
    assert [f.seq for f in store.read_frames(inv)] == [0, 1, 2, 3]
    assert store.read_frames(inv)[1].data == b"f1"
    tail = store.read_frames(inv, since=1)
    assert [(f.seq, f.data, f.final) for f in tail] == [(2, b"f2", False), (3, b"f3", True)]
    assert [f.seq for f in store.read_frames(inv, since=-1, limit=2)] == [0, 1]
    assert store.read_frames(inv, since=3) == []


def test_frames_from_superseded_attempt_are_refused(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("w1", ["q"])
    store.expire_leases(now=FUTURE)
    store.claim("w2", ["q"])
    stale = store.append_frame(inv, 0, b"old", False, attempt=1)
    assert stale.ok is False and "superseded" in (stale.reason or "")
    assert store.append_frame(inv, 0, b"new", False, attempt=2).ok
    assert store.append_frame(new_ulid(), 0, b"x", False, attempt=1).ok is False
    assert [f.data for f in store.read_frames(inv)] == [b"new"]


# -- heartbeat, cancel, leases ----------------------------------------------------------------


def test_heartbeat_renews_owned_and_reports_lost(store: SqlStore) -> None:
    a, b = submit(store), submit(store)
    store.register_worker("w", {"hostname": "h"})
    claimed = {i.invocation_id: i for i in store.claim("w", ["q"], limit=2, lease_s=5)}
    before = claimed[a].lease_expires_at
    ack(store, b, worker_id="w")
    commands, lost = store.heartbeat("w", [(a, 1), (b, 1), (new_ulid(), 1)], lease_s=1000)
    assert commands == []
    assert a not in lost and b in lost and len(lost) == 2
    after = store.get(a).lease_expires_at  # type: ignore[union-attr]
    assert before is not None and after is not None and after > before
    _, lost_wrong_attempt = store.heartbeat("w", [(a, 7)])
    assert lost_wrong_attempt == [a]
    _, lost_other_worker = store.heartbeat("other", [(a, 1)])
    assert lost_other_worker == [a]


def test_cancel_queued_running_terminal_unknown(store: SqlStore) -> None:
    queued = submit(store)
    assert store.cancel(queued) == "cancelled"
    row = store.get(queued)
    assert row is not None and row.finished_at is not None
    assert store.claim("w", ["q"]) == []

    running = submit(store)
    store.claim("w", ["q"])
    assert store.cancel(running) == "running"
    assert store.cancel(running) == "running"  # a second cancel queues no second command
    assert store.get(running).cancel_requested is True  # type: ignore[union-attr]
    commands, lost = store.heartbeat("w", [(running, 1)])
    assert [(c.kind, c.body["invocation_id"]) for c in commands] == [("cancel", running)]
    assert commands[0].body["reason"] == "cancelled by producer"
    assert lost == []
    assert store.poll("w", ["q"], limit=1, lease_s=60)[0] == []  # the queued command goes out once
    # ...but a beat that still reports the invocation running is asked again (its answer may have
    # been lost, or reached nymph before the job did), with a command of its own
    again, lost = store.heartbeat("w", [(running, 1)])
    assert [(c.kind, c.body["invocation_id"]) for c in again] == [("cancel", running)] and lost == []
    assert again[0].body["reason"] == "cancelled by producer" and again[0].id != commands[0].id
    assert store.heartbeat("w", []) == ([], [])  # a beat without it is asked nothing
    ack(store, running, "killed", error={"type": "Cancelled", "message": "cancelled by producer"})
    assert store.cancel(running) == "killed"
    assert store.cancel(new_ulid()) is None


def test_lease_expiry_requeues_then_fails_after_max_attempts(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2)
    store.claim("w", ["q"], lease_s=30)
    assert store.expire_leases(now=time.time()) == []  # lease still valid
    assert store.expire_leases(now=FUTURE) == [inv]
    row = store.get(inv)
    assert row is not None and (row.state, row.worker_id, row.attempt) == ("queued", None, 1)
    assert store.claim("w", ["q"])[0].attempt == 2
    assert store.expire_leases(now=FUTURE) == [inv]
    row = store.get(inv)
    assert row is not None and row.state == "failed" and row.finished_at is not None
    assert row.error is not None and row.error["type"] == "LeaseExpired"
    assert store.claim("w", ["q"]) == []


def test_lease_expiry_after_cancel_request_cancels(store: SqlStore) -> None:
    inv = submit(store)
    store.claim("w", ["q"])
    store.cancel(inv)
    assert store.expire_leases(now=FUTURE) == [inv]
    assert store.get(inv).state == "cancelled"  # type: ignore[union-attr]


# -- topics -----------------------------------------------------------------------------------


def test_topic_post_frames_and_seq(store: SqlStore) -> None:
    import msgpack

    assert store.topic_post("progress", b"\xa1a") == 0
    assert store.topic_post("progress", b"\xa1b") == 1
    assert store.topic_post("progress", b"\xc0", final=True) == 2
    assert store.topic_post("other", b"\xc0") == 0
    frames = store.read_frames("topic:progress")
    decoded = [msgpack.unpackb(f.data) for f in frames]
    assert [(d[0], d[1], d[2]) for d in decoded] == [(1, 0, b"\xa1a"), (1, 1, b"\xa1b"), (2, 2, b"\xc0")]
    assert [f.final for f in frames] == [False, False, True]


def test_topic_seq_under_concurrency(store: SqlStore) -> None:
    seqs: list[int] = []
    lock = threading.Lock()

    def post() -> None:
        for _ in range(8):
            s = store.topic_post("busy", b"\x01")
            with lock:
                seqs.append(s)

    threads = [threading.Thread(target=post) for _ in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(seqs) == list(range(40))
    assert [f.seq for f in store.read_frames("topic:busy")] == list(range(40))


# -- tokens, namespaces, workers, exec --------------------------------------------------------


def test_tokens(store: SqlStore) -> None:
    assert store.count_tokens() == 0
    secret = store.create_token("namespace", "ci", namespace="ns1")
    assert secret.startswith("lsk_") and len(secret) > 40
    p = store.verify_token(secret)
    assert p is not None and (p.kind, p.namespace, p.name) == ("namespace", "ns1", "ci")
    assert store.verify_token(secret + "x") is None
    assert store.verify_token("not-a-token") is None
    assert store.count_tokens() == 1
    with store.db.tx(write=False) as conn:
        import sqlalchemy as sa

        stored = conn.execute(sa.text("SELECT secret_sha256 FROM tokens")).scalars().all()
    assert secret not in stored
    with pytest.raises(PlaneError, match="unknown token kind"):
        store.create_token("root", "x")
    with pytest.raises(PlaneError, match="needs a namespace"):
        store.create_token("namespace", "x")


def test_pin_version(store: SqlStore) -> None:
    assert store.pinned_version("ns") is None
    store.pin_version("ns", "0.1.4")
    assert store.pinned_version("ns") == "0.1.4"
    store.pin_version("ns", None)
    assert store.pinned_version("ns") is None


def test_register_worker_upserts(store: SqlStore) -> None:
    store.register_worker("w", {"slots": 1})
    store.register_worker("w", {"slots": 2})
    with store.db.tx(write=False) as conn:
        import sqlalchemy as sa

        rows = conn.execute(sa.text("SELECT info FROM workers")).all()
    assert len(rows) == 1


def test_exec_jobs(store: SqlStore) -> None:
    anyone = store.create_exec(
        "ns", "echo hi", payload_inline=b"p", payload_ref=None, queue="default", worker_id=None, timeout_s=5
    )
    for_w2 = store.create_exec(
        "ns",
        "true",
        payload_inline=None,
        payload_ref={"key": "payloads/x"},
        queue="default",
        worker_id="w2",
        timeout_s=None,
    )
    store.create_exec(
        "ns", "x", payload_inline=None, payload_ref=None, queue="gpu", worker_id=None, timeout_s=None
    )
    got = store.claim_exec("w1", ["default"], limit=5)
    assert [j["exec_id"] for j in got] == [anyone]
    assert got[0]["payload_inline"] == b"p" and got[0]["command"] == "echo hi" and got[0]["timeout_s"] == 5
    got2 = store.claim_exec("w2", ["default"], limit=5)
    assert [j["exec_id"] for j in got2] == [for_w2] and got2[0]["payload_ref"] == {"key": "payloads/x"}
    assert store.get_exec("ns", anyone)["state"] == "running"  # type: ignore[index]
    assert store.publish_exec_result("ns", anyone, {"exit_code": 0, "stdout": "hi\n", "stderr": ""}).ok
    unknown = store.publish_exec_result("other-ns", anyone, {"exit_code": 1})
    assert (unknown.ok, unknown.state) == (False, None)
    done = store.get_exec("ns", anyone)
    assert done is not None and done["state"] == "done" and done["result"]["exit_code"] == 0
    assert store.get_exec("other-ns", anyone) is None
    with pytest.raises(PlaneError, match="mutually exclusive"):
        store.create_exec(
            "ns",
            "x",
            payload_inline=b"a",
            payload_ref={"key": "payloads/y"},
            queue="default",
            worker_id=None,
            timeout_s=None,
        )


def test_poll_takes_cancels_claims_then_fills_free_slots_with_exec_jobs(store: SqlStore) -> None:
    running = submit(store)
    (first,) = store.claim("w", ["q"])
    assert store.cancel(running) == "running"
    low, high = submit(store, priority=0), submit(store, priority=9)
    job = store.create_exec(
        "ns", "true", payload_inline=None, payload_ref=None, queue="q", worker_id=None, timeout_s=None
    )
    commands, claimed, jobs = store.poll("w", ["q"], limit=2, lease_s=60)
    assert [(c.kind, c.body["invocation_id"]) for c in commands] == [("cancel", first.invocation_id)]
    assert [i.invocation_id for i in claimed] == [high, low]
    assert all(i.state == "running" and i.worker_id == "w" and i.attempt == 1 for i in claimed)
    assert all(i.started_at is not None and i.lease_expires_at is not None for i in claimed)
    assert jobs == []  # no slot left for the exec job
    commands, claimed, jobs = store.poll("w", ["q"], limit=2, lease_s=60)
    assert commands == [] and claimed == []  # a cancel is handed out once
    assert [j["exec_id"] for j in jobs] == [job] and jobs[0]["command"] == "true"
    assert store.get_exec("ns", job)["state"] == "running"  # type: ignore[index]
    assert store.poll("w", ["q"], limit=2) == ([], [], [])
    assert store.poll("w", [], limit=2) == ([], [], [])


def test_concurrent_polls_never_claim_one_invocation_twice(store: SqlStore) -> None:
    submitted = {submit(store, "race") for _ in range(30)}
    got: list[str] = []
    lock = threading.Lock()

    def drain(worker: str) -> None:
        while True:
            _, claimed, _ = store.poll(worker, ["race"], limit=2)
            if not claimed:
                return
            with lock:
                got.extend(i.invocation_id for i in claimed)

    threads = [threading.Thread(target=drain, args=(f"w{n}",)) for n in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(got) == sorted(submitted)


def test_topic_append_returns_the_journaled_frame(store: SqlStore) -> None:
    first = store.topic_append("live", b"\xa1a")
    last = store.topic_append("live", b"\xc0", final=True)
    assert (first.seq, first.final, last.seq, last.final) == (0, False, 1, True)
    assert [(f.seq, f.data, f.final) for f in store.read_frames("topic:live")] == [
        (0, first.data, False),
        (1, last.data, True),
    ]


# -- wake-ups ---------------------------------------------------------------------------------


def test_submit_and_ack_wake_waiters(store: SqlStore) -> None:
    mark = store.notifier.mark()
    inv = submit(store, "wake")
    assert store.notifier.wait(["queue:wake"], timeout=5, since=mark)
    mark = store.notifier.mark()
    store.claim("w", ["wake"])
    ack(store, inv)
    assert store.notifier.wait([f"inv:{inv}"], timeout=5, since=mark)
    assert store.notifier.wait(["queue:nothing"], timeout=0.01) is False


def test_exec_claims_of_a_namespace_bound_daemon_stay_in_its_namespace(store: SqlStore) -> None:
    mine = store.create_exec(
        "a", "true", payload_inline=None, payload_ref=None, queue="q", worker_id=None, timeout_s=None
    )
    theirs = store.create_exec(
        "b", "true", payload_inline=None, payload_ref=None, queue="q", worker_id=None, timeout_s=None
    )
    assert [j["exec_id"] for j in store.claim_exec("w", ["q"], 5, namespace="a")] == [mine]
    _, _, jobs = store.poll("w", ["q"], 5, namespace="a")
    assert jobs == []  # b's job is not a's to run
    assert store.get_exec("b", theirs)["state"] == "queued"  # type: ignore[index]
    _, _, jobs = store.poll("w", ["q"], 5, exec_jobs=False)
    assert jobs == []  # a worker that cannot run exec jobs never claims one
    assert [j["exec_id"] for j in store.poll("w", ["q"], 5)[2]] == [theirs]


def test_an_overlong_idempotency_key_is_refused_on_every_dialect(store: SqlStore) -> None:
    # The column holds 1024 characters: PostgreSQL raised (a 500), SQLite stored it.
    with pytest.raises(PlaneError, match="limit is 1024") as err:
        submit(store, key="k" * 1025)
    assert err.value.status == 400


# -- exec job leases ----------------------------------------------------------------------------


def _exec(store: SqlStore, queue: str = "q", max_attempts: int | None = None) -> str:
    return store.create_exec(
        "ns",
        "sleep 1",
        payload_inline=None,
        payload_ref=None,
        queue=queue,
        worker_id=None,
        timeout_s=None,
        max_attempts=max_attempts,
    )


def test_an_exec_claim_holds_a_lease_and_the_heartbeat_renews_it(store: SqlStore) -> None:
    job = _exec(store)
    (body,) = store.claim_exec("w", ["q"], lease_s=0.5)
    assert body["attempt"] == 1
    row = store.get_exec("ns", job)
    assert row is not None and (row["attempt"], row["max_attempts"]) == (1, 3)
    commands, lost = store.heartbeat("w", [], lease_s=1000, running_exec=[(job, 1)])
    assert (commands, lost) == ([], [])
    assert store.expire_leases(now=time.time() + 10) == []  # renewed for 1000 s
    # a stale attempt, another worker or an unknown job: lost, and nothing renewed
    _, lost = store.heartbeat("w", [], running_exec=[(job, 7)])
    assert lost == [job]
    _, lost = store.heartbeat("other", [], running_exec=[(job, 1)])
    assert lost == [job]
    gone = new_ulid()
    _, lost = store.heartbeat("w", [], running_exec=[(gone, 1)])
    assert lost == [gone]


def test_a_dead_daemons_exec_job_is_requeued_then_finished_with_exit_code_minus_one(store: SqlStore) -> None:
    """The review's finding: a claimed exec job stayed ``running`` for ever when its daemon died."""
    job = _exec(store, max_attempts=2)
    mark = store.notifier.mark()
    store.claim_exec("dead", ["q"], lease_s=60)
    assert store.expire_leases(now=time.time()) == []  # lease still valid
    assert store.expire_leases(now=FUTURE) == [job]
    assert store.notifier.wait([exec_queue_channel("ns", "q")], timeout=5, since=mark)  # a waiting poll wakes
    row = store.get_exec("ns", job)
    assert row is not None and row["state"] == "queued" and row["result"] is None
    (body,) = store.claim_exec("w2", ["q"])
    assert body["attempt"] == 2
    assert store.expire_leases(now=FUTURE) == [job]  # the last allowed attempt lapsed too
    row = store.get_exec("ns", job)
    assert row is not None and row["state"] == "done" and row["finished_at"] is not None
    result = row["result"]
    assert result["exit_code"] == -1 and "stopped renewing its lease" in result["stderr"]
    assert result["error"]["type"] == "LeaseExpired"
    assert store.claim_exec("w3", ["q"]) == []


def test_a_heartbeat_without_running_exec_renews_all_the_workers_exec_jobs(store: SqlStore) -> None:
    """A daemon from before exec leases reports no exec jobs: alive, it keeps them all."""
    job = _exec(store)
    store.claim_exec("old", ["q"], lease_s=0.01)
    store.heartbeat("old", [], lease_s=1000)  # running_exec absent
    assert store.expire_leases(now=time.time() + 10) == []
    store.heartbeat("old", [], lease_s=5000, running_exec=[])  # a new daemon running none of them
    assert store.expire_leases(now=time.time() + 2000) == [job]  # not renewed: lapses at 1000 s


def test_a_lapsed_claim_whose_daemon_is_alive_takes_its_job_back(store: SqlStore) -> None:
    job = _exec(store)
    store.claim_exec("w", ["q"], lease_s=60)
    assert store.expire_leases(now=FUTURE) == [job]  # requeued, nobody claimed it again yet
    _, lost = store.heartbeat("w", [], lease_s=60, running_exec=[(job, 1)])
    assert lost == []
    row = store.get_exec("ns", job)
    assert row is not None and (row["state"], row["attempt"]) == ("running", 1)
    assert store.claim_exec("w2", ["q"]) == []


def test_only_the_claimer_publishes_an_exec_result(store: SqlStore) -> None:
    job = _exec(store)
    never = store.publish_exec_result("ns", job, {"exit_code": 0}, worker_id="w", attempt=1)
    assert (never.ok, never.state) == (False, "queued") and "never claimed" in (never.reason or "")
    store.claim_exec("w", ["q"])
    other = store.publish_exec_result("ns", job, {"exit_code": 9}, worker_id="intruder", attempt=1)
    assert (other.ok, other.state) == (False, "running") and "not by worker intruder" in (other.reason or "")
    stale = store.publish_exec_result("ns", job, {"exit_code": 9}, worker_id="w", attempt=2)
    assert not stale.ok and "superseded" in (stale.reason or "")
    assert store.get_exec("ns", job)["state"] == "running"  # type: ignore[index]
    done = store.publish_exec_result("ns", job, {"exit_code": 0}, worker_id="w", attempt=1)
    assert (done.ok, done.duplicate) == (True, False)
    again = store.publish_exec_result("ns", job, {"exit_code": 5}, worker_id="w", attempt=1)
    assert (again.ok, again.duplicate) == (True, True)
    assert store.get_exec("ns", job)["result"] == {"exit_code": 0}  # type: ignore[index]
    late = store.publish_exec_result("ns", job, {"exit_code": 9}, worker_id="intruder")
    assert not late.ok and late.state == "done"


def test_a_superseded_exec_claim_cannot_publish(store: SqlStore) -> None:
    job = _exec(store)
    store.claim_exec("w1", ["q"])
    store.expire_leases(now=FUTURE)
    store.claim_exec("w2", ["q"])  # attempt 2 supersedes w1's attempt 1
    refused = store.publish_exec_result("ns", job, {"exit_code": 1}, worker_id="w1", attempt=1)
    assert not refused.ok and refused.state == "running"
    assert store.publish_exec_result("ns", job, {"exit_code": 0}, worker_id="w2", attempt=2).ok
    # the same worker claiming again: its older attempt is superseded too
    job2 = _exec(store)
    store.claim_exec("w3", ["q"])
    store.expire_leases(now=FUTURE)
    store.claim_exec("w3", ["q"])
    assert not store.publish_exec_result("ns", job2, {"exit_code": 1}, worker_id="w3", attempt=1).ok
    assert store.publish_exec_result("ns", job2, {"exit_code": 0}, worker_id="w3", attempt=2).ok


def test_a_lapsed_claim_may_still_publish_until_another_claim_takes_the_job(store: SqlStore) -> None:
    job = _exec(store)
    store.claim_exec("w", ["q"])
    store.expire_leases(now=FUTURE)  # requeued
    assert store.publish_exec_result("ns", job, {"exit_code": 0}, worker_id="w", attempt=1).ok
    assert store.get_exec("ns", job)["state"] == "done"  # type: ignore[index]
    assert store.claim_exec("w2", ["q"]) == []
    # and the claimer's real result replaces the placeholder of a last attempt that lapsed
    last = _exec(store, max_attempts=1)
    store.claim_exec("w", ["q"])
    store.expire_leases(now=FUTURE)
    assert store.get_exec("ns", last)["result"]["exit_code"] == -1  # type: ignore[index]
    assert not store.publish_exec_result("ns", last, {"exit_code": 3}, worker_id="other").ok
    assert store.publish_exec_result("ns", last, {"exit_code": 0}, worker_id="w", attempt=1).ok
    assert store.get_exec("ns", last)["result"] == {"exit_code": 0}  # type: ignore[index]


def test_an_admin_publish_is_not_checked(store: SqlStore) -> None:
    job = _exec(store)
    store.claim_exec("w", ["q"])
    assert store.publish_exec_result("ns", job, {"exit_code": 0}).ok  # worker_id None: an admin


def test_the_pinned_version_of_a_worker_comes_from_its_register(store: SqlStore) -> None:
    store.register_worker("w", {"namespace": "team-a"})
    store.register_worker("plain", {"namespace": None})
    store.pin_version("team-a", "0.1.4")
    assert store.worker_info("w") == {"namespace": "team-a"}
    assert store.worker_info("nobody") is None
    assert store.pinned_version_for_worker("w") == "0.1.4"
    assert store.pinned_version_for_worker("plain") is None
    assert store.pinned_version_for_worker("nobody") is None
    assert store.pinned_version_for_worker("plain", "team-a") == "0.1.4"  # the token's namespace wins
    store.pin_version("default", "0.2.0")
    assert store.pinned_version_for_worker("plain") == "0.2.0"
    assert store.pinned_version_for_worker("w", "default") == "0.2.0"


def test_activity_and_sweeps_for_the_dashboard(store: SqlStore) -> None:
    """The calls of one map carry run_config.sweep: counted by state per sweep (a JSON path, on
    both dialects), listed apart; activity gives the times the charts bin."""
    since = time.time() - 5
    sweep = new_ulid()
    calls = [submit(store, "m", sweep=sweep) for _ in range(3)]
    loose = submit(store, "m")
    _, claimed, _ = store.poll("w", ["m"], limit=1, lease_s=60)
    (first,) = claimed
    store.ack(first.invocation_id, "succeeded", attempt=1, worker_id="w", result_blob=b"\xc0", error=None)

    (found,) = store.sweeps(None, since)
    assert (found.sweep, found.queue, found.total) == (sweep, "m", 3)
    assert found.counts == {"succeeded": 1, "queued": 2}
    assert store.sweeps("other-namespace", since) == []
    page = store.list_invocations(None, sweep=sweep)
    assert sorted(i.invocation_id for i in page.invocations) == sorted(calls) and loose not in calls

    rows = {(r.state, r.finished_at is not None) for r in store.activity(None, since)}
    assert rows == {("succeeded", True), ("queued", False)}
