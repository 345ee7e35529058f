"""ix_invocations_root holds only the rows with a root (0020): the tree reads still search it.

A submit with no parent (most of them) no longer inserts a NULL entry into ``ix_invocations_root``.
The reads of a call's tree ask for ``root_invocation_id = x``, which implies the index's predicate
``root_invocation_id IS NOT NULL``, so they search it as they searched the full index:

- ``descendants``: one index range, the tree's rows;
- ``gc_batch``: the check that a candidate's tree has no live call, per candidate one index range
  (OR its root by the primary key).

These tests run the statements the store sends (caught as it runs them) under SQLite's ``EXPLAIN
QUERY PLAN`` (as the store runs, without ANALYZE, and with it) and PostgreSQL's ``EXPLAIN`` (the
plan for the values and the generic plan a prepared statement may switch to), on a table where
most rows have no root. The other two indexes every submit enters stay whole, and the upgrade from
0019 (and back) keeps the rows and the reads; see the migration's docstring for why.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.store import open_store, schema
from dreamlake.lakeshore.store.api import SubmitRequest
from dreamlake.lakeshore.store.engine import HEAD_REVISION, MIGRATIONS_DIR, normalize_url
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.conftest import pg_database
from tests.contract.store_kit import filled, generic_plan

ROWS = 20_000
TREE = 8  # rows per tree: a root and its descendants
NOW = 1_700_000_000.0
FN = {"module": "m", "qualname": "f", "version": "v1"}
ROOT_INDEX = "ix_invocations_root"


def _rows() -> Iterator[dict[str, Any]]:
    """One in five rows is in a tree (an eighth of those its root, the rest have one); the newest
    tenth are queued (live), the others finished."""
    rnd = random.Random(13)
    for i in range(ROWS):
        in_tree = i % 5 == 0
        tree_root = f"inv-{(i // (5 * TREE)) * 5 * TREE:08d}"  # every TREE-th tree row is a root
        root = tree_root if in_tree and f"inv-{i:08d}" != tree_root else None
        live = i >= ROWS - ROWS // 10
        yield {
            "invocation_id": f"inv-{i:08d}",
            "queue": "q",
            "state": "queued" if live else "succeeded",
            "priority": 0,
            "function_key": "f",
            "function": {},
            "args_blob": b"",
            "run_config": {},
            "code_context": {},
            "namespace": "default",
            "content_hash": "h",
            "attempt": 0 if live else 1,
            "max_attempts": 3,
            "parent_invocation_id": root,
            "root_invocation_id": root,
            "idempotency_key": f"k{i}" if rnd.random() < 0.1 else None,
            "submitted_at": NOW + i,
            "finished_at": None if live else NOW + i + 1,
            "cancel_requested": False,
        }


@pytest.fixture
def trees(store: SqlStore) -> SqlStore:
    return filled(store, _rows())


def _sent(store: SqlStore, call: Any, marker: str) -> tuple[str, Any]:
    """The one statement containing ``marker`` that ``call()`` sends, with its parameters."""
    seen: list[tuple[str, Any]] = []

    def listen(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        if marker in statement:
            seen.append((statement, params))

    sa.event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        call()
    finally:
        sa.event.remove(store.db.engine, "before_cursor_execute", listen)
    assert len(seen) == 1, seen
    return seen[0]


def _sqlite_plans(conn: Connection, sent: tuple[str, Any]) -> Iterator[str]:
    """The statement's plan as the store runs it (no ANALYZE), then with the table's statistics."""
    statement, params = sent
    for analyze in (False, True):
        if analyze:
            conn.exec_driver_sql("ANALYZE")
        yield "\n".join(r[3] for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params))


def _pg_plans(conn: Connection, sent: tuple[str, Any]) -> list[dict[str, Any]]:
    """The plan for the statement's values, and its generic plan (planned without them)."""
    statement, params = sent
    ((custom,),) = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", params).fetchall()
    return [custom[0]["Plan"], generic_plan(conn, statement, params, "tree_plan")]


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


def test_descendants_read_the_tree_off_the_partial_root_index(trees: SqlStore) -> None:
    root, child = "inv-00000040", "inv-00000045"
    sent = _sent(trees, lambda: trees.descendants(child), "root_invocation_id =")
    with trees.db.tx(write=True) as conn:
        if trees.kind == "postgresql":
            for plan in _pg_plans(conn, sent):
                text = json.dumps(plan, indent=1)
                scans = [n for n in _nodes(plan) if n.get("Relation Name") == "invocations"]
                assert scans and {n["Node Type"] for n in scans} <= {"Index Scan", "Bitmap Heap Scan"}, text
                assert ROOT_INDEX in {n.get("Index Name") for n in _nodes(plan)}, text
        else:
            for shown in _sqlite_plans(conn, sent):
                assert f"SEARCH invocations USING INDEX {ROOT_INDEX} (root_invocation_id=?)" in shown, shown
                assert "SCAN invocations" not in shown, shown
    got = trees.descendants(root)  # it does what the plan says
    assert got == [(f"inv-{i:08d}", root, "succeeded") for i in range(45, 80, 5)], got


