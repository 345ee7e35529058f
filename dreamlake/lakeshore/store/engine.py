"""Engines and transactions for the store: URL mapping, SQLite pragmas and locking, migrations.

``make_engine(url)`` accepts a filesystem path, ``sqlite:///path``, ``:memory:`` or
``postgresql://...`` (mapped to the psycopg 3 driver). ``Database.tx(write=...)`` is the one way
the store opens a transaction:

- SQLite runs the driver in autocommit mode and issues ``BEGIN`` itself: ``BEGIN IMMEDIATE`` for
  writes, so two writers (threads or processes) serialise on SQLite's own lock instead of failing
  on a lock upgrade; ``busy_timeout`` makes them wait. Writes in one process also take a lock, and
  ``:memory:`` (one connection shared by every thread) takes it for reads too.
- PostgreSQL uses the pool and READ COMMITTED; claims rely on ``FOR UPDATE SKIP LOCKED``.

``migrate(db)`` runs Alembic's ``upgrade head`` on a connection of the store (no alembic.ini).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from dreamlake.lakeshore.errors import PlaneError

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 30_000
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_PG_MIGRATION_LOCK = 0x6C616B65  # pg_advisory_xact_lock key: "lake"


def normalize_url(url: str | Path) -> str:
    """Map the accepted spellings to a SQLAlchemy URL; raise PlaneError for anything else."""
    text = str(url).strip()
    if not text:
        raise PlaneError(
            "empty store URL: pass a file path, 'sqlite:///PATH', ':memory:' or 'postgresql://...'"
        )
    if text in (":memory:", "sqlite://", "sqlite:///:memory:"):
        return "sqlite://"
    for prefix in ("postgresql://", "postgres://"):
        if text.startswith(prefix):
            return "postgresql+psycopg://" + text[len(prefix) :]
    if text.startswith(("postgresql+psycopg://", "sqlite:///")):
        return text
    if "://" in text:
        raise PlaneError(
            f"unsupported store URL {text!r}: use a file path, 'sqlite:///PATH', ':memory:' or 'postgresql://...'"
        )
    return "sqlite:///" + str(Path(text).expanduser())


class Database:
    """An engine plus the locking and BEGIN discipline the store needs on its dialect."""

    def __init__(self, url: str | Path) -> None:
        self.url = normalize_url(url)
        self.memory = self.url == "sqlite://"
        self.dialect = "postgresql" if self.url.startswith("postgresql") else "sqlite"
        self._lock: threading.RLock | None = threading.RLock() if self.dialect == "sqlite" else None
        self.engine = self._create()

    def _create(self) -> Engine:
        if self.dialect == "postgresql":
            return sa.create_engine(self.url, pool_pre_ping=True, pool_size=10, max_overflow=20)
        if not self.memory:
            Path(self.url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        args: dict[str, Any] = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        engine = (
            sa.create_engine(self.url, connect_args=args, poolclass=StaticPool)
            if self.memory
            else sa.create_engine(self.url, connect_args=args)
        )
        memory = self.memory

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # autocommit driver; we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            if not memory:
                cur.execute("PRAGMA journal_mode = WAL")
                cur.execute("PRAGMA synchronous = NORMAL")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            immediate = conn.get_execution_options().get("lakeshore_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    @contextlib.contextmanager
    def tx(self, *, write: bool) -> Iterator[Connection]:
        """A transaction: committed on normal exit, rolled back on an exception."""
        lock = self._lock if (self._lock is not None and (write or self.memory)) else None
        with lock if lock is not None else contextlib.nullcontext(), self.engine.connect() as conn:
            if self.dialect == "sqlite":
                conn.execution_options(lakeshore_write=write)
            with conn.begin():
                yield conn

    def dispose(self) -> None:
        self.engine.dispose()


def migrate(db: Database) -> None:
    """Bring the schema to the newest revision; safe to run from many processes at once."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with db.tx(write=True) as conn:
        if db.dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    log.debug("store schema at head (%s)", db.dialect)
