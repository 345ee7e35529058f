"""Placement in the store (issue 29), on SQLite and PostgreSQL: a claim takes only what the
poller's offer fits (free GPUs, labels), greedily within its free GPUs, in claim order among what
fits; fleet-wide limits (a queue's ``max_running``, a concurrency key's ``max_concurrency``) hold
in the claim; a call with ``not_before`` ahead is not claimed before it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.api import AckRequest, SubmitRequest
from dreamlake.lakeshore.store.claims import MERGED_QUEUES_MAX, Plan, queue_limit
from dreamlake.lakeshore.store.notify import run_queue_channel
from dreamlake.lakeshore.store.placement import Offer
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import FN, ack, refuse_bad_args, submit

TIMEOUT_ERR = {"type": "TimeoutError", "message": "the backend did not answer"}


def test_a_claim_takes_only_what_the_offer_fits_greedily_in_claim_order(store: SqlStore) -> None:
    big = [submit(store, "gpu", resources={"gpus": 2}, priority=5) for _ in range(3)]
    one = submit(store, "gpu", resources={"gpus": 1}, priority=1)
    plain = submit(store, "gpu")
    # no GPUs offered (an old daemon): only the plain call
    assert [i.invocation_id for i in store.claim("w0", ["gpu"], limit=10)] == [plain]
    # 3 free: one gpus=2 (the best), then the gpus=1 that still fits; never two gpus=2
    got = store.claim("w1", ["gpu"], limit=10, offer=Offer.of(3))
    assert [i.invocation_id for i in got] == [big[0], one]
    got = store.claim("w2", ["gpu"], limit=10, offer=Offer.of(4))
    assert [i.invocation_id for i in got] == big[1:]
    assert {store.get(i).state for i in big} == {"running"}  # type: ignore[union-attr]


def test_a_placed_claim_of_more_heads_than_merged_chooses_across_its_groups(store: SqlStore) -> None:
    """Past ``MERGED_QUEUES_MAX`` (queue, shape) heads the pick runs in groups of heads; the
    greedy choice within the free GPUs is made over all of them in claim order, as below it."""
    queues = [f"g{n:02d}" for n in range(MERGED_QUEUES_MAX + 8)]
    for q in queues:  # two heads a queue: plain and gpus=2
        submit(store, q)
        submit(store, q, resources={"gpus": 2})
    best = submit(store, queues[-1], resources={"gpus": 2}, priority=9)  # the last group's head
    one = submit(store, queues[1], resources={"gpus": 1}, priority=8)  # a third shape, first group
    got = store.claim("w", queues, limit=3, offer=Offer.of(3))  # 2 + 1 GPUs, then a plain call
    assert [i.invocation_id for i in got][:2] == [best, one]
    assert got[2].run_config.get("resources") is None and got[2].queue == queues[0]


def test_a_selector_matches_only_equal_labels_and_an_unknown_key_never(store: SqlStore) -> None:
    a = submit(store, "q", selector={"pool": "a"})
    rack = submit(store, "q", selector={"rack": "7"})
    assert store.claim("w", ["q"], limit=5, offer=Offer.of(0, {"pool": "b"})) == []
    got = store.claim("w", ["q"], limit=5, offer=Offer.of(0, {"pool": "a", "os": "linux"}))
    assert [i.invocation_id for i in got] == [a]
    assert store.get(rack).state == "queued"  # type: ignore[union-attr]


def test_memory_and_cpus_are_matched_against_what_one_task_may_have_there(store: SqlStore) -> None:
    big = submit(store, "mem", resources={"memory": "16g"})
    cpus = submit(store, "mem", resources={"cpus": 4})
    # a runner whose tasks may have 8 GiB and no CPU limit (the process runner): neither call
    assert store.claim("w1", ["mem"], limit=5, offer=Offer.of(0, memory=8 * 2**30, cpus=0)) == []
    got = store.claim("w2", ["mem"], limit=5, offer=Offer.of(0, memory=64 * 2**30, cpus=2))
    assert [i.invocation_id for i in got] == [big]  # 64 GiB fits, 2 CPUs do not
    # a runner that says nothing of memory or CPUs (kube, slurm) is not matched on them
    assert [i.invocation_id for i in store.claim("w3", ["mem"], limit=5, offer=Offer.of(0))] == [cpus]


def test_fleet_wide_limits_hold_in_the_claim(store: SqlStore) -> None:
    for _ in range(4):
        submit(store, "lim")
    with store.db.tx(write=True) as conn:
        store.set_limit_in(conn, queue_limit("lim"), 2, time.time())
    assert len(store.claim("w1", ["lim"], limit=4)) == 2
    assert store.claim("w2", ["lim"], limit=4) == []
    keyed = [submit(store, "k", concurrency_key="db", max_concurrency=1) for _ in range(3)]
    assert [i.invocation_id for i in store.claim("w3", ["k"], limit=3)] == keyed[:1]
    assert store.claim("w4", ["k"], limit=3) == []
    assert store.key_limit_use() == [("default/db", 1, 1)]  # what lakeshore queues lists beside the queues
    with store.db.tx(write=True) as conn:
        store.set_limit_in(conn, queue_limit("lim"), None, time.time())
    assert len(store.claim("w5", ["lim"], limit=4)) == 2


def test_a_claim_under_a_queue_limit_reads_and_locks_only_the_rows_it_may_take(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue limit makes every claim of the queue a placed one with one head (its plain shape).
    Its pick reads the head's first ``limit`` rows, and on PostgreSQL locks only those, never the
    whole queued backlog (it did: every claim read, and locked FOR UPDATE, every queued row)."""
    for _ in range(30):
        submit(store, "lim")
    store.set_queue_limit("lim", 100)
    seen: list[tuple[int, int | None]] = []  # (rows the pick returned, queued rows it left unlocked)
    choose = Plan.choose

    def counting(plan: Plan, rows: list[Any], limit: int, offer: Offer) -> list[str]:
        unlocked = None
        if store.kind == "postgresql":  # seen from another transaction while the claim holds its locks
            with store.db.engine.connect() as other:
                unlocked = other.execute(
                    sa.text(
                        "SELECT count(*) FROM (SELECT 1 FROM invocations WHERE queue = 'lim' AND "
                        "state = 'queued' FOR UPDATE SKIP LOCKED) AS free"
                    )
                ).scalar_one()
        seen.append((len(rows), unlocked))
        return choose(plan, rows, limit, offer)

    monkeypatch.setattr(Plan, "choose", counting)
    assert len(store.claim("w", ["lim"], limit=2)) == 2
    assert seen == [(2, 28 if store.kind == "postgresql" else None)]


