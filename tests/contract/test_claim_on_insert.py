"""A handed pass that claims its submit by the submit's insert writes what the two writes would.

The warm call's first transaction is a submit and the pass of the poll it was handed
(server/polls.py). On SQLite, when that pass would claim the new row alone, the row is inserted as
that claim leaves it (``InvocationStore._claim_on_insert_in``): one statement where there were
two. Each case below writes the same batches on two stores, one that may take that way and one
that may not (``claim_on_insert = False``: the insert, then the pass's claim statement), at the
same times, and finds the same answers and the same rows; and it says which way the first took
(the general one wherever something else is due in the pass's heads, a limit or a GPU places the
claim, the row is not the pass's to take, or the insert meets a conflict). PostgreSQL always
writes the general way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import sqlite

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.store import open_store, schema
from dreamlake.lakeshore.store.api import AckRequest, PollRequest, SubmitRequest, WriteRequest
from dreamlake.lakeshore.store.placement import Offer
from dreamlake.lakeshore.store.sql import SqlStore

FN = {"module": "m", "qualname": "f", "version": "v1"}
T0 = 1_700_000_000.0


class _Pair:
    """Two stores written alike: ``fast`` may claim on insert, ``general`` may not."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, memory: bool) -> None:
        self.fast = open_store(":memory:" if memory else str(tmp / "fast.db"))
        self.general = open_store(":memory:" if memory else str(tmp / "general.db"))
        self.general.claim_on_insert = False
        self.now = T0
        monkeypatch.setattr(time, "time", lambda: self.now)
        self.inserted = _spy(self.fast, monkeypatch)  # the fast store's claims on insert

    def write(self, batch: list[WriteRequest]) -> list[Any]:
        self.now += 1.0
        got = self.fast.write_batch(batch)
        assert _answers(self.general.write_batch(batch)) == _answers(got)
        return got

    def handed(self, sub: SubmitRequest, poll: PollRequest) -> tuple[bool, list[Any]]:
        """Write ``[sub, poll]`` (``poll`` handed ``sub``) on both: whether the fast store claimed
        on insert, and its answers (the same as the general store's)."""
        before = len(self.inserted)
        got = self.write([sub, poll])
        assert self.rows(self.fast) == self.rows(self.general)
        assert not self.inserted[before:] or self.inserted[before:] == [sub.invocation_id]
        return len(self.inserted) > before, got

    @staticmethod
    def rows(store: SqlStore) -> list[tuple[Any, ...]]:
        inv = schema.invocations
        with store.db.tx(write=False) as conn:
            return [tuple(r) for r in conn.execute(sa.select(inv).order_by(inv.c.invocation_id))]

    def close(self) -> None:
        self.fast.close()
        self.general.close()


