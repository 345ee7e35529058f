"""Invocations: submit, read, cancel, claim, ack, and their leases.

State changes are single conditional ``UPDATE ... RETURNING`` statements, so a refusal never
half-applies. Choices the seed leaves open, made here:

- an unknown ``parent_invocation_id`` is taken as the root (``root_invocation_id = parent``);
- a running invocation whose lease lapses after a cancel was requested becomes ``cancelled``
  instead of being requeued.

Claims (see docs/architecture.md and :func:`claim_statement`): the order is priority desc,
submitted_at asc, invocation_id asc, read straight off an index of queued rows, so a claim costs the
same at any backlog; ``FOR UPDATE SKIP LOCKED`` (ignored by SQLite, where ``BEGIN IMMEDIATE``
serialises writers) in a ``MATERIALIZED`` CTE picks the rows, and the claim updates them by primary
key. ``_renew_in`` and ``_expire_in`` run inside the heartbeat and ``expire_leases`` transactions
of sql.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from dreamlake.lakeshore.errors import PlaneError

from . import schema as t
from . import values
from .api import (
    ACK_STATES,
    ANOTHER_WORKER,
    DEFAULT_LEASE_S,
    DEFAULT_NAMESPACE,
    SUPERSEDED,
    UNKNOWN,
    AckResult,
    Invocation,
    SubmitRequest,
    SubmitResult,
)
from .base import StoreBase, dialect_insert
from .engine import Database
from .notify import Notifier
from .workers import queue_command

CANCEL_REASON = "cancelled by producer"
LEASE_EXPIRED = {
    "type": "LeaseExpired",
    "message": "the worker stopped renewing the lease on the last allowed attempt (run_config.max_attempts)",
}

_inv = t.invocations
_claim_order = (_inv.c.priority.desc(), _inv.c.submitted_at.asc(), _inv.c.invocation_id.asc())
# Claims from up to this many queues merge each queue's best rows (see claim_statement).
MERGED_QUEUES_MAX = 16
_INV_COLS = tuple(c.name for c in _inv.c)


def row_to_invocation(r: Row[Any]) -> Invocation:
    """An Invocation from a row holding every invocations column (``select(_inv)`` / returning)."""
    m = dict(zip(_INV_COLS, r, strict=True))
    result_blob = m["result_blob"]
    return Invocation(
        invocation_id=m["invocation_id"],
        queue=m["queue"],
        state=m["state"],
        priority=int(m["priority"]),
        function=m["function"],
        args_blob=bytes(m["args_blob"]),
        run_config=m["run_config"],
        code_context=m["code_context"],
        namespace=m["namespace"],
        attempt=m["attempt"],
        max_attempts=m["max_attempts"],
        parent_invocation_id=m["parent_invocation_id"],
        root_invocation_id=m["root_invocation_id"],
        idempotency_key=m["idempotency_key"],
        worker_id=m["worker_id"],
        submitted_at=m["submitted_at"],
        started_at=m["started_at"],
        finished_at=m["finished_at"],
        lease_expires_at=m["lease_expires_at"],
        result_blob=bytes(result_blob) if result_blob is not None else None,
        error=m["error"],
        cancel_requested=bool(m["cancel_requested"]),
    )


_SUBMIT_COLS = (
    "invocation_id",
    "queue",
    "state",
    "priority",
    "function_key",
    "function",
    "args_blob",
    "run_config",
    "code_context",
    "namespace",
    "content_hash",
    "attempt",
    "max_attempts",
    "parent_invocation_id",
    "root_invocation_id",
    "idempotency_key",
    "submitted_at",
    "cancel_requested",
)


class _Statements:
    """The hot paths' statements, built once per dialect with bind parameters.

    Reusing one statement object lets SQLAlchemy memoize its cache key and reuse the compiled SQL
    from the engine's compiled cache, so a call pays for executing, not for building and compiling.
    Lists (queues of a claim, leases of a heartbeat) are ``expanding`` parameters.
    """

    def __init__(self, dialect: str) -> None:
        B = sa.bindparam
        self.insert_queue = (
            dialect_insert(dialect, t.queues)
            .values(name=B("queue"), created_at=B("now"))
            .on_conflict_do_nothing()
        )
        self.insert_function = (
            dialect_insert(dialect, t.functions)
            .values(function_key=B("fkey"), function=B("function", type_=sa.JSON), created_at=B("now"))
            .on_conflict_do_nothing()
        )
        self.insert_invocation = (
            dialect_insert(dialect, _inv)
            .values({col: B(col, type_=_inv.c[col].type) for col in _SUBMIT_COLS})
            .on_conflict_do_nothing()
            .returning(_inv.c.invocation_id)
        )
        self.root_of = sa.select(_inv.c.root_invocation_id).where(_inv.c.invocation_id == B("id"))
        self.same_id = sa.select(_inv.c.queue, _inv.c.content_hash).where(_inv.c.invocation_id == B("id"))
        self.same_key = sa.select(_inv.c.invocation_id).where(
            _inv.c.namespace == B("namespace"), _inv.c.queue == B("queue"), _inv.c.idempotency_key == B("key")
        )
        self.get = sa.select(_inv).where(_inv.c.invocation_id == B("id"))
        self.ack: dict[tuple[bool, bool], Any] = {}
        for by_attempt in (False, True):
            for by_worker in (False, True):
                conds = [_inv.c.invocation_id == B("id"), _inv.c.state == "running"]
                if by_attempt:
                    conds.append(_inv.c.attempt == B("b_attempt"))
                if by_worker:
                    conds.append(_inv.c.worker_id == B("worker"))
                self.ack[by_attempt, by_worker] = (
                    sa.update(_inv)
                    .where(*conds)
                    .values(
                        state=B("b_state"),
                        finished_at=B("now"),
                        result_blob=B("blob", type_=_inv.c.result_blob.type),
                        error=B("b_error", type_=_inv.c.error.type),
                        lease_expires_at=None,
                    )
                    .returning(_inv.c.invocation_id)
                )
        self.renew = (
            sa.update(_inv)
            .where(
                sa.tuple_(_inv.c.invocation_id, _inv.c.attempt).in_(B("pairs", expanding=True)),
                _inv.c.state == "running",
                _inv.c.worker_id == B("worker"),
            )
            .values(lease_expires_at=B("lease"))
            .returning(_inv.c.invocation_id)
        )


@functools.cache
def _statements(dialect: str) -> _Statements:
    return _Statements(dialect)


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
    queued: Any = _inv.c.state == sa.literal_column("'queued'")
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


class Lease(Protocol):
    """What a lease check reads of an invocation (an :class:`Invocation`, or a row of those columns)."""

    invocation_id: str
    state: str
    attempt: int
    worker_id: str | None


def lease_refusal(inv: Lease, attempt: int | None, worker_id: str | None) -> tuple[int, str] | None:
    """Why a report (ack, frame) from ``worker_id`` on ``attempt`` of ``inv`` is refused, as
    ``(status, reason)``, or None when that worker holds (or, once finished, held) that attempt:
    a later attempt (SUPERSEDED), a lapsed lease awaiting its next claim (SUPERSEDED), or the
    current attempt held by another worker (ANOTHER_WORKER)."""
    inv_id = inv.invocation_id
    if attempt is not None and attempt != inv.attempt:
        return SUPERSEDED, f"attempt {attempt} of {inv_id} was superseded by attempt {inv.attempt}"
    if worker_id is not None and worker_id != inv.worker_id:
        if inv.worker_id is None:
            return SUPERSEDED, f"the lease of {inv_id} lapsed ({inv.state}); the worker no longer holds it"
        return ANOTHER_WORKER, f"attempt {inv.attempt} of {inv_id} is held by another worker, not {worker_id}"
    return None


class InvocationStore(StoreBase):
    """Invocations from submit to their outcome."""

    def __init__(self, db: Database, notifier: Notifier) -> None:
        super().__init__(db, notifier)
        self._inv_st = _statements(db.dialect)

    # -- producer side ---------------------------------------------------------------------------

    def submit(self, req: SubmitRequest) -> SubmitResult:
        st = self._inv_st
        queue = req.queue or str(req.run_config.get("queue") or "") or "default"
        run_config = values.json_safe({**req.run_config, "queue": queue}, "run_config")
        function = values.json_safe(req.function, "function")
        code_context = values.json_safe(req.code_context or {}, "code_context")
        key = values.idempotency_key(run_config)
        chash = values.content_hash(req, queue, run_config)
        fkey = values.function_key(function)
        now = time.time()
        with self.db.tx(write=True) as conn:
            conn.execute(st.insert_queue, {"queue": queue, "now": now})
            conn.execute(st.insert_function, {"fkey": fkey, "function": function, "now": now})
            root = None
            if req.parent_invocation_id:
                parent_root = conn.execute(st.root_of, {"id": req.parent_invocation_id}).scalar_one_or_none()
                root = parent_root or req.parent_invocation_id
            row = {
                "invocation_id": req.invocation_id,
                "queue": queue,
                "state": "queued",
                "priority": values.normalize_priority(run_config.get("priority")),
                "function_key": fkey,
                "function": function,
                "args_blob": bytes(req.args_blob),
                "run_config": run_config,
                "code_context": code_context,
                "namespace": req.namespace or DEFAULT_NAMESPACE,
                "content_hash": chash,
                "attempt": 0,
                "max_attempts": values.normalize_max_attempts(run_config.get("max_attempts")),
                "parent_invocation_id": req.parent_invocation_id,
                "root_invocation_id": root,
                "idempotency_key": key,
                "submitted_at": now,
                "cancel_requested": False,
            }
            # Insert first: ON CONFLICT DO NOTHING covers the id and the (queue, key) unique index,
            # so only a conflict needs the lookups that tell a duplicate from a clash.
            if conn.execute(st.insert_invocation, row).first() is None:
                existing = self._existing(conn, req, chash, queue, key)
                if existing is None:
                    raise PlaneError(f"submit of {req.invocation_id} conflicted; retry it", status=409)
                return existing
        self._notify(f"queue:{queue}", f"inv:{req.invocation_id}")
        return SubmitResult(invocation_id=req.invocation_id, queue=queue)

    def _existing(
        self, conn: Connection, req: SubmitRequest, chash: str, queue: str, key: str | None
    ) -> SubmitResult | None:
        invocation_id = req.invocation_id
        same = conn.execute(self._inv_st.same_id, {"id": invocation_id}).first()
        if same is not None:
            if same.content_hash != chash:
                raise PlaneError(
                    f"invocation {invocation_id} already exists with different content; "
                    "submit new work under a new invocation_id",
                    status=409,
                )
            return SubmitResult(invocation_id=invocation_id, queue=same.queue, duplicate=True)
        if key is not None:
            params = {"namespace": req.namespace or DEFAULT_NAMESPACE, "queue": queue, "key": key}
            other = conn.execute(self._inv_st.same_key, params).scalar_one_or_none()
            if other is not None:
                return SubmitResult(invocation_id=other, queue=queue, duplicate=True)
        return None

    def get(self, invocation_id: str) -> Invocation | None:
        with self.db.tx(write=False) as conn:
            r = conn.execute(self._inv_st.get, {"id": invocation_id}).first()
        return row_to_invocation(r) if r is not None else None

    # -- lineage: parent_invocation_id / root_invocation_id ----------------------------------------

    def lineage(self, invocation_id: str, limit: int = 64) -> list[str]:
        """``invocation_id`` and its ancestors, nearest first (at most ``limit`` ids)."""
        out: list[str] = []
        current: str | None = invocation_id
        with self.db.tx(write=False) as conn:
            while current is not None and len(out) < limit and current not in out:
                out.append(current)
                current = conn.execute(
                    sa.select(_inv.c.parent_invocation_id).where(_inv.c.invocation_id == current)
                ).scalar_one_or_none()
        return out

    def descendants(self, invocation_id: str) -> list[tuple[str, str | None, str]]:
        """``(invocation_id, parent_invocation_id, state)`` of every descendant, breadth first.

        Every descendant shares the tree's root (``root_invocation_id``, indexed): one read of that
        tree, walked from ``invocation_id`` down its parent links."""
        with self.db.tx(write=False) as conn:
            root = conn.execute(
                sa.select(_inv.c.root_invocation_id).where(_inv.c.invocation_id == invocation_id)
            ).first()
            if root is None:
                return []
            rows = conn.execute(
                sa.select(_inv.c.invocation_id, _inv.c.parent_invocation_id, _inv.c.state)
                .where(_inv.c.root_invocation_id == (root[0] or invocation_id))
                .order_by(_inv.c.invocation_id)
            ).all()
        by_parent: dict[str, list[tuple[str, str | None, str]]] = {}
        for r in rows:
            by_parent.setdefault(r.parent_invocation_id, []).append(
                (r.invocation_id, r.parent_invocation_id, r.state)
            )
        out: list[tuple[str, str | None, str]] = []
        frontier = [invocation_id]
        while frontier:
            below = [row for parent in frontier for row in by_parent.get(parent, [])]
            out.extend(below)
            frontier = [row[0] for row in below]
        return out

    def cancel(self, invocation_id: str) -> str | None:
        now = time.time()
        notify: list[str] = []
        with self.db.tx(write=True) as conn:
            if conn.execute(
                sa.update(_inv)
                .where(_inv.c.invocation_id == invocation_id, _inv.c.state == "queued")
                .values(state="cancelled", finished_at=now, cancel_requested=True)
                .returning(_inv.c.invocation_id)
            ).first():
                state: str | None = "cancelled"
                notify.append(f"inv:{invocation_id}")
            else:
                worker = conn.execute(
                    sa.update(_inv)
                    .where(
                        _inv.c.invocation_id == invocation_id,
                        _inv.c.state == "running",
                        _inv.c.cancel_requested == sa.false(),
                    )
                    .values(cancel_requested=True)
                    .returning(_inv.c.worker_id)
                ).scalar_one_or_none()
                if worker is not None:
                    body = {"invocation_id": invocation_id, "reason": CANCEL_REASON}
                    queue_command(conn, worker, "cancel", body, now)
                    notify += [f"worker:{worker}", f"inv:{invocation_id}"]
                state = conn.execute(
                    sa.select(_inv.c.state).where(_inv.c.invocation_id == invocation_id)
                ).scalar_one_or_none()
        self._notify(*notify)
        return state

    # -- daemon side -----------------------------------------------------------------------------

    def claim(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        namespace: str | None = None,
    ) -> list[Invocation]:
        if not queues or limit < 1:
            return []
        with self.db.tx(write=True) as conn:
            got = self._claim_in(conn, worker_id, queues, limit, lease_s, time.time(), namespace)
        self._notify(*(f"inv:{i.invocation_id}" for i in got))
        return got

    def _claim_in(
        self,
        conn: Connection,
        worker_id: str,
        queues: list[str],
        limit: int,
        lease_s: float,
        now: float,
        namespace: str | None = None,
    ) -> list[Invocation]:
        stmt, params = claim_params(queues, limit, worker_id, now, lease_s, namespace)
        rows = conn.execute(stmt, params).fetchall()
        return sorted(
            (row_to_invocation(r) for r in rows),
            key=lambda i: (-i.priority, i.submitted_at, i.invocation_id),
        )

    def ack(
        self,
        invocation_id: str,
        state: str,
        *,
        attempt: int | None,
        worker_id: str | None,
        result_blob: bytes | None,
        error: dict[str, Any] | None,
    ) -> AckResult:
        if state not in ACK_STATES:
            raise PlaneError(
                f"cannot ack state {state!r}: use one of {', '.join(sorted(ACK_STATES))}", status=400
            )
        if error is not None and not isinstance(error, dict):
            error = {"type": "DaemonError", "message": str(error)}
        if error is not None:
            error = values.json_safe(error, "error")
        blob = bytes(result_blob) if result_blob else None
        params: dict[str, Any] = {
            "id": invocation_id,
            "b_state": state,
            "now": time.time(),
            "blob": blob,
            "b_error": error,
        }
        if attempt is not None:
            params["b_attempt"] = attempt
        if worker_id is not None:
            params["worker"] = worker_id
        row: Row[Any] | None = None
        with self.db.tx(write=True) as conn:
            done = conn.execute(self._inv_st.ack[attempt is not None, worker_id is not None], params).first()
            if done is None:
                row = conn.execute(self._inv_st.get, {"id": invocation_id}).first()
        if done is not None:
            self._notify(f"inv:{invocation_id}")
            return AckResult(ok=True, state=state)
        if row is None:
            return AckResult(ok=False, reason=f"unknown invocation {invocation_id}", status=UNKNOWN)
        inv = row_to_invocation(row)
        refused = lease_refusal(inv, attempt, worker_id)
        if refused is not None:
            return AckResult(ok=False, state=inv.state, reason=refused[1], status=refused[0])
        if inv.state == state and (inv.result_blob or None) == blob and inv.error == error:
            return AckResult(ok=True, duplicate=True, state=inv.state)
        return AckResult(
            ok=False, state=inv.state, reason=f"{invocation_id} is {inv.state}, not running; outcome refused"
        )

    def _renew_in(
        self, conn: Connection, worker_id: str, running: Sequence[tuple[str, int]], lease: float
    ) -> set[str]:
        """Renew the worker's leases of ``running`` ``(invocation_id, attempt)`` pairs; the ids it
        still holds (the others were lost: superseded, expired or cancelled)."""
        if not running:
            return set()
        params = {"pairs": sorted(running), "worker": worker_id, "lease": lease}
        return set(conn.execute(self._inv_st.renew, params).scalars())

    def _expire_in(
        self, conn: Connection, now: float
    ) -> tuple[list[Row[Any]], list[Row[Any]], list[Row[Any]]]:
        """End the running invocations whose lease lapsed: cancelled when a cancel was requested,
        else requeued while attempts remain, else failed with ``LEASE_EXPIRED``. Returns the
        ``(invocation_id,)`` rows cancelled, the ``(invocation_id, queue)`` rows requeued and the
        ``(invocation_id,)`` rows failed."""
        lapsed = (_inv.c.state == "running", _inv.c.lease_expires_at < now)
        gone = {"worker_id": None, "lease_expires_at": None}
        cancelled = conn.execute(
            sa.update(_inv)
            .where(*lapsed, _inv.c.cancel_requested == sa.true())
            .values(state="cancelled", finished_at=now, **gone)
            .returning(_inv.c.invocation_id)
        ).fetchall()
        requeued = conn.execute(
            sa.update(_inv)
            .where(*lapsed, _inv.c.attempt < _inv.c.max_attempts)
            .values(state="queued", started_at=None, **gone)
            .returning(_inv.c.invocation_id, _inv.c.queue)
        ).fetchall()
        failed = conn.execute(
            sa.update(_inv)
            .where(*lapsed)
            .values(state="failed", finished_at=now, error=LEASE_EXPIRED, lease_expires_at=None)
            .returning(_inv.c.invocation_id)
        ).fetchall()
        return list(cancelled), list(requeued), list(failed)