def test_not_before_keeps_a_call_queued_until_its_time(store: SqlStore) -> None:
    inv = submit(store, "q", not_before=time.time() + 60)
    assert store.claim("w", ["q"], limit=1) == []
    store.expire_leases(time.time() + 61)  # the expiry pass releases what is due
    assert [i.invocation_id for i in store.claim("w", ["q"], limit=1)] == [inv]


def _heard(store: SqlStore) -> list[str]:
    channels: list[str] = []
    store.notifier.add_listener(lambda channel, seq, relayed: channels.append(channel))
    return channels


def test_a_requeued_gpu_call_wakes_the_channel_of_its_shape(store: SqlStore) -> None:
    """A retry, a retry of the group commit, a preemption and a lapsed lease notify ``run-queue:<ns>:<q>:<shape>``
    (the poll hub then wakes a poll whose offer fits it), not the plain channel no GPU poll hears."""
    rc = {"resources": {"gpus": 2}, "max_attempts": 5, "retry_on": ["TimeoutError"], "backoff_s": 0}
    inv = submit(store, "gpu", **rc)
    shape = store.get(inv).shape  # type: ignore[union-attr]
    assert shape
    shaped = run_queue_channel("default", "gpu", shape)
    heard = _heard(store)
    assert len(store.claim("w", ["gpu"], offer=Offer.of(2))) == 1
    assert ack(store, inv, "failed", attempt=1, worker_id="w", error=TIMEOUT_ERR).state == "queued"
    assert shaped in heard and run_queue_channel("default", "gpu") not in heard
    heard.clear()
    store.claim("w", ["gpu"], offer=Offer.of(2))
    store.write_batch([AckRequest(inv, "failed", 2, "w", None, TIMEOUT_ERR)])
    assert shaped in heard
    heard.clear()
    (claimed,) = store.claim("w", ["gpu"], offer=Offer.of(2))
    assert ack(store, inv, "preempted", attempt=claimed.attempt, worker_id="w").state == "queued"
    assert shaped in heard and run_queue_channel("default", "gpu") not in heard
    heard.clear()
    store.claim("w", ["gpu"], offer=Offer.of(2))
    assert store.expire_leases(now=time.time() + 10**6) == [inv]
    assert shaped in heard and run_queue_channel("default", "gpu") not in heard