def _spy(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids ``store`` claims on insert from now on."""
    inserted: list[str] = []
    claim_on_insert_in: Callable[..., Any] = store._claim_on_insert_in

    def spied(*args: Any, **kwargs: Any) -> Any:
        got = claim_on_insert_in(*args, **kwargs)
        if got is not None:
            inserted.append(got[0].invocation_id)
        return got

    monkeypatch.setattr(store, "_claim_on_insert_in", spied)
    return inserted


def _answers(got: list[Any]) -> list[Any]:
    return [(type(r).__name__, str(r), r.status) if isinstance(r, PlaneError) else r for r in got]


@pytest.fixture(params=["sqlite-file", "sqlite-memory"])
def pair(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Pair]:
    p = _Pair(tmp_path, monkeypatch, request.param == "sqlite-memory")
    yield p
    p.close()


def sub(inv: str, queue: str = "q", **run_config: Any) -> SubmitRequest:
    namespace = run_config.pop("namespace", "default")
    return SubmitRequest(inv, queue, FN, b"args", {"queue": queue, **run_config}, namespace=namespace)


def poll(inv: str, queues: tuple[str, ...] = ("q",), limit: int = 8, **kw: Any) -> PollRequest:
    kw.setdefault("exec_jobs", False)
    kw.setdefault("duties", False)
    return PollRequest("w1", list(queues), limit, handed=(inv,), **kw)


def _claimed(got: list[Any]) -> list[str]:
    return [i.invocation_id for i in got[1].invocations]


def _warm(p: _Pair, queue: str = "q", namespace: str = "default") -> None:
    """A first submit names the queue and function (then a submit writes its row alone), and
    is claimed and finished."""
    inv = f"warm-{queue}-{namespace}"
    p.write([sub(inv, queue, namespace=namespace)])
    (passed,) = p.write([PollRequest("w0", [queue], 1, exec_jobs=False)])
    assert [i.invocation_id for i in passed.invocations] == [inv]
    p.write([AckRequest(inv, "succeeded", 1, "w0", b"r")])


def test_an_empty_queue_claims_the_submit_by_its_insert(pair: _Pair) -> None:
    _warm(pair)
    fast, got = pair.handed(sub("a1", priority=3, key="k1"), poll("a1"))
    assert fast and _claimed(got) == ["a1"]
    (inv,) = got[1].invocations
    assert (inv.state, inv.attempt, inv.worker_id) == ("running", 1, "w1")
    assert (inv.started_at, inv.lease_expires_at, inv.submitted_at) == (pair.now, pair.now + 30.0, pair.now)
    # and what follows reads it as any claimed row: its ack, a repeat of its submit
    pair.write([AckRequest("a1", "succeeded", 1, "w1", b"out")])
    fast, got = pair.handed(sub("a1", priority=3, key="k1"), poll("a1"))
    assert not fast and got[0].duplicate and _claimed(got) == []


@pytest.mark.parametrize(
    "ahead",
    [
        pytest.param({"priority": 0}, id="older-lower-priority"),
        pytest.param({"priority": 9}, id="older-higher-priority"),
    ],
)
@pytest.mark.parametrize("limit", [1, 8])
def test_a_due_call_in_the_pass_s_heads_takes_the_general_way(
    pair: _Pair, ahead: dict[str, Any], limit: int
) -> None:
    _warm(pair)
    pair.write([sub("b0", **ahead)])
    fast, got = pair.handed(sub("b1", priority=5), poll("b1", limit=limit))
    assert not fast
    expected = {(0, 1): ["b1"], (0, 8): ["b1", "b0"], (9, 1): ["b0"], (9, 8): ["b0", "b1"]}
    assert _claimed(got) == expected[ahead["priority"], limit]


def test_what_is_not_due_or_not_the_pass_s_leaves_it_to_the_insert(pair: _Pair) -> None:
    _warm(pair)
    _warm(pair, "other")
    _warm(pair, "q", "team")
    pair.write([sub("c0", not_before=T0 + 3600)])  # a call waiting for its time
    pair.write([sub("c1", "other")])  # another queue's
    pair.write([sub("c2", namespace="team")])  # another namespace's, for a pass bound to default
    pair.write([sub("c3")])
    (taken,) = pair.write([PollRequest("w0", ["q"], 1, exec_jobs=False, namespace="default")])
    assert _claimed([None, taken]) == ["c3"]  # running: no longer due
    fast, got = pair.handed(sub("c4"), poll("c4", namespace="default"))
    assert fast and _claimed(got) == ["c4"]
    # the same unbound: c2 is due in its heads
    fast, got = pair.handed(sub("c5"), poll("c5"))
    assert not fast and _claimed(got) == ["c2", "c5"]


@pytest.mark.parametrize(
    "submit, handed",
    [
        pytest.param(sub("d1", "other"), poll("d1"), id="a queue the pass does not read"),
        pytest.param(sub("d1", namespace="team"), poll("d1", namespace="default"), id="another namespace"),
        pytest.param(sub("d1", not_before=T0 + 3600), poll("d1"), id="not due yet"),
        pytest.param(sub("d1"), poll("d1", ("q",), 0), id="a pass of no claim"),
        pytest.param(sub("d1"), poll("d0"), id="handed another submit"),
        pytest.param(sub("d1", "fresh"), poll("d1", ("fresh",)), id="a queue new to the store"),
    ],
)
def test_a_row_the_pass_would_not_take_alone_takes_the_general_way(
    pair: _Pair, submit: SubmitRequest, handed: PollRequest
) -> None:
    _warm(pair)
    _warm(pair, "other")
    _warm(pair, "q", "team")
    fast, _ = pair.handed(submit, handed)
    assert not fast


def test_a_quota_or_a_parent_writes_the_general_way(pair: _Pair) -> None:
    _warm(pair)
    quota = sub("e1")
    quota.max_queued = 5
    fast, got = pair.handed(quota, poll("e1"))
    assert not fast and _claimed(got) == ["e1"]
    child = sub("e2")
    child.parent_invocation_id = "e1"
    fast, got = pair.handed(child, poll("e2"))
    assert not fast and _claimed(got) == ["e2"] and got[1].invocations[0].root_invocation_id == "e1"


def test_a_repeat_or_a_key_s_twin_meets_its_conflict_the_general_way(pair: _Pair) -> None:
    _warm(pair)
    pair.write([sub("f0", key="same")])  # queued
    fast, got = pair.handed(sub("f1", key="same"), poll("f1", limit=1))
    assert not fast and got[0].duplicate and got[0].invocation_id == "f0" and _claimed(got) == ["f0"]
    fast, got = pair.handed(sub("f0", key="same"), poll("f0"))  # f0 again: running now
    assert not fast and got[0].duplicate and _claimed(got) == []
    other = sub("f0", key="same")
    other.args_blob = b"other"
    fast, got = pair.handed(other, poll("f0"))
    assert not fast and got[0].status == 409 and _claimed(got) == []


def test_shapes_limits_and_gpus(pair: _Pair) -> None:
    _warm(pair)
    pool = {"selector": {"pool": "a"}}
    pair.write([sub("g0", **pool)])  # names the shape; queued
    offer = Offer.of(labels={"pool": "a"})
    fast, got = pair.handed(sub("g1"), poll("g1", offer=offer))  # g0 is due in a head of the pass
    assert not fast and _claimed(got) == ["g0", "g1"]
    fast, got = pair.handed(sub("g2", **pool), poll("g2", offer=offer))  # a shaped call, its head empty
    assert fast and _claimed(got) == ["g2"]
    fast, got = pair.handed(sub("g3", **pool), poll("g3"))  # a pass its shape does not fit
    assert not fast and _claimed(got) == []
    gpu = {"resources": {"gpus": 1}}
    pair.write([sub("g4", **gpu)])
    both = Offer.of(gpus=1, labels={"pool": "a"})
    (passed,) = pair.write([PollRequest("w0", ["q"], 8, exec_jobs=False, offer=both)])
    assert _claimed([None, passed]) == ["g3", "g4"]
    fast, got = pair.handed(sub("g5"), poll("g5", offer=Offer.of(gpus=1)))  # a placed plan
    assert not fast and _claimed(got) == ["g5"]
    for store in (pair.fast, pair.general):
        store.set_queue_limit("q", 10)
    fast, got = pair.handed(sub("g6"), poll("g6"))  # a limit applies
    assert not fast and _claimed(got) == ["g6"]
    for store in (pair.fast, pair.general):
        store.set_queue_limit("q", None)
    fast, got = pair.handed(sub("g7"), poll("g7", exec_jobs=True, duties=True))
    assert fast and _claimed(got) == ["g7"]


def test_postgresql_claims_the_general_way(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend answers alike; PostgreSQL never claims on insert (its READ COMMITTED pass
    reads rows other transactions commit meanwhile: the claim's locks decide there)."""
    inserted = _spy(store, monkeypatch)
    for inv in ("h0", "h1", "h2"):
        out = store.write_batch([sub(inv), poll(inv)])
        assert [i.invocation_id for i in out[1].invocations] == [inv]  # type: ignore[union-attr]
    # (the first names the queue and the function: not a lone insert)
    assert inserted == ([] if store.kind == "postgresql" else ["h1", "h2"])


def test_the_insert_probes_each_head_off_its_index(pair: _Pair) -> None:
    """The claimed insert's probes read the indexes of due queued rows, as the claim does."""
    from dreamlake.lakeshore.store.claims import claimed_insert_statement

    for heads, by_ns, index in [(1, False, "ix_invocations_queued"), (2, True, "ix_invocations_queued_ns")]:
        sql = claimed_insert_statement(heads, by_ns).stmt.compile(dialect=sqlite.dialect())
        with pair.fast.db.tx(write=False) as conn:
            raw: Any = conn.connection.driver_connection
            n = str(sql).count("?")
            plan = [r[3] for r in raw.execute("EXPLAIN QUERY PLAN " + str(sql), [None] * n)]
        searches = [p for p in plan if p.startswith("SEARCH invocations")]
        assert len(searches) == heads and all(index in p for p in searches), plan
        assert not any(p.startswith("SCAN invocations") for p in plan), plan


def test_a_remembered_plan_follows_every_change_of_the_placer_s_cache(tmp_path: Path) -> None:
    """``Placer.plan`` makes a plan that reads nothing once per queues and offer; a shape learnt
    (and undone with its rolled-back transaction), a limit set or cleared, and a refresh that
    reads another replica's shape each make the next plan afresh."""
    from dreamlake.lakeshore.store.placement import PLAIN, Needs

    s = open_store(tmp_path / "plans.db")
    other = open_store(tmp_path / "plans.db")
    placer, offer = s._placer, Offer.of(labels={"pool": "a"})
    pool = Needs(selector=(("pool", "a"),))

    def heads() -> list[tuple[str, str]]:
        with s.db.tx(write=False) as conn:
            first = placer.plan(conn, ["q"], offer, None, s.kind)
            assert placer.plan(conn, ["q"], offer, None, s.kind) is first  # remembered
            return first.heads

    try:
        assert heads() == [("q", PLAIN)]
        with pytest.raises(RuntimeError), placer.tentative():
            placer.learn("q", "s1", pool)
            assert heads() == [("q", PLAIN), ("q", "s1")]
            raise RuntimeError("its transaction rolled back")
        assert heads() == [("q", PLAIN)]
        s.set_queue_limit("q", 3)
        with s.db.tx(write=False) as conn:
            assert placer.plan(conn, ["q"], offer, None, s.kind).placed  # reads the limit's room
        s.set_queue_limit("q", None)
        assert heads() == [("q", PLAIN)]
        other.write_batch([sub("r1", selector={"pool": "a"})])  # another replica names a shape
        with s.db.tx(write=False) as conn:
            placer.refresh(conn, force=True)
        assert len(heads()) == 2
    finally:
        other.close()
        s.close()
