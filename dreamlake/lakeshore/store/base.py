"""What every part of ``SqlStore`` shares: the database, the notifier and the dialect's INSERT.

``SqlStore`` (sql.py) is assembled from one class per concern (invocations.py, frames.py,
workers.py, exec_jobs.py), each a subclass of :class:`StoreBase`. Each builds its hot statements
once per dialect (``functools.cache`` on a ``_statements(dialect)`` function of its module) and
binds them in its ``__init__``, which calls ``super().__init__`` so the classes combine in any
order. A concern also offers ``_..._in(conn, ...)`` methods that run inside a transaction the caller
holds: sql.py composes those into the daemon's one-transaction calls (poll, heartbeat,
expire_leases) and the group commit (write_batch).
"""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa

from .engine import Database
from .notify import Notifier


def dialect_insert(dialect: str, table: sa.Table) -> Any:
    """``INSERT`` with the dialect's ``on_conflict_do_nothing`` / ``on_conflict_do_update``."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table)
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table)


class StoreBase:
    """The database and notifier of a store; the concern classes of sql.py build on it."""

    def __init__(self, db: Database, notifier: Notifier) -> None:
        self.db = db
        self.notifier = notifier

    @property
    def kind(self) -> str:
        """``"sqlite"`` or ``"postgresql"`` (for /healthz)."""
        return self.db.dialect

    def inline_write_lock(self) -> threading.RLock | None:
        """See :meth:`~.api.Store.inline_write_lock`: SQLite's write lock; None on PostgreSQL."""
        return self.db.write_lock

    def close(self) -> None:
        self.db.dispose()

    def _insert(self, table: sa.Table) -> Any:
        return dialect_insert(self.db.dialect, table)

    def _notify(self, *channels: str) -> None:
        """Wake the waiters of ``channels`` (call after the transaction committed)."""
        self.notifier.notify_many(channels)
