"""Store fixtures: one ``store`` per backend (SQLite file, SQLite ``:memory:``, PostgreSQL).

PostgreSQL comes from ``LAKESHORE_TEST_PG_URL`` (e.g.
``postgresql://postgres:postgres@127.0.0.1:5432/postgres``). ``pg_database()`` creates a fresh
``lakeshore_test_<random>`` database on that server, yields its URL and drops it afterwards, so
parallel runs never share tables; other suites (the server's) reuse it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dreamlake.lakeshore.store import open_store, schema
from dreamlake.lakeshore.store.sql import SqlStore
from tests.conftest import require

PG_ENV = "LAKESHORE_TEST_PG_URL"


def pg_url() -> str | None:
    return os.environ.get(PG_ENV) or None


@contextlib.contextmanager
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this run; yields its ``postgresql://`` URL, drops it after.

    Skips (laptop) or fails (CI) when ``LAKESHORE_TEST_PG_URL`` is unset."""
    base = pg_url()
    require(base is not None, f"PostgreSQL: set {PG_ENV}")
    assert base is not None
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    name = f"lakeshore_test_{secrets.token_hex(6)}"
    admin = make_url(base).set(drivername="postgresql")
    dsn = admin.render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def pg_session_url() -> Iterator[str]:
    with pg_database() as url:
        yield url


def _truncate_all(store: SqlStore) -> None:
    names = ", ".join(t.name for t in schema.metadata.sorted_tables)
    with store.db.tx(write=True) as conn:
        conn.execute(sa.text(f"TRUNCATE {names}"))


@pytest.fixture(params=["sqlite-file", "sqlite-memory", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite-file":
        return str(tmp_path / "store.db")
    if request.param == "sqlite-memory":
        return ":memory:"
    return str(request.getfixturevalue("pg_session_url"))


@pytest.fixture
def store(store_url: str) -> Iterator[SqlStore]:
    s = open_store(store_url)
    if s.kind == "postgresql":
        _truncate_all(s)
    try:
        yield s
    finally:
        s.close()
