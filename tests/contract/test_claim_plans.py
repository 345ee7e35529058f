"""The claim's query plans: the claim order comes off an index, and the update finds rows by key.

A claim must cost the same at any backlog (bench/backlog.py measures it). These tests pin the
plans that make it so, on a table with enough queued rows (and, on PostgreSQL, statistics) that a
planner would sort them if the index did not serve the order:

- SQLite ``EXPLAIN QUERY PLAN``: the pick searches ``ix_invocations_queued``, the update searches
  the primary key, nothing scans ``invocations`` and nothing sorts the table's rows (a several-queue
  claim sorts only the first rows of each queue: a temp B-tree over a LIMITed co-routine).
- PostgreSQL ``EXPLAIN``, of the plan for the claim's values and of the generic plan a prepared
  statement may switch to: index scans only, on ``ix_invocations_queued`` and the primary key; no
  Sort (or Incremental Sort) node for one queue; for several, a Sort only above each queue's Limit.

A placed claim (issue 29: a poller offering GPUs or labels) picks the first rows of each (queue,
shape) head it fits, each one index range of ``ix_invocations_queued`` (queue, shape, the order),
merged and sorted only above each head's Limit; it then updates its choice by key.

A claim of a daemon bound to a namespace reads ``ix_invocations_queued_ns`` (namespace, queue, the
same order) the same way. Retries waiting for their backoff (``not_before`` set) are in the table
and outside both indexes: the plans are the same with them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.store import schema
from dreamlake.lakeshore.store.claims import claim_params, head_params, pick_statement
from dreamlake.lakeshore.store.placement import Needs, Offer
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import filled, generic_plan

QUEUED_ROWS = 20_000
DONE_ROWS = 5_000
QUEUES = [f"q{i}" for i in range(4)]
CASES = [(["q1"], 1), (["q1"], 10), (["q0", "q2", "q3"], 1), (["q0", "q2", "q3"], 10)]
NAMESPACES = ["default", "ns1"]
INDEX = {None: "ix_invocations_queued", "ns1": "ix_invocations_queued_ns"}


def _rows() -> Iterator[dict[str, Any]]:
    rnd = random.Random(7)
    for i in range(QUEUED_ROWS + DONE_ROWS):
        yield {
            "invocation_id": f"inv-{i:08d}",
            "queue": rnd.choice(QUEUES),
            "state": "queued" if i < QUEUED_ROWS else "succeeded",
            "priority": rnd.randrange(10),
            "function_key": "f",
            "function": {},
            "args_blob": b"",
            "run_config": {},
            "code_context": {},
            "namespace": rnd.choice(NAMESPACES),
            "content_hash": "h",
            "attempt": 0,
            "max_attempts": 3,
            "submitted_at": 1_700_000_000.0 + rnd.random() * 1e6,
            "cancel_requested": False,
            # issue 12: a fifth of the queued rows are retries waiting for their backoff; the
            # claim index leaves them out, so the plans below must not change
            "not_before": 2e9 if i < QUEUED_ROWS and i % 5 == 0 else None,
        }


@pytest.fixture
def backlog(store: SqlStore) -> SqlStore:
    return filled(store, _rows())


def _explain(
    conn: Connection,
    prefix: str,
    queues: list[str],
    limit: int,
    namespace: str | None = None,
    statement: tuple[Any, dict[str, Any]] | None = None,
) -> list[Any]:
    """The rows of ``prefix`` + the claim statement of ``queues`` (or ``statement``: a statement
    and its parameters), run with the claim's parameters."""
    stmt, params = statement or claim_params(queues, limit, "w", 1.0, 30.0, namespace)
    state = stmt.compile(dialect=conn.dialect).construct_expanded_state(params)
    args = state.positional_parameters if conn.dialect.positional else state.parameters
    return list(conn.exec_driver_sql(f"{prefix} {state.statement}", args))


