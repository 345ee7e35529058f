"""Read-only views of the store for operators: queues, workers, invocations, journal sizes.

One of ``SqlStore``'s concerns (see base.py); the contract is ``api.Listing``. Nothing here
writes. The queries:

- ``queue_stats`` groups invocations by (queue, state), one pass over the table (the queued rows'
  oldest ``submitted_at`` comes with it);
- ``list_invocations`` walks the primary key backwards (ids are ULIDs minted at submit, so newest
  first) with keyset paging: the cursor is the last id of the previous page;
- ``frame_stats`` reads one owner's range of the ``frames`` primary key.

Workers carry their queues and namespace in the JSON ``info`` of their latest register; the
namespace is matched in SQL (``info ->> 'namespace'``), the queues in Python.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from dreamlake.lakeshore.states import STATES

from . import schema as t
from .api import (
    LIST_LIMIT_MAX,
    LIVE_WINDOW_S,
    FrameStats,
    Invocation,
    InvocationPage,
    QueueStats,
    WorkerPage,
    WorkerRow,
)
from .base import StoreBase
from .invocations import invocation_from

_inv = t.invocations
# Every column but the two blobs: a listing never needs the arguments or the result.
_SUMMARY_COLS = tuple(c for c in _inv.c if c.name not in ("args_blob", "result_blob"))


def _summary(r: Any) -> Invocation:
    return invocation_from(r._mapping)  # the blob-less columns: no arguments, no result


def _worker_queues(info: Any) -> list[str]:
    queues = info.get("queues") if isinstance(info, dict) else None
    return [q for q in queues if isinstance(q, str)] if isinstance(queues, list) else []


def _visible_to(namespace: str | None) -> Any:
    """Workers a caller of ``namespace`` sees: its own and the shared ones (bound to none)."""
    if namespace is None:
        return sa.true()
    bound = t.workers.c.info["namespace"].as_string()
    return sa.or_(bound.is_(None), bound == namespace)


class ListingStore(StoreBase):
    def queue_stats(
        self, namespace: str | None = None, *, live_within: float = LIVE_WINDOW_S
    ) -> list[QueueStats]:
        counts: dict[str, dict[str, int]] = {}
        oldest: dict[str, float] = {}
        stmt = sa.select(
            _inv.c.queue, _inv.c.state, sa.func.count(), sa.func.min(_inv.c.submitted_at)
        ).group_by(_inv.c.queue, _inv.c.state)
        if namespace is not None:
            stmt = stmt.where(_inv.c.namespace == namespace)
        with self.db.tx(write=False) as conn:
            rows = conn.execute(stmt).all()
            names: Iterable[str] = ()
            if namespace is None:
                names = conn.execute(sa.select(t.queues.c.name)).scalars().all()
            live = self._live_infos(conn, namespace, live_within)
        for queue, state, n, first in rows:
            counts.setdefault(queue, {})[state] = int(n)
            if state == "queued" and first is not None:
                oldest[queue] = float(first)
        serving: dict[str, int] = {}
        for info in live:
            for q in set(_worker_queues(info)):
                serving[q] = serving.get(q, 0) + 1
        out = []
        for name in sorted({*counts, *names, *serving}):
            by_state = {s: counts.get(name, {}).get(s, 0) for s in STATES}
            for s, n in counts.get(name, {}).items():  # a state this module does not know yet
                by_state.setdefault(s, n)
            out.append(QueueStats(name, by_state, oldest.get(name), serving.get(name, 0)))
        return out

    def _live_infos(self, conn: Any, namespace: str | None, live_within: float) -> list[Any]:
        w = t.workers
        cutoff = time.time() - live_within
        stmt = sa.select(w.c.info).where(
            w.c.last_seen >= cutoff, w.c.stopped_at.is_(None), _visible_to(namespace)
        )
        return list(conn.execute(stmt).scalars())

    def live_queues(self, live_within: float = LIVE_WINDOW_S) -> dict[str, int]:
        with self.db.tx(write=False) as conn:
            infos = self._live_infos(conn, None, live_within)
        serving: dict[str, int] = {}
        for info in infos:
            for q in set(_worker_queues(info)):
                serving[q] = serving.get(q, 0) + 1
        return serving

    def live_workers_of(
        self, queue: str, live_within: float = LIVE_WINDOW_S, *, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        """The registered infos (labels, capacity) of the live workers serving ``queue`` that may
        claim the work of ``namespace`` (its own and the shared ones; None: all)."""
        with self.db.tx(write=False) as conn:
            infos = self._live_infos(conn, namespace, live_within)
        return [i for i in infos if isinstance(i, dict) and queue in _worker_queues(i)]

    def count_workers(self, live_within: float | None = LIVE_WINDOW_S) -> int:
        w = t.workers
        stmt = sa.select(sa.func.count()).select_from(w)
        if live_within is not None:
            stmt = stmt.where(w.c.last_seen >= time.time() - live_within, w.c.stopped_at.is_(None))
        with self.db.tx(write=False) as conn:
            return int(conn.execute(stmt).scalar_one())

    def list_workers(
        self,
        namespace: str | None = None,
        *,
        live_within: float | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> WorkerPage:
        w, e = t.workers, t.exec_jobs
        limit = max(1, min(int(limit), LIST_LIMIT_MAX))
        stmt = (
            sa.select(
                w.c.worker_id, w.c.info, w.c.registered_at, w.c.last_seen, w.c.stopped_at, w.c.free_gpus
            )
            .where(_visible_to(namespace))
            .order_by(w.c.worker_id)
            .limit(limit + 1)
        )
        if cursor is not None:
            stmt = stmt.where(w.c.worker_id > cursor)
        if live_within is not None:
            stmt = stmt.where(w.c.last_seen >= time.time() - live_within, w.c.stopped_at.is_(None))
        with self.db.tx(write=False) as conn:
            rows = conn.execute(stmt).all()
            more = len(rows) > limit
            rows = rows[:limit]
            ids = [r.worker_id for r in rows]
            busy: dict[str, int] = {}
            if ids:
                for worker, n in conn.execute(
                    sa.select(_inv.c.worker_id, sa.func.count())
                    .where(_inv.c.state == "running", _inv.c.worker_id.in_(ids))
                    .group_by(_inv.c.worker_id)
                ):
                    busy[worker] = busy.get(worker, 0) + int(n)
                for worker, n in conn.execute(
                    sa.select(e.c.claimed_by, sa.func.count())
                    .where(e.c.state == "running", e.c.claimed_by.in_(ids))
                    .group_by(e.c.claimed_by)
                ):
                    busy[worker] = busy.get(worker, 0) + int(n)
        workers = [
            WorkerRow(
                worker_id=r.worker_id,
                info=dict(r.info) if isinstance(r.info, dict) else {},
                registered_at=float(r.registered_at),
                last_seen=float(r.last_seen),
                busy=busy.get(r.worker_id, 0),
                stopped_at=None if r.stopped_at is None else float(r.stopped_at),
                free_gpus=r.free_gpus,
            )
            for r in rows
        ]
        return WorkerPage(workers, workers[-1].worker_id if more and workers else None)

    def list_invocations(
        self,
        namespace: str | None = None,
        *,
        queue: str | None = None,
        states: list[str] | None = None,
        since: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
        sweep: str | None = None,
    ) -> InvocationPage:
        limit = max(1, min(int(limit), LIST_LIMIT_MAX))
        stmt = sa.select(*_SUMMARY_COLS).order_by(_inv.c.invocation_id.desc()).limit(limit + 1)
        if namespace is not None:
            stmt = stmt.where(_inv.c.namespace == namespace)
        if queue is not None:
            stmt = stmt.where(_inv.c.queue == queue)
        if states:
            stmt = stmt.where(_inv.c.state.in_(list(states)))
        if since is not None:
            stmt = stmt.where(_inv.c.submitted_at >= since)
        if cursor is not None:
            stmt = stmt.where(_inv.c.invocation_id < cursor)
        if sweep is not None:  # the calls of one map (store/activity.py)
            from .activity import sweep_of

            stmt = stmt.where(sweep_of(sweep))
        with self.db.tx(write=False) as conn:
            rows = conn.execute(stmt).all()
        page = [_summary(r) for r in rows[:limit]]
        more = len(rows) > limit
        return InvocationPage(page, page[-1].invocation_id if more and page else None)

    def frame_stats(self, owner_id: str) -> FrameStats:
        f = t.frames
        stmt = sa.select(
            sa.func.count(), sa.func.max(f.c.seq), sa.func.min(f.c.created_at), sa.func.max(f.c.created_at)
        ).where(f.c.owner_id == owner_id)
        with self.db.tx(write=False) as conn:
            n, last, first_at, last_at = conn.execute(stmt).one()
        return FrameStats(
            count=int(n),
            last_seq=int(last) if last is not None else None,
            first_at=float(first_at) if first_at is not None else None,
            last_at=float(last_at) if last_at is not None else None,
        )