def test_the_retention_sweeps_live_tree_check_searches_the_partial_root_index(trees: SqlStore) -> None:
    """A candidate is kept while its tree has a live call: per candidate, the tree's rows by
    ``ix_invocations_root`` OR its root by the primary key, never a scan of ``live``."""
    sent = _sent(trees, lambda: trees.gc_batch(NOW + 10 * ROWS, 60.0, limit=50), "EXISTS")
    with trees.db.tx(write=True) as conn:
        if trees.kind == "postgresql":
            for plan in _pg_plans(conn, sent):
                text = json.dumps(plan, indent=1)
                nodes = list(_nodes(plan))
                assert ROOT_INDEX in {n.get("Index Name") for n in nodes}, text
                live_scans = [n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Alias") == "live"]
                assert not live_scans, text
        else:
            for shown in _sqlite_plans(conn, sent):
                assert f"SEARCH live USING INDEX {ROOT_INDEX} (root_invocation_id=?)" in shown, shown
                assert "SCAN live" not in shown, shown


def _index_defs(conn: Connection, kind: str) -> dict[str, str]:
    names = (ROOT_INDEX, "ix_invocations_lease", "ux_invocations_queue_key")
    if kind == "postgresql":
        rows = conn.execute(
            sa.text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'invocations'")
        ).all()
    else:
        rows = conn.exec_driver_sql(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'invocations'"
        ).all()
    return {name: definition for name, definition in rows if name in names}


def test_only_the_root_index_is_partial(store: SqlStore) -> None:
    """The root index skips the rows without a root; the lease and key indexes keep every row
    (listings by state, the reads of one namespace: see migration 0020)."""
    with store.db.tx(write=False) as conn:
        defs = _index_defs(conn, store.kind)
    assert re.search(r"WHERE \(?root_invocation_id IS NOT NULL\)?$", defs[ROOT_INDEX]), defs
    assert "WHERE" not in defs["ix_invocations_lease"] and "WHERE" not in defs["ux_invocations_queue_key"], (
        defs
    )


@pytest.fixture(params=["sqlite-file", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite-file":
        yield f"sqlite:///{tmp_path / 'old.db'}"
        return
    with pg_database() as url:
        yield url


def _alembic(url: str, target: str, down: bool = False) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    engine = sa.create_engine(normalize_url(url))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, target)
    finally:
        engine.dispose()


def test_migration_0020_makes_the_root_index_partial_and_downgrades_back(fresh_url: str) -> None:
    """A store at 0019 with a tree and rows without a root: the upgrade keeps them and the tree
    reads; a downgrade to 0019 restores the full index, and the upgrade runs again."""
    _alembic(fresh_url, "0019_handbacks")
    rows = list(_rows())[: 5 * TREE]
    engine = sa.create_engine(normalize_url(fresh_url))
    with engine.begin() as conn:
        conn.execute(sa.insert(schema.invocations), rows)
        assert "WHERE" not in _index_defs(conn, conn.dialect.name)[ROOT_INDEX]
    engine.dispose()
    s = open_store(fresh_url)  # upgrades to head
    try:
        with s.db.tx(write=False) as conn:
            assert MigrationContext.configure(conn).get_current_revision() == HEAD_REVISION
            assert "IS NOT NULL" in _index_defs(conn, s.kind)[ROOT_INDEX]
            assert conn.execute(
                sa.select(sa.func.count()).select_from(schema.invocations)
            ).scalar_one() == len(rows)
        assert len(s.descendants("inv-00000000")) == TREE - 1
        s.submit(SubmitRequest("fresh", "q", FN, b"x", {}, parent_invocation_id="inv-00000000"))
        assert "fresh" in [d[0] for d in s.descendants("inv-00000000")]
    finally:
        s.close()
    _alembic(fresh_url, "0019_handbacks", down=True)
    engine = sa.create_engine(normalize_url(fresh_url))
    with engine.begin() as conn:
        assert "WHERE" not in _index_defs(conn, conn.dialect.name)[ROOT_INDEX]
    engine.dispose()
    _alembic(fresh_url, "head")
    s = open_store(fresh_url)
    try:
        assert len(s.descendants("inv-00000000")) == TREE
    finally:
        s.close()


def test_a_second_keyed_submit_is_the_first_one_and_unkeyed_ones_never_clash(store: SqlStore) -> None:
    """ux_invocations_queue_key: a key is unique in its namespace and queue (ON CONFLICT DO
    NOTHING, then the lookup by key); a submit without a key clashes with none."""
    first = store.submit(SubmitRequest("a", "q", FN, b"x", {"key": "K"}))
    again = store.submit(SubmitRequest("b", "q", FN, b"x", {"key": "K"}))
    elsewhere = store.submit(SubmitRequest("c", "q", FN, b"x", {"key": "K"}, namespace="other"))
    plain = [store.submit(SubmitRequest(i, "q", FN, b"x", {})) for i in ("d", "e")]
    assert not first.duplicate and again.duplicate and again.invocation_id == "a"
    assert not elsewhere.duplicate and elsewhere.invocation_id == "c"
    assert [p.duplicate for p in plain] == [False, False] and store.get("b") is None
