"""Claim scheduling: which queued invocations a claim takes, and in what order.

The order is priority desc, submitted_at asc, invocation_id asc, read straight off an index of
queued rows (``ix_invocations_queued``), so a claim costs the same at any backlog. The statement
built here is run by ``InvocationStore._claim_in`` (invocations.py) inside the claim transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from . import schema as t

_inv = t.invocations
_claim_order = (_inv.c.priority.desc(), _inv.c.submitted_at.asc(), _inv.c.invocation_id.asc())
# Claims from up to this many queues merge each queue's best rows (see claim_statement).
MERGED_QUEUES_MAX = 16


@functools.cache
def claim_statement(n_queues: int, by_namespace: bool = False) -> Any:
    """The claim of up to ``:limit`` queued invocations of ``n_queues`` queues, best first.

    Parameters: ``q0`` .. ``q<n-1>`` (distinct queue names), ``limit``, ``worker``, ``now``,
    ``lease``; past ``MERGED_QUEUES_MAX`` queues, ``queues`` (a list) instead of ``q<i>``; with
    ``by_namespace``, ``b_namespace``: only that namespace's invocations, read off
    ``ix_invocations_queued_ns`` (namespace, queue, then the same order) the same way.

    The pick reads ``ix_invocations_queued`` (queue, priority DESC, submitted_at, invocation_id,
    over queued rows only), which yields one queue's rows in claim order: one queue is one index
    range read up to ``limit`` rows, no sort. Several queues take the first ``limit`` rows of each
    (each locked ``FOR UPDATE SKIP LOCKED`` on PostgreSQL) and keep the best ``limit`` of those, so
    the sort is over at most ``n_queues * limit`` rows whatever the backlog; the rows picked but
    not kept stay locked until the claim commits, and a concurrent claim skips them meanwhile.
    Past ``MERGED_QUEUES_MAX`` queues (SQLite caps a compound SELECT at 500 terms) the pick reads
    every queued row of those queues and sorts them.

    The update finds the picked rows by primary key only: no ``state`` test there, which SQLite
    would plan as a scan of queued rows by a state index. None is needed: on SQLite the statement
    runs under the write lock, and on PostgreSQL every picked row is locked, re-checked as queued,
    until the transaction ends.
    """
    B = sa.bindparam
    # Literals, not bind parameters, where the plan depends on them: a generic plan (PostgreSQL
    # prepares a statement run often, and may keep one plan for any values) can then prove the
    # partial index's predicate, and knows how many rows the claim takes (for an unknown LIMIT it
    # assumes a tenth of the table, and would update them by a scan). ``limit`` is rendered into
    # the SQL at execution: one statement text per limit in use.
    queued: Any = sa.and_(_inv.c.state == sa.literal_column("'queued'"), _inv.c.not_before.is_(None))
    if by_namespace:
        queued = sa.and_(queued, _inv.c.namespace == B("b_namespace"))
    limit = B("limit", type_=sa.Integer, literal_execute=True)
    pick: Any
    if n_queues > MERGED_QUEUES_MAX:
        pick = sa.select(_inv.c.invocation_id).where(queued, _inv.c.queue.in_(B("queues", expanding=True)))
    elif n_queues == 1:
        pick = sa.select(_inv.c.invocation_id).where(queued, _inv.c.queue == B("q0"))
    else:
        cols = (_inv.c.invocation_id, _inv.c.priority, _inv.c.submitted_at)
        firsts = [
            sa.select(*cols)
            .where(queued, _inv.c.queue == B(f"q{i}"))
            .order_by(*_claim_order)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .subquery(f"q{i}")
            for i in range(n_queues)
        ]
        merged = sa.union_all(*(sa.select(*sub.c) for sub in firsts))
        best = merged.selected_columns
        pick = merged.order_by(best.priority.desc(), best.submitted_at.asc(), best.invocation_id.asc())
    if n_queues == 1 or n_queues > MERGED_QUEUES_MAX:
        pick = pick.order_by(*_claim_order).with_for_update(skip_locked=True)
    picked = (
        pick.limit(limit)
        .cte("picked")
        .prefix_with("MATERIALIZED")  # evaluated once: a bare IN (subquery) may run it per row
    )
    return (
        sa.update(_inv)
        .where(_inv.c.invocation_id.in_(sa.select(picked.c.invocation_id)))
        .values(
            state="running",
            worker_id=B("worker"),
            attempt=_inv.c.attempt + 1,
            started_at=B("now"),
            lease_expires_at=B("lease"),
        )
        .returning(*_inv.c)
    )


def claim_params(
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    now: float,
    lease_s: float,
    namespace: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The claim statement for ``queues`` (of ``namespace`` when given; see
    :func:`claim_statement`) and its parameters."""
    names = sorted(set(queues))  # a queue named twice must not be picked twice
    params: dict[str, Any] = {"limit": int(limit), "worker": worker_id, "now": now, "lease": now + lease_s}
    if len(names) > MERGED_QUEUES_MAX:
        params["queues"] = names
    else:
        params.update((f"q{i}", name) for i, name in enumerate(names))
    if namespace is not None:
        params["b_namespace"] = namespace
    return claim_statement(len(names), namespace is not None), params