def _pg_generic_plan(
    conn: Connection,
    queues: list[str],
    limit: int,
    namespace: str | None,
    statement: tuple[Any, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The plan PostgreSQL caches for the claim (or ``statement``) once prepared (psycopg prepares
    a statement run five times): planned without the parameters' values."""
    stmt, params = statement or claim_params(queues, limit, "w", 1.0, 30.0, namespace)
    state = stmt.compile(dialect=conn.dialect).construct_expanded_state(params)
    return generic_plan(conn, state.statement, state.parameters, "claim_plan")  # type: ignore[no-any-return]


def _sqlite_plan(
    conn: Connection, queues: list[str], limit: int, namespace: str | None
) -> list[tuple[int, int, str]]:
    return [(r[0], r[1], r[3]) for r in _explain(conn, "EXPLAIN QUERY PLAN", queues, limit, namespace)]


def _check_sqlite(plan: list[tuple[int, int, str]], queues: list[str], namespace: str | None) -> None:
    text = "\n".join(detail for _, _, detail in plan)
    on_table = [d for _, _, d in plan if d.startswith(("SCAN invocations", "SEARCH invocations"))]
    assert not [d for d in on_table if d.startswith("SCAN")], text
    search = "(namespace=? AND queue=? AND shape=?)" if namespace else "(queue=? AND shape=?)"
    picks = [d for d in on_table if f"USING INDEX {INDEX[namespace]} {search}" in d]
    assert len(picks) == len(queues), text
    by_key = [d for d in on_table if "(invocation_id=?)" in d]
    assert len(by_key) == 1 and len(on_table) == len(queues) + 1, text
    sorts = [(node, parent) for node, parent, d in plan if d.startswith("USE TEMP B-TREE")]
    if len(queues) == 1:
        assert sorts == [], text
    for _, parent in sorts:  # a merge of several queues sorts each queue's first `limit` rows only
        siblings = [d for _, p, d in plan if p == parent]
        subqueries = {d.split()[1] for d in siblings if d.startswith("CO-ROUTINE ")}
        scans = [d for d in siblings if d.startswith(("SCAN", "SEARCH"))]
        assert subqueries and scans == [f"SCAN {q}" for q in subqueries], text


def _nodes(
    node: dict[str, Any], above: tuple[str, ...] = ()
) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """Every plan node with the node types on its path from the root."""
    yield node, above
    for child in node.get("Plans", ()):
        yield from _nodes(child, (*above, node["Node Type"]))


def _check_pg(plan: dict[str, Any], queues: list[str], namespace: str | None) -> None:
    text = json.dumps(plan, indent=1)
    nodes = list(_nodes(plan))
    scans = [
        (n, path)
        for n, path in nodes
        if n.get("Relation Name") == "invocations" and n["Node Type"] != "ModifyTable"
    ]
    assert {n["Node Type"] for n, _ in scans} <= {"Index Scan", "Index Only Scan"}, text
    picks = [n for n, _ in scans if n["Index Name"] == INDEX[namespace]]
    assert len(picks) == len(queues), text
    assert [n["Index Name"] for n, _ in scans if n not in picks] == ["invocations_pkey"], text
    sorts = [n for n, _ in nodes if n["Node Type"].endswith("Sort")]  # Sort, Incremental Sort
    if len(queues) == 1:
        assert sorts == [], text
    for _, path in scans:  # a merge of several queues sorts each queue's first `limit` rows only
        for at, kind in enumerate(path):
            if kind.endswith("Sort"):
                assert "Limit" in path[at + 1 :], text


@pytest.mark.parametrize("namespace", [None, "ns1"], ids=["any-namespace", "one-namespace"])
@pytest.mark.parametrize(("queues", "limit"), CASES, ids=[f"{len(q)}q-limit{n}" for q, n in CASES])
def test_the_claim_reads_its_order_off_the_index_and_updates_by_key(
    backlog: SqlStore, queues: list[str], limit: int, namespace: str | None
) -> None:
    with backlog.db.tx(write=True) as conn:
        if backlog.kind == "postgresql":
            ((plan,),) = _explain(conn, "EXPLAIN (FORMAT JSON)", queues, limit, namespace)
            _check_pg(plan[0]["Plan"], queues, namespace)
            _check_pg(_pg_generic_plan(conn, queues, limit, namespace), queues, namespace)
        else:  # as the store runs (no ANALYZE), then with statistics
            _check_sqlite(_sqlite_plan(conn, queues, limit, namespace), queues, namespace)
            conn.exec_driver_sql("ANALYZE")
            _check_sqlite(_sqlite_plan(conn, queues, limit, namespace), queues, namespace)
    got = backlog.claim("w", queues, limit=limit, namespace=namespace)  # it does what the plan says
    assert len(got) == limit and {i.queue for i in got} <= set(queues)
    assert namespace is None or {i.namespace for i in got} == {namespace}


# -- placement (issue 29): a claim of several shapes reads each (queue, shape) head off the index --

SHAPE_NEEDS = [Needs(gpus=g) for g in (1, 2, 4, 8)] + [Needs(selector=(("pool", p),)) for p in "abcde"]
SHAPES = [n.key() for n in SHAPE_NEEDS]


@pytest.fixture
def shaped_backlog(store: SqlStore) -> SqlStore:
    """The backlog with queue q1's rows spread over the plain shape and nine others (GPUs, selectors)."""
    rnd = random.Random(11)
    rows = [{**r, "shape": rnd.choice(["", *SHAPES]) if r["queue"] == "q1" else ""} for r in _rows()]
    with store.db.tx(write=True) as conn:
        conn.execute(sa.insert(schema.invocations), rows)
        conn.execute(
            sa.insert(schema.shapes),
            [
                {"queue": "q1", "shape": k, "needs": n.as_json(), "created_at": 1.0}
                for k, n in zip(SHAPES, SHAPE_NEEDS, strict=True)
            ],
        )
    if store.kind == "postgresql":
        with store.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE invocations")
    return store


def _check_sqlite_pick(plan: list[tuple[int, int, str]], heads: int) -> None:
    text = "\n".join(detail for _, _, detail in plan)
    on_table = [d for _, _, d in plan if d.startswith(("SCAN invocations", "SEARCH invocations"))]
    assert not [d for d in on_table if d.startswith("SCAN")], text
    picks = [d for d in on_table if "USING INDEX ix_invocations_queued (queue=? AND shape=?)" in d]
    assert len(picks) == len(on_table) == heads, text
    for _, parent in [(n, p) for n, p, d in plan if d.startswith("USE TEMP B-TREE")]:
        siblings = [d for _, p, d in plan if p == parent]
        subqueries = {d.split()[1] for d in siblings if d.startswith("CO-ROUTINE ")}
        assert [d for d in siblings if d.startswith(("SCAN", "SEARCH"))] == [
            f"SCAN {q}" for q in subqueries
        ], text


def _check_pg_pick(plan: dict[str, Any], heads: int) -> None:
    text = json.dumps(plan, indent=1)
    nodes = list(_nodes(plan))
    scans = [(n, path) for n, path in nodes if n.get("Relation Name") == "invocations"]
    assert {n["Node Type"] for n, _ in scans} <= {"Index Scan", "Index Only Scan"}, text
    assert [n["Index Name"] for n, _ in scans] == ["ix_invocations_queued"] * heads, text
    for _, path in scans:  # the merge sorts each head's first `limit` rows only
        for at, kind in enumerate(path):
            if kind.endswith("Sort"):
                assert "Limit" in path[at + 1 :], text


@pytest.mark.parametrize("limit", [1, 4])
def test_a_placed_claim_picks_each_shapes_head_off_the_index(shaped_backlog: SqlStore, limit: int) -> None:
    """A poller offering 4 GPUs and pool=c reads the plain head and the heads of the shapes it fits
    (gpus 1, 2, 4; pool=c): each one index range of ix_invocations_queued, no scan, no sort of the
    backlog; then takes its choice by key."""
    store = shaped_backlog
    offer = Offer.of(4, {"pool": "c"})
    with store.db.tx(write=True) as conn:
        plan = store._placer.plan(conn, ["q1"], offer, None, store.kind)
        assert plan.placed and len(plan.heads) == 5, plan.heads
        statement = (pick_statement(len(plan.heads)), {"limit": limit, **head_params(plan.heads, None)})
        if store.kind == "postgresql":
            ((explained,),) = _explain(conn, "EXPLAIN (FORMAT JSON)", [], limit, statement=statement)
            _check_pg_pick(explained[0]["Plan"], len(plan.heads))
            _check_pg_pick(_pg_generic_plan(conn, [], limit, None, statement), len(plan.heads))
        else:
            rows = _explain(conn, "EXPLAIN QUERY PLAN", [], limit, statement=statement)
            _check_sqlite_pick([(r[0], r[1], r[3]) for r in rows], len(plan.heads))
    got = store.claim("w", ["q1"], limit=limit, offer=offer)  # it does what the plan says
    assert (
        1 <= len(got) <= limit and sum((store.shape_needs("q1", i.shape) or Needs()).gpus for i in got) <= 4
    )
