"""Store helpers the contract suites share: submit a call, ack it, a time after every lease."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store import schema
from dreamlake.lakeshore.store.api import SubmitRequest
from dreamlake.lakeshore.store.sql import SqlStore

FN = {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"}


FUTURE = 10**10  # an expire_leases "now" after every lease


def submit(store: SqlStore, queue: str = "q", **run_config: Any) -> str:
    inv = str(run_config.pop("invocation_id", None) or new_ulid())
    parent = run_config.pop("parent", None)
    store.submit(
        SubmitRequest(
            invocation_id=inv,
            queue=queue,
            function=FN,
            args_blob=b"env-" + inv.encode(),
            run_config=run_config,
            parent_invocation_id=parent,
        )
    )
    return inv


def ack(store: SqlStore, inv: str, state: str = "succeeded", **kw: Any) -> Any:
    args: dict[str, Any] = {"attempt": None, "worker_id": None, "result_blob": None, "error": None}
    args.update(kw)
    return store.ack(inv, state, **args)


# a trigger that refuses an invocation whose args are b"bad" (a row the database refuses)
REFUSE_BAD_ARGS = """
CREATE FUNCTION refuse_bad() RETURNS trigger AS $$
BEGIN
  IF NEW.args_blob = '\\x626164'::bytea THEN RAISE EXCEPTION 'refused by the test'; END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER refuse_bad BEFORE INSERT ON invocations FOR EACH ROW EXECUTE FUNCTION refuse_bad();
"""
REFUSE_BAD_ARGS_SQLITE = (
    "CREATE TRIGGER refuse_bad BEFORE INSERT ON invocations WHEN NEW.args_blob = X'626164' "
    "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
)


def refuse_bad_args(store: SqlStore, on: bool = True) -> None:
    """Make the store's database refuse (``on``) or take again an invocation whose args are b"bad"."""
    pg = store.kind == "postgresql"
    with store.db.tx(write=True) as conn:
        if on:
            conn.exec_driver_sql(REFUSE_BAD_ARGS if pg else REFUSE_BAD_ARGS_SQLITE)
        else:
            conn.exec_driver_sql("DROP TRIGGER refuse_bad" + (" ON invocations" if pg else ""))


def filled(store: SqlStore, rows: Iterable[dict[str, Any]]) -> SqlStore:
    """``store`` with ``rows`` inserted into ``invocations`` as they are (a backlog for the query
    plans' tests), and on PostgreSQL the table's statistics taken, as autovacuum would."""
    with store.db.tx(write=True) as conn:
        conn.execute(sa.insert(schema.invocations), list(rows))
    if store.kind == "postgresql":
        with store.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE invocations")
    return store


def generic_plan(conn: Connection, statement: str, values: Mapping[str, Any], name: str) -> Any:
    """PostgreSQL's generic plan of ``statement`` (psycopg's ``%(name)s`` parameters), the one a
    prepared statement may switch to after five executions: planned without its values."""
    from psycopg import sql

    names: list[str] = []

    def numbered(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", numbered, statement)
    args = ", ".join(sql.Literal(values[k]).as_string(None) for k in names)
    conn.exec_driver_sql(f"PREPARE {name} AS {text}")
    try:
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        ((plan,),) = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) EXECUTE {name}({args})").fetchall()
    finally:
        conn.exec_driver_sql(f"DEALLOCATE {name}")
    return plan[0]["Plan"]
