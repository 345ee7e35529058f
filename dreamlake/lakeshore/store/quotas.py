"""Per-namespace quotas as the store keeps and counts them (issue 31; the server enforces them in
``server/quotas.py``).

``namespace_quotas`` holds one row per namespace with a quota: ``max_queued`` (queued invocations),
``max_topics`` (topics the namespace's producers made) and ``max_payload_bytes`` (bytes presigned
for upload within the payload retention); NULL is no limit, and a namespace without a row has none.
``set_quota`` replaces a namespace's three limits at once (all None: the row goes).

The counts each read one index and stop early where they can: ``count_queued`` and
``count_topics`` count at most ``up_to`` rows (the quota), so their cost is bounded by the quota
and never by the table (``count_queued_in`` is the same count in the caller's transaction: the
submit's own, which enforces ``max_queued`` strictly, store/invocations.py ``_submit_many_in``,
after ``lock_queued_in`` serialised the namespace's quota-checked submits on PostgreSQL); ``payload_bytes`` sums the namespace's presigns since a moment off
``ix_payload_usage_ns``. ``record_payload`` adds one presigned upload (an upsert on its key: the
same key presigned again is counted once, at its latest size) and drops that namespace's rows
older than the window it is given, so the ledger holds at most one retention's presigns.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.errors import QuotaExceeded

from . import schema as t
from .api import Quota
from .base import StoreBase
from .engine import retry_on_disconnect

QUEUED_RETRY_AFTER_S = 5  # queued invocations run and leave: worth asking again soon
ASK = "or ask the operator to raise it (lakeshore namespace quota)"
# pg_advisory_xact_lock(class, key) of a namespace's quota-checked submits: "quot", then a hash of
# the namespace (two int4 keys: a space apart from the migrations' one bigint key, engine.py)
_PG_QUEUED_LOCK = 0x71756F74


def quota_message(namespace: str, quota: str, limit: int, detail: str, hint: str) -> str:
    """The text of a namespace's 429 past ``quota`` (server/quotas.py ``refusal``)."""
    return f"namespace '{namespace}' is at its quota {quota} of {limit}{detail}: {hint}, {ASK}"


def queued_refusal(namespace: str, limit: int, queued: int, adding: int) -> QuotaExceeded:
    """The refusal of ``adding`` more queued invocations in ``namespace`` past its ``max_queued``
    of ``limit`` with ``queued`` queued: the server answers it as a 429 with ``Retry-After``."""
    return QuotaExceeded(
        quota_message(
            namespace,
            "max_queued",
            limit,
            f" queued invocations ({queued} queued, {adding} more asked)",
            "retry once some have run",
        ),
        429,
        QUEUED_RETRY_AFTER_S,
        quota="max_queued",
        limit=limit,
    )


def _lock_key(namespace: str) -> int:
    """A signed int4 of ``namespace`` (two namespaces sharing one only share a lock)."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=4).digest(), "big", signed=True)


def lock_queued_in(conn: Connection, dialect: str, namespaces: Iterable[str]) -> None:
    """Serialise the quota-checked submits of ``namespaces`` until the caller's transaction ends:
    on PostgreSQL (READ COMMITTED, writers side by side in several processes) an advisory lock
    per namespace, taken in the order of their keys (no two transactions wait on each other: in
    the names' order, two names sharing a key would break it and deadlock); SQLite's writes are
    one at a time already. Held, a transaction's count sees every earlier holder's commit."""
    if dialect != "postgresql":
        return
    for key in sorted({_lock_key(namespace) for namespace in namespaces}):
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:c, :k)"), {"c": _PG_QUEUED_LOCK, "k": key})


def count_queued_in(conn: Connection, namespace: str, up_to: int) -> int:
    """``count_queued`` in the caller's transaction."""
    i = t.invocations
    due = sa.select(sa.literal(1)).where(
        i.c.namespace == namespace, i.c.state == "queued", i.c.not_before.is_(None)
    )
    return int(conn.execute(sa.select(sa.func.count()).select_from(due.limit(up_to).subquery())).scalar_one())


class QuotaStore(StoreBase):
    def set_quota(self, namespace: str, quota: Quota | None) -> None:
        """Set ``namespace``'s limits to ``quota`` (None, or one with no limit: lift them all)."""
        q = t.namespace_quotas
        with self.db.tx(write=True) as conn:
            conn.execute(sa.delete(q).where(q.c.namespace == namespace))
            if quota is not None and not quota.empty:
                conn.execute(
                    sa.insert(q).values(
                        namespace=namespace,
                        max_queued=quota.max_queued,
                        max_topics=quota.max_topics,
                        max_payload_bytes=quota.max_payload_bytes,
                        updated_at=time.time(),
                    )
                )

    @retry_on_disconnect
    def quotas(self) -> dict[str, Quota]:
        """Every namespace's limits (namespaces without any are absent)."""
        q = t.namespace_quotas
        with self.db.tx(write=False) as conn:
            rows = conn.execute(
                sa.select(q.c.namespace, q.c.max_queued, q.c.max_topics, q.c.max_payload_bytes)
            ).all()
        out = {}
        for ns, queued, topics, size in rows:
            quota = Quota(
                max_queued=None if queued is None else int(queued),
                max_topics=None if topics is None else int(topics),
                max_payload_bytes=None if size is None else int(size),
            )
            if not quota.empty:
                out[str(ns)] = quota
        return out

    @retry_on_disconnect
    def count_queued(self, namespace: str, up_to: int) -> int:
        """How many invocations of ``namespace`` are queued and due, counted up to ``up_to`` at most
        (off the ``ix_invocations_queued_ns`` index: the cost is bounded by the quota, not the table)."""
        with self.db.tx(write=False) as conn:
            return count_queued_in(conn, namespace, up_to)

    @retry_on_disconnect
    def count_topics(self, namespace: str, up_to: int) -> int:
        """How many topics ``namespace`` made, counted up to ``up_to`` at most (``ix_topics_namespace``)."""
        tp = t.topics
        made = sa.select(sa.literal(1)).where(tp.c.namespace == namespace)
        with self.db.tx(write=False) as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(made.limit(up_to).subquery())
                ).scalar_one()
            )

    @retry_on_disconnect
    def topic_exists(self, name: str) -> bool:
        tp = t.topics
        with self.db.tx(write=False) as conn:
            return conn.execute(sa.select(tp.c.name).where(tp.c.name == name)).first() is not None

    def record_payload(self, namespace: str, key: str, size: int, *, keep_s: float) -> None:
        """Count a presigned upload of ``size`` bytes at ``key`` against ``namespace``; forget the
        namespace's presigns older than ``keep_s`` seconds (past the payload retention)."""
        u = t.payload_usage
        now = time.time()
        with self.db.tx(write=True) as conn:
            conn.execute(sa.delete(u).where(u.c.namespace == namespace, u.c.created_at < now - keep_s))
            conn.execute(
                self._insert(u)
                .values(key=key, namespace=namespace, size=size, created_at=now)
                .on_conflict_do_update(
                    index_elements=[u.c.key], set_={"namespace": namespace, "size": size, "created_at": now}
                )
            )

    @retry_on_disconnect
    def payload_bytes(self, namespace: str, since: float) -> int:
        """The bytes presigned for upload in ``namespace`` since ``since`` (epoch seconds)."""
        u = t.payload_usage
        with self.db.tx(write=False) as conn:
            got = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(u.c.size), 0)).where(
                    u.c.namespace == namespace, u.c.created_at >= since
                )
            ).scalar_one()
        return int(got)
