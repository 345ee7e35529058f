"""A store that is down is an outage, not a bug (issue 32, item 2).

The store raises whatever its driver raises: a refused connection, PostgreSQL restarting or
shutting down, SQLite busy past its timeout, a full or read-only disk. None of those is the
control plane's bug, and none is the caller's fault: each is answered ``503`` with ``Retry-After``
and a one-line cause (``store unavailable: ...``, ``store full: ...``), which the SDK and nymph
retry as they retry any outage, and whose text the SDK's final error carries. ``500`` stays for
bugs.

- :func:`classify` turns an exception into a :class:`StoreOutage` (a ``PlaneError`` with status
  503) when it is one of those, else None;
- :class:`Outages` is the server's record of the current outage: logged once when it starts (with
  its cause) and once when writes succeed again with none failing for ``QUIET_S`` (with how long
  it lasted and how many answers were 503 meanwhile), never a traceback per request; it also pauses lease expiry while writes
  fail and for ``hold_s`` after the last failure (see :meth:`Outages.expiry_paused`), so no lease
  lapses for want of a heartbeat the store could not take;
- :func:`probe` is ``/healthz``'s check: a cheap read, and for a SQLite file its disk's free space.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from typing import Any

import sqlalchemy as sa

from dreamlake.lakeshore.errors import PlaneError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # the Retry-After of a 503 for a store outage
# An outage ends once writes succeed with no failure for this long: on a full disk small writes
# may fit the room SQLite's WAL has while larger ones fail, which is one outage, not many
QUIET_S = 5.0
FULL_BELOW_BYTES = 1 << 20  # a SQLite store's disk with less free space than this is full

# SQLSTATE classes and codes of PostgreSQL that mean "not now", not "wrong"
_PG_UNAVAILABLE_CLASSES = ("08",)  # connection exception
_PG_UNAVAILABLE = {
    "57P01": "PostgreSQL is shutting down (admin shutdown)",
    "57P02": "PostgreSQL is restarting after a crash",
    "57P03": "PostgreSQL is starting up",
    "57P04": "the database was dropped",
    "25006": "the database is read-only",
    "53000": "PostgreSQL is out of resources",
    "53200": "PostgreSQL is out of memory",
    "53300": "PostgreSQL has too many connections",
    "40P01": "a deadlock",  # never expected; retried as an outage rather than a bug
}
_PG_FULL = {"53100": "PostgreSQL's disk is full"}
_SQLITE_FULL = ("database or disk is full",)
_SQLITE_UNAVAILABLE = (
    ("database is locked", "SQLite stayed busy past its timeout (database is locked)"),
    ("readonly database", "the SQLite file is read-only"),
    ("disk i/o error", "SQLite met a disk I/O error"),
    ("unable to open database file", "the SQLite file cannot be opened"),
)


class WriteLockBusy(Exception):
    """A write begun without waiting (``Database.nowait``) found a SQLite file's write lock held
    by another process: nothing of it was written. The group commit's event-loop path raises it
    instead of stalling the loop for as long as the other process writes; the writer then hands
    the writes to its thread, which waits. ``pending``: the indexes, in the ``write_batch`` call,
    of the writes not applied (a batch's earlier transactions may have committed)."""

    def __init__(self, pending: list[int] | None = None) -> None:
        super().__init__("the SQLite file's write lock is held by another process")
        self.pending = pending or []


class StoreOutage(PlaneError):
    """The store cannot answer now: ``kind`` ``unavailable`` or ``full``, ``cause`` in words."""

    def __init__(self, kind: str, cause: str) -> None:
        self.kind = kind
        self.cause = cause
        super().__init__(f"store {kind}: {cause}; retry later", status=503)
        self.retry_after = RETRY_AFTER_S


def classify(exc: BaseException) -> StoreOutage | None:
    """The outage ``exc`` is (a driver's error, wrapped by SQLAlchemy or not), else None."""
    if isinstance(exc, StoreOutage):
        return exc
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        seen += 1
        got = _one(cur)
        if got is not None:
            return got
        cur = getattr(cur, "orig", None) or cur.__cause__
    return None


def _one(exc: BaseException) -> StoreOutage | None:
    if isinstance(exc, sa.exc.TimeoutError):  # the pool had no connection to give in time
        return StoreOutage("unavailable", "no store connection came free in time (the pool is exhausted)")
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return StoreOutage("unavailable", f"the store connection was lost ({_first_line(exc.orig)})")
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        if sqlstate in _PG_FULL:
            return StoreOutage("full", f"{_PG_FULL[sqlstate]} ({_first_line(exc)})")
        if sqlstate in _PG_UNAVAILABLE:
            return StoreOutage("unavailable", _PG_UNAVAILABLE[sqlstate])
        if sqlstate[:2] in _PG_UNAVAILABLE_CLASSES:
            return StoreOutage("unavailable", f"PostgreSQL connection failed ({_first_line(exc)})")
        return None
    module = type(exc).__module__
    if module.startswith("psycopg") and type(exc).__name__ in ("OperationalError", "InterfaceError"):
        return StoreOutage("unavailable", f"cannot reach PostgreSQL ({_short_pg(exc)})")
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        if any(s in text for s in _SQLITE_FULL):
            return StoreOutage("full", "the SQLite store's disk is full (database or disk is full)")
        for needle, cause in _SQLITE_UNAVAILABLE:
            if needle in text:
                return StoreOutage("unavailable", cause)
        return None
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreOutage("full", f"{os.strerror(exc.errno)} ({exc.filename or 'the store'})")
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return StoreOutage("unavailable", f"the store's filesystem is read-only ({exc.filename or ''})")
    return None


def _first_line(exc: Any) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _short_pg(exc: BaseException) -> str:
    """psycopg's "connection failed: connection to server at "h" (ip), port p failed: Connection
    refused" ... as its last clause (what went wrong) and where."""
    line = _first_line(exc)
    where = line.split("connection to server at ", 1)
    if len(where) == 2:
        place, _, why = where[1].rpartition(" failed: ")
        if why:
            return f"{why.strip()} at {place.strip()}"[:300]
    return line


class Outages:
    """The current store outage as the server saw it (see the module docstring). Thread-safe."""

    def __init__(self, hold_s: float, quiet_s: float = QUIET_S) -> None:
        self.hold_s = hold_s  # lease expiry stays paused this long after the last failure
        self.quiet_s = quiet_s  # an outage ends at a success this long after its last failure
        self._lock = threading.Lock()
        self.current: StoreOutage | None = None
        self._since = 0.0
        self._answers = 0  # requests answered 503 in the current outage
        self.last_failure = -1e18  # monotonic
        self.outages = 0  # how many began (a metric for tests and ops)

    def failed(self, outage: StoreOutage, answers: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self.last_failure = now
            self._answers += answers
            if self.current is not None:
                self.current = outage  # the latest cause (PostgreSQL restarting, then refusing)
                return
            self.current = outage
            self._since = now
            self.outages += 1
        log.warning(
            "%s; answering 503 (Retry-After %d s) until it is back; lease expiry paused meanwhile",
            str(outage).removesuffix("; retry later"),
            RETRY_AFTER_S,
        )

    def succeeded(self) -> None:
        """A write committed: the outage, if any, is over once no write failed for ``quiet_s``."""
        if self.current is None:  # the hot path: one attribute read
            return
        with self._lock:
            if time.monotonic() - self.last_failure < self.quiet_s:
                return
            outage, self.current = self.current, None
            answers, self._answers = self._answers, 0
            took = time.monotonic() - self._since
        if outage is not None:
            log.warning(
                "store is back after %.1f s (%s); %d requests were answered 503 meanwhile; "
                "lease expiry resumes in %.0f s",
                took,
                outage.cause,
                answers,
                self.hold_s,
            )

    def expiry_paused(self) -> bool:
        """Whether lease expiry must wait: writes failed within the last ``hold_s`` seconds (a
        heartbeat refused meanwhile must get a lease's time to land before its lease may lapse).
        Not while an outage is merely still declared: on a quiet plane the expiry pass is the
        write that ends it (see ``_expire_loop``), so it must run once no write failed for a lease."""
        return time.monotonic() - self.last_failure < self.hold_s


def probe(store: Any) -> StoreOutage | None:
    """``/healthz``'s check of ``store``: a cheap read, and for a SQLite file the free space of its
    disk. None when it is fine, else the outage."""
    db = getattr(store, "db", None)
    if db is None or not hasattr(db, "tx"):
        return None
    try:
        with db.tx(write=False) as conn:
            conn.execute(sa.text("SELECT 1")).scalar()
    except Exception as exc:
        return classify(exc) or StoreOutage("unavailable", f"a read failed ({_first_line(exc)})")
    if getattr(db, "dialect", "") == "sqlite" and not getattr(db, "memory", True):
        path = str(db.url)[len("sqlite:///") :]
        try:
            st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
        except OSError:
            return None
        free = st.f_bavail * st.f_frsize
        if free < FULL_BELOW_BYTES:
            return StoreOutage(
                "full",
                f"the SQLite store's disk has {free / 2**20:.1f} MiB free (under "
                f"{FULL_BELOW_BYTES >> 20} MiB) at {os.path.dirname(path)}",
            )
    return None
