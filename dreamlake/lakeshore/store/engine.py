"""Engines and transactions for the store: URL mapping, SQLite pragmas and locking, migrations.

``make_engine(url)`` accepts a filesystem path, ``sqlite:///path``, ``:memory:`` or
``postgresql://...`` (mapped to the psycopg 3 driver). ``Database.tx(write=...)`` is the one way
the store opens a transaction:

- SQLite runs the driver in autocommit mode and issues ``BEGIN`` itself: ``BEGIN IMMEDIATE`` for
  writes, so two writers (threads or processes) serialise on SQLite's own lock instead of failing
  on a lock upgrade; ``busy_timeout`` makes them wait. Writes in one process also take a lock, and
  ``:memory:`` (one connection shared by every thread) takes it for reads too. A file's writes,
  one at a time under that lock anyway, run on one connection kept for them (``_held_tx``: a
  pool checkout, check-in and reset per transaction cost more than a small write itself), in
  the driver's transaction (its ``COMMIT`` too); reads take pooled connections.
- PostgreSQL uses READ COMMITTED; claims rely on ``FOR UPDATE SKIP LOCKED``. Its writes run side
  by side: the one that finds the kept write connection free (the group commit's writer, mostly)
  runs on it, the others on pooled connections. A write of one statement (a lone submit) runs as
  its own transaction (``tx``'s ``single``): one round trip where ``BEGIN``, the statement and
  ``COMMIT`` were three. A checkout is not pinged (no extra round trip per transaction): a connection that died while
  pooled (a database restart) fails its first statement, SQLAlchemy then invalidates the whole
  pool, and the hot paths, wrapped in :func:`retry_on_disconnect`, run once more on a fresh
  connection.

SQLite files are private: the store holds every argument, result and token hash, so its
directory is created 0700 and the database file 0600 (created that way before SQLite opens it;
SQLite gives its ``-wal`` and ``-shm`` files the database file's mode). An existing database file
(and its ``-wal`` / ``-shm``) readable by others is narrowed to 0600, with a log line.

SQLite durability: files run in WAL mode with ``synchronous = NORMAL``. A commit is then written to
the WAL (in the OS page cache) but fsynced only at checkpoints, so a *power loss or OS crash* can
lose the last few committed transactions (never corrupting the file), while a *process crash* (the
control plane or a local plane dying, killed, OOM) loses nothing: every committed ack, claim and
frame is already in the WAL file. That is the crash model the store promises; ``FULL`` would add an
fsync per commit (milliseconds on most disks) for power-loss durability only.

SQLite checkpoints: SQLite copies the WAL back into the database file (a checkpoint) every 1,000
pages by default, inside whichever commit crosses the mark, so that one commit took 10-40 ms on
this project's machine: a fleet's submit or claim caught behind it. A file store hands the
checkpoints to a thread of its own instead (:class:`_Checkpointer`): ``PASSIVE`` checkpoints, which
never wait for or block a reader or writer, about once a second while there are commits, and
SQLite's own automatic checkpoint stays as a backstop at ``SQLITE_BACKSTOP_PAGES``.

``migrate(db)`` brings the schema to ``HEAD_REVISION``. When the ``alembic_version`` row already
says so (every open but the first), it returns after one small query without importing Alembic;
otherwise it runs Alembic's ``upgrade head`` on a connection of the store (no alembic.ini).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.store import libpq
from dreamlake.lakeshore.store.outage import WriteLockBusy

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 30_000
SQLITE_BACKSTOP_PAGES = 16_384  # SQLite checkpoints in a commit only past this (64 MiB of WAL)
CHECKPOINT_EVERY_S = 1.0  # the checkpointer's period while commits come in
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_PG_IDLE = 0  # psycopg.pq.TransactionStatus.IDLE (psycopg is imported only for PostgreSQL)
_PG_MIGRATION_LOCK = 0x6C616B65  # pg_advisory_xact_lock key: "lake"
# The newest revision in migrations/versions; a test checks it against Alembic's script head.
# Bump it with every new migration, or opens will skip the upgrade.
HEAD_REVISION = "0020_partial_indexes"


P = ParamSpec("P")
T = TypeVar("T")


def retry_on_disconnect(fn: Callable[P, T]) -> Callable[P, T]:
    """Run ``fn`` (one whole transaction) once more when it failed because its connection was
    found dead (``connection_invalidated``: SQLAlchemy has then invalidated the pool, so the retry
    checks out a fresh connection). Only for calls that are safe to repeat: a transaction cut off
    before its commit was rolled back by the server; one cut off during its commit may have
    landed, and the store's writes answer a repeat as a duplicate."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            log.warning("store connection lost (%s); retrying on a fresh one", type(exc.orig).__name__)
        return fn(*args, **kwargs)

    return wrapped


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


PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_file(path: Path) -> None:
    """Make ``path`` (a SQLite database) a 0600 file in a directory created 0700, before SQLite
    opens it; narrow an existing file, and its ``-wal`` / ``-shm``, that others could read."""
    path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE)
    except FileExistsError:
        pass
    else:
        os.close(fd)
        return
    for each in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            mode = stat.S_IMODE(os.stat(each).st_mode)
            if mode & 0o077:
                os.chmod(each, mode & ~0o077)
                log.warning(
                    "store file %s was mode %o, readable by others; narrowed to %o", each, mode, mode & ~0o077
                )
        except FileNotFoundError:
            continue
        except PermissionError as exc:
            log.warning("store file %s is readable by others and cannot be narrowed: %s", each, exc)


class Database:
    """An engine plus the locking and BEGIN discipline the store needs on its dialect."""

    def __init__(self, url: str | Path) -> None:
        self.url = normalize_url(url)
        self.memory = self.url == "sqlite://"
        self.dialect = "postgresql" if self.url.startswith("postgresql") else "sqlite"
        self._lock: threading.RLock | None = threading.RLock() if self.dialect == "sqlite" else None
        self.engine = self._create()
        self._checkpointer: _Checkpointer | None = None
        # a SQLite file's writes run on one connection kept for them (``_held_tx``), under _lock;
        # PostgreSQL's, one at a time, under _pg_writer_lock
        self._writer: Connection | None = None
        self._writer_free = True  # False while a write transaction uses it (a nested one: the pool)
        self._writer_raw: Any = None  # a SQLite file's: its driver connection (``_FileWrite``) ...
        self._writer_clean = False  # ... and whether its last transaction committed cleanly
        # set by the caller holding the write lock: the next ``_held_tx`` on a SQLite file does not
        # wait for another process's write lock (raises ``WriteLockBusy``); cleared as it begins
        self.nowait = False
        # PostgreSQL's writes run side by side: the first to take this (the group writer, mostly)
        # runs on the kept connection, the others on pooled ones
        self._pg_writer_lock = threading.Lock()
        if self.dialect == "sqlite" and not self.memory:
            self._checkpointer = _Checkpointer(self.url[len("sqlite:///") :])

    def _create(self) -> Engine:
        if self.dialect == "postgresql":
            return sa.create_engine(self.url, pool_pre_ping=False, pool_size=10, max_overflow=20)
        if not self.memory:
            private_file(Path(self.url[len("sqlite:///") :]))
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
                cur.execute(f"PRAGMA wal_autocheckpoint = {SQLITE_BACKSTOP_PAGES}")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # tx() has issued BEGIN [IMMEDIATE] on the driver connection already; this covers other
            # users of the engine (Alembic's CLI path), which would otherwise run in autocommit.
            raw = conn.connection.driver_connection
            if raw is not None and not raw.in_transaction:
                immediate = conn.get_execution_options().get("lakeshore_write", False)
                raw.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    @property
    def write_lock(self) -> threading.RLock | None:
        """The lock every write transaction of this process takes on SQLite (its writes are one at
        a time anyway); None on PostgreSQL, whose writers run side by side."""
        return self._lock

    def tx(self, *, write: bool, single: bool = False) -> contextlib.AbstractContextManager[Connection]:
        """A transaction: committed on normal exit, rolled back on an exception.

        ``single``: the caller writes with one statement (reads may follow it). On PostgreSQL that
        statement then runs as its own transaction (the driver in autocommit), without a ``BEGIN``
        and a ``COMMIT`` of two round trips more: durable when it returns, all or nothing, as the
        transaction would be. Ignored on SQLite (its ``BEGIN`` and commit are calls, not trips)
        and when the kept write connection is busy. A SQLite file's write: :class:`_FileWrite`."""
        if write and self._checkpointer is not None:
            return _FileWrite(self)
        return self._tx(write=write, single=single)

    @contextlib.contextmanager
    def _tx(self, *, write: bool, single: bool = False) -> Iterator[Connection]:
        if self.dialect != "sqlite":
            if write and self._pg_writer_lock.acquire(blocking=False):
                try:
                    with self._held_tx(autocommit=single) as conn:
                        yield conn
                finally:
                    self._pg_writer_lock.release()
                return
            with self.engine.connect() as conn, conn.begin():
                yield conn
            return
        lock = self._lock if (self._lock is not None and (write or self.memory)) else None
        with lock if lock is not None else contextlib.nullcontext(), self.engine.connect() as conn:
            # BEGIN straight on the sqlite3 connection: cheaper than a statement through SQLAlchemy
            conn.connection.driver_connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")  # type: ignore[union-attr]
            with conn.begin():
                yield conn

    def _kept(self) -> tuple[Connection, Any]:
        """The kept write connection and its driver connection, replaced first when it may not take
        the next transaction (``_settled``): a connection SQLAlchemy found broken (invalidated),
        or one left with a transaction open, is closed and a fresh one opened."""
        conn = self._writer
        if conn is None or not _settled(conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.invalidate()  # closed, not pooled: a SQLite one's busy_timeout is 0
                    conn.close()
            conn = self._writer = self.engine.connect()
            if self.dialect == "sqlite":  # its waits for the file lock are _begin_immediate's
                conn.connection.driver_connection.execute("PRAGMA busy_timeout = 0")  # type: ignore[union-attr]
        return conn, conn.connection.driver_connection

    @contextlib.contextmanager
    def _held_tx(self, *, autocommit: bool = False) -> Iterator[Connection]:
        """A PostgreSQL write transaction on the connection the writes keep (under
        ``_pg_writer_lock``, taken without waiting by the caller: a write that finds it busy takes
        a pooled connection; a SQLite file's: :class:`_FileWrite`). No pool checkout, check-in and
        reset per transaction. The transaction is the driver's: psycopg's own ``BEGIN`` before the
        first statement (none in ``autocommit``: see ``tx``'s ``single``), then ``COMMIT`` (or
        ``ROLLBACK`` on an exception), its errors raised as SQLAlchemy raises them (``_commit``).
        A broken connection is replaced by the next transaction (``_kept``;
        ``retry_on_disconnect`` sees the same error as before)."""
        self._writer_free = False
        conn: Connection | None = None
        try:
            conn, raw = self._kept()
            if autocommit:
                raw.autocommit = True  # idle (``_settled``): no round trip
            try:
                yield conn
            except BaseException:
                _rollback(conn, raw)
                raise
            _commit(conn, raw)
        finally:
            # (not on an invalidated connection: reading its ``connection`` would open a new one
            # here, in an outage a connect attempt per failed write; ``_settled`` replaces it)
            if autocommit and conn is not None and not conn.invalidated:
                try:
                    conn.connection.driver_connection.autocommit = False  # type: ignore[union-attr]
                except Exception:  # a broken connection: ``_settled`` replaces it
                    pass
            self._writer_free = True  # a broken one is replaced by the next transaction (_settled)

    def dispose(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        # the kept write connection closes only between transactions: closed under a lease sweep
        # still writing on it, it went back to the pool, where another thread could take it while
        # the sweep ran (two threads on one sqlite3 connection crashed the process); one still
        # busy after the wait is left to the garbage collector
        lock = self._lock if self._lock is not None else self._pg_writer_lock
        if self._writer is not None and lock.acquire(timeout=5.0):
            try:
                writer, self._writer, self._writer_clean = self._writer, None, False
                if writer is not None:
                    with contextlib.suppress(Exception):
                        writer.close()
            finally:
                lock.release()
        self.engine.dispose()


class _FileWrite:
    """A SQLite file's write transaction (``Database.tx``), under the write lock: on the connection
    the writes keep (no pool checkout, check-in and reset per transaction: they took half of what
    a small write transaction spent outside SQLite, 55 -> 28 us), or, nested in another write of
    this thread (which holds that connection), on a pooled one. The transaction is the driver's:
    ``BEGIN IMMEDIATE`` (``_begin_immediate``: ``Database.nowait``), then ``COMMIT`` (or
    ``ROLLBACK`` on an exception), its errors raised as SQLAlchemy raises them (``_commit``).
    SQLAlchemy's own begin and commit around it cost about 17 us a transaction in the control
    plane, on every write; it begins one only when a statement goes through it (not a ``Direct``
    one), and then commits it. A class, not a generator: its entry and exit are the group
    commit's on every transaction. The connection is checked (``_settled``) only when the
    transaction before it on it did not commit cleanly (``_writer_clean``); a clean one is
    still checked for a transaction left open, which also finds a driver connection closed
    under it (then replaced, as ``_kept`` replaces any broken one)."""

    __slots__ = ("_conn", "_db", "_nested", "_raw")

    def __init__(self, db: Database) -> None:
        self._db = db
        self._nested: contextlib.AbstractContextManager[Connection] | None = None

    def __enter__(self) -> Connection:
        db = self._db
        lock = db._lock
        assert lock is not None
        lock.acquire()
        try:
            if not db._writer_free:  # a write nested in this thread's: a pooled connection
                self._nested = db._tx(write=True)
                return self._nested.__enter__()
            db._writer_free = False
            conn, raw, clean = db._writer, db._writer_raw, db._writer_clean
            db._writer_clean = False  # until this one commits cleanly
            try:
                if conn is None or not clean or raw.in_transaction:
                    raise LookupError
            except Exception:  # (a closed driver connection raises too)
                conn, raw = db._kept()
                db._writer_raw = raw
            self._conn, self._raw = conn, raw
            nowait, db.nowait = db.nowait, False
            try:
                _begin_immediate(raw, nowait)
            except WriteLockBusy:
                raise
            except Exception as exc:  # as SQLAlchemy raises it: a closed connection is invalidated
                conn._handle_dbapi_exception(exc, "BEGIN IMMEDIATE", (), None, None)
            return conn
        except BaseException:
            if self._nested is None:
                db._writer_free = True
            lock.release()
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        db = self._db
        try:
            if self._nested is not None:
                self._nested.__exit__(exc_type, exc, tb)
            elif exc_type is not None:
                _rollback(self._conn, self._raw)
            else:
                _commit(self._conn, self._raw)
                db._writer_clean = True
        finally:
            if self._nested is None:
                db._writer_free = True
            assert db._lock is not None
            db._lock.release()
        if exc_type is None and db._checkpointer is not None:
            db._checkpointer.committed()


def _commit(conn: Connection, raw: Any) -> None:
    """Commit a held write transaction: SQLAlchemy's when a statement through it began one, else
    the driver's (psycopg, in autocommit or with nothing begun: none to send); a commit that fails
    is rolled back, then raised as SQLAlchemy raises it."""
    if conn.get_transaction() is not None:  # a statement through SQLAlchemy began one
        try:
            conn.commit()
        except BaseException:  # its transaction is left invalid: rolled back, or none works
            _rollback(conn, raw)
            raise
    else:
        try:
            raw.commit()
        except Exception as exc:
            _rollback(conn, raw)
            conn._handle_dbapi_exception(exc, "COMMIT", (), None, None)


def _begin_immediate(raw: Any, nowait: bool) -> None:
    """``BEGIN IMMEDIATE`` on the kept write connection, whose own ``busy_timeout`` is 0: while
    another process holds the file's write lock, ``nowait`` raises :class:`WriteLockBusy` at once
    (the group commit's event-loop path, which must not stall); otherwise it tries again with a
    growing sleep, as SQLite's busy handler would, up to ``SQLITE_BUSY_TIMEOUT_MS`` (then the
    driver's "database is locked", an outage)."""
    deadline = 0.0
    delay = 0.001
    while True:
        try:
            raw.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_BUSY:  # (BUSY_RECOVERY too)
                raise
            if nowait:
                raise WriteLockBusy() from exc
            now = time.monotonic()
            deadline = deadline or now + SQLITE_BUSY_TIMEOUT_MS / 1000
            if now >= deadline:
                raise
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.05)


def _rollback(conn: Connection, raw: Any) -> None:
    """Roll a held write transaction back, SQLAlchemy's when a statement through it began one; a
    rollback that fails leaves the transaction open, and ``_settled`` replaces the connection."""
    libpq.forget(raw)  # (psycopg's rollback deallocates what the connection had prepared)
    with contextlib.suppress(Exception):
        if conn.get_transaction() is not None:  # active or not: an invalid one blocks every statement
            conn.rollback()  # (after a failed commit it ends SQLAlchemy's, not always the driver's)
    with contextlib.suppress(Exception):
        if _in_transaction(raw):
            raw.rollback()


def _in_transaction(raw: Any) -> bool:
    """Whether a driver connection (sqlite3's or psycopg's) has a transaction open, or, for
    psycopg, is anything but idle (a failed transaction, a lost connection)."""
    if hasattr(raw, "in_transaction"):
        return bool(raw.in_transaction)
    return bool(raw.closed or raw.autocommit or raw.info.transaction_status != _PG_IDLE)


def _settled(conn: Connection) -> bool:
    """Whether a kept write connection may take the next transaction: not invalidated, and no
    transaction left open on it, SQLAlchemy's or the driver's (after a commit and its rollback
    both failed, every later ``BEGIN`` on it would fail; a pooled connection was reset on return)."""
    if conn.invalidated or conn.closed or conn.get_transaction() is not None:
        return False
    try:
        raw = conn.connection.driver_connection
        return raw is not None and not _in_transaction(raw)
    except Exception:  # a closed driver connection: not reusable
        return False


class _Checkpointer:
    """Checkpoints a SQLite file's WAL from a thread of its own (see the module docstring).

    Started by the first commit; each pass is ``PRAGMA wal_checkpoint(PASSIVE)`` on a connection
    of its own, which copies what it can without waiting for a lock (a reader or writer holding
    one leaves the rest for the next pass). A failing pass is logged once and retried; SQLite's
    backstop still bounds the WAL."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._warned = False

    def committed(self) -> None:
        if not self._dirty.is_set():  # a flag read: ``set`` takes a lock and notifies, per commit
            self._dirty.set()
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(
                        target=self._run, name="lakeshore-checkpoint", daemon=True
                    )
                    self._thread.start()

    def _run(self) -> None:
        import sqlite3

        conn: sqlite3.Connection | None = None
        try:
            while not self._stop.is_set():
                self._dirty.wait()
                if self._stop.wait(CHECKPOINT_EVERY_S):  # let commits gather between passes
                    break
                self._dirty.clear()
                try:
                    if conn is None:
                        conn = sqlite3.connect(self._path, timeout=0, check_same_thread=False)
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "a WAL checkpoint of %s failed (retried each second): %s", self._path, exc
                        )
        finally:
            if conn is not None:
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def schema_revision(conn: Connection, dialect: str) -> str | None:
    """The revision in ``alembic_version``; None when the table is missing or empty."""
    if dialect == "postgresql":
        exists = conn.execute(sa.text("SELECT to_regclass('alembic_version') IS NOT NULL")).scalar_one()
    else:
        exists = conn.exec_driver_sql(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"
        ).first()
    if not exists:
        return None
    rows = conn.exec_driver_sql("SELECT version_num FROM alembic_version").fetchall()
    return rows[0][0] if len(rows) == 1 else None


def migrate(db: Database) -> None:
    """Bring the schema to the newest revision; safe to run from many processes at once.

    Fast path: a read of ``alembic_version``; only a store behind ``HEAD_REVISION`` (or a fresh
    one) imports Alembic and upgrades, under the write lock (SQLite) or an advisory lock
    (PostgreSQL), where Alembic re-reads the revision, so concurrent first opens migrate once."""
    if not db.memory:
        with db.tx(write=False) as conn:
            if schema_revision(conn, db.dialect) == HEAD_REVISION:
                return
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with db.tx(write=True) as conn:
        if db.dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        if not conn.in_transaction():
            # the kept SQLite write connection's transaction is the driver's (``_held_tx``): begun
            # on SQLAlchemy too, Alembic runs every step in it instead of committing its own, so
            # the write lock is held until the last step (a second process waits, then finds head)
            conn.begin()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    log.debug("store schema at head (%s)", db.dialect)
