"""The store: invocations, the frame journal, leases, tokens and exec jobs, over SQLite or PostgreSQL.

``open_store(url)`` opens (and migrates) a store: a file path, ``sqlite:///PATH``, ``:memory:`` or
``postgresql://...``. The contract is ``api.Store``; ``sql.SqlStore`` is the one implementation.
SQLAlchemy and Alembic are imported only when a store is opened, so importing ``store.api`` stays
light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .api import Store

if TYPE_CHECKING:
    from .notify import Notifier
    from .sql import SqlStore

__all__ = ["SqlStore", "Store", "open_store"]


def open_store(url: str | Path, *, notifier: Notifier | None = None) -> SqlStore:
    """Open the store at ``url``, bringing its schema up to date (Alembic ``upgrade head``)."""
    from .sql import SqlStore

    return SqlStore(str(url), notifier=notifier)


def __getattr__(name: str) -> Any:
    if name == "SqlStore":
        from .sql import SqlStore

        return SqlStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
