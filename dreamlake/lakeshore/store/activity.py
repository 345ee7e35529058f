"""What the dashboard charts and groups: the last hour's activity, and sweeps (a ``map``).

One of ``SqlStore``'s concerns (see base.py), read-only:

- ``activity(namespace, since)``: the submit, start and finish times of every invocation that was
  still waiting or running at ``since`` or came later (at most ``ACTIVITY_ROWS``, newest first),
  from which ``server/ui/charts.py`` draws queue depth and throughput per minute. Nothing is kept
  beside the invocations table: what retention removed is gone from the charts too.
- ``sweeps(namespace, since)``: the calls of one ``map`` carry ``run_config.sweep`` (a ULID the SDK
  mints per map); each sweep submitted since ``since`` with its call count by state, its first
  submit and its queue (at most ``SWEEPS_SHOWN``, newest first). ``sweep_of(...)`` is the filter
  of one sweep's calls for the invocation list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from . import schema as t
from .base import StoreBase

ACTIVITY_ROWS = 100_000  # rows the charts read at most (a busier hour shows its newest part)
SWEEPS_SHOWN = 20

_inv = t.invocations


def sweep_of(sweep: str) -> Any:
    """The SQL condition of the calls of ``sweep`` (``run_config.sweep``)."""
    return _inv.c.run_config["sweep"].as_string() == sweep


@dataclass(frozen=True)
class Activity:
    queue: str
    state: str
    submitted_at: float
    started_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class Sweep:
    sweep: str
    queue: str
    counts: dict[str, int]  # state -> calls
    first_submitted_at: float

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class ActivityStore(StoreBase):
    def activity(self, namespace: str | None, since: float) -> list[Activity]:
        live = sa.or_(_inv.c.finished_at.is_(None), _inv.c.finished_at >= since)
        stmt = (
            sa.select(_inv.c.queue, _inv.c.state, _inv.c.submitted_at, _inv.c.started_at, _inv.c.finished_at)
            .where(live)
            .order_by(_inv.c.submitted_at.desc())
            .limit(ACTIVITY_ROWS)
        )
        if namespace is not None:
            stmt = stmt.where(_inv.c.namespace == namespace)
        with self.db.tx(write=False) as conn:
            rows = conn.execute(stmt).all()
        return [
            Activity(
                r.queue,
                r.state,
                float(r.submitted_at),
                None if r.started_at is None else float(r.started_at),
                None if r.finished_at is None else float(r.finished_at),
            )
            for r in rows
        ]

    def sweeps(self, namespace: str | None, since: float, limit: int = SWEEPS_SHOWN) -> list[Sweep]:
        sweep = _inv.c.run_config["sweep"].as_string()
        recent = (
            sa.select(sweep.label("sweep"), sa.func.min(_inv.c.submitted_at).label("first"))
            .where(_inv.c.submitted_at >= since, sweep.is_not(None))
            .group_by(sweep)
            .order_by(sa.func.min(_inv.c.submitted_at).desc())
            .limit(limit)
        )
        if namespace is not None:
            recent = recent.where(_inv.c.namespace == namespace)
        with self.db.tx(write=False) as conn:
            found = conn.execute(recent).all()
            if not found:
                return []
            names = [r.sweep for r in found]
            counts = sa.select(sweep, _inv.c.queue, _inv.c.state, sa.func.count()).where(sweep.in_(names))
            if namespace is not None:
                counts = counts.where(_inv.c.namespace == namespace)
            rows = conn.execute(counts.group_by(sweep, _inv.c.queue, _inv.c.state)).all()
        by: dict[str, dict[str, int]] = {}
        queue_of: dict[str, str] = {}
        for name, queue, state, n in rows:
            by.setdefault(name, {})[state] = by.get(name, {}).get(state, 0) + int(n)
            queue_of.setdefault(name, queue)
        return [Sweep(r.sweep, queue_of.get(r.sweep, ""), by.get(r.sweep, {}), float(r.first)) for r in found]