def test_a_call_ending_under_a_limit_wakes_a_poll_for_the_room_it_freed(store: SqlStore) -> None:
    first, held = submit(store, "lim"), submit(store, "lim")
    store.set_queue_limit("lim", 1)
    assert [i.invocation_id for i in store.claim("w", ["lim"], limit=2)] == [first]
    heard = _heard(store)
    ack(store, first, "succeeded", attempt=1, worker_id="w")
    assert run_queue_channel("default", "lim") in heard  # the held-back call is claimable now
    assert [i.invocation_id for i in store.claim("w2", ["lim"], limit=2)] == [held]
    free = submit(store, "free")
    store.claim("w", ["free"])
    heard.clear()
    ack(store, free, "succeeded", attempt=1, worker_id="w")
    assert run_queue_channel("default", "free") not in heard  # no limit there: no wake-up spent
    assert store.limits() == {"queues": {"lim": 1}, "keys": {}}
    store.set_queue_limit("lim", None)
    assert store.limits()["queues"] == {}


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"selector": ["pool"]}, "run_config.selector must be a map"),
        ({"resources": {"gpus": 1.5}}, "run_config.resources.gpus must be a whole number"),
        ({"max_concurrency": 2}, "run_config.max_concurrency needs a concurrency_key"),
        ({"not_before": "soon"}, "run_config.not_before must be a time"),
    ],
)
def test_bad_placement_fields_are_refused_naming_the_field(
    store: SqlStore, run_config: dict[str, object], message: str
) -> None:
    with pytest.raises(PlaneError, match=message) as err:
        submit(store, "q", **run_config)
    assert err.value.status == 400


def test_a_shape_named_in_a_group_commit_that_rolled_back_is_written_by_its_retry(store: SqlStore) -> None:
    """A group commit that fails (here a row the database refuses) is rolled back and each submit
    retried alone. The shape a submit named in the failed transaction was in the claim's cache by
    then, but its ``shapes`` row was not: the retry must write it, or once the cache is read again
    (a second later, another replica, a restart) no poller's plan has that head and the call stays
    queued for ever. The same for a concurrency key's ``max_concurrency``: its limit, not written,
    would not hold."""
    refuse_bad_args(store)
    try:
        placed, bad = new_ulid(), new_ulid()
        done, refused = store.write_batch(
            [
                SubmitRequest(
                    placed,
                    "sel",
                    FN,
                    b"ok",
                    {"selector": {"pool": "a"}, "concurrency_key": "k", "max_concurrency": 1},
                ),
                SubmitRequest(bad, "sel", FN, b"bad", {}),
            ]
        )
        assert not isinstance(done, PlaneError) and isinstance(refused, PlaneError)
        with store.db.tx(write=False) as conn:
            store._placer.refresh(conn, force=True)  # what the cache holds once read again
            # the key's max_concurrency, named in the same transaction, is written by the retry too
            assert [tuple(r) for r in conn.exec_driver_sql("SELECT max_running FROM limits")] == [(1,)]
        got = store.claim("w", ["sel"], limit=5, offer=Offer.of(0, {"pool": "a"}))
        assert [i.invocation_id for i in got] == [placed]
    finally:
        refuse_bad_args(store, on=False)


@pytest.mark.parametrize("backend", ["sqlite-file", "postgresql"])
def test_a_keys_max_concurrency_holds_across_replicas_whose_caches_lag(backend: str, tmp_path: Path) -> None:
    """Two control planes over one store (replicas): A runs a call of key ``db`` (max_concurrency
    1) in one queue; B, whose cached shapes were read before A's shape existed, claims a call of
    the same key in another queue. B's claim must count A's running call. It counted only the
    shapes in its own cache, which lags another replica's by up to a second: two ran under 1."""
    from dreamlake.lakeshore.store import open_store
    from tests.contract.conftest import pg_database

    with pg_database() if backend == "postgresql" else contextlib.nullcontext(str(tmp_path / "s.db")) as url:
        a, b = open_store(url), open_store(url)
        try:
            b.claim("w-b0", ["nothing"], limit=1)  # its cache read now: no shape of the key yet
            submit(a, "qa", concurrency_key="db", max_concurrency=1, selector={"pool": "a"})
            assert len(a.claim("w-a", ["qa"], limit=5, offer=Offer.of(0, {"pool": "a"}))) == 1
            held = submit(b, "qb", concurrency_key="db", max_concurrency=1)
            assert b.claim("w-b", ["qb"], limit=5) == []  # the key's one place is taken
            assert a.key_limit_use() == [("default/db", 1, 1)]
            assert b.get(held).state == "queued"  # type: ignore[union-attr]
        finally:
            a.close()
            b.close()
