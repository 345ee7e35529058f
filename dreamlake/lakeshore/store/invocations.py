"""Invocations: submit, read, cancel, claim, ack, and their leases.

State changes are single conditional ``UPDATE ... RETURNING`` statements, so a refusal never
half-applies. A submit and an ack are checked first (``_prepare_submit``, ``_prepare_ack``), then
applied in the caller's transaction (``_submit_many_in``: many submits, one multi-row insert;
``_ack_in``), which lets the group commit of sql.py apply many in one transaction. Choices the seed leaves open, made here:

- an unknown ``parent_invocation_id`` is taken as the root (``root_invocation_id = parent``);
- a running invocation whose lease lapses after a cancel was requested becomes ``cancelled``
  instead of being requeued.

Claims (see docs/architecture.md and :func:`claims.claim_statement`): the order is priority desc,
submitted_at asc, invocation_id asc, read straight off an index of queued rows, so a claim costs the
same at any backlog; ``FOR UPDATE SKIP LOCKED`` (ignored by SQLite, where ``BEGIN IMMEDIATE``
serialises writers) in a ``MATERIALIZED`` CTE picks the rows, and the claim updates them by primary
key. ``_renew_in`` and ``_expire_in`` run inside the heartbeat and ``expire_leases`` transactions
of sql.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.states import PREEMPTED

from . import retry, values
from . import schema as t
from .api import (
    ACK_STATES,
    ANOTHER_WORKER,
    DEFAULT_LEASE_S,
    DEFAULT_NAMESPACE,
    SUPERSEDED,
    UNKNOWN,
    AckRequest,
    AckResult,
    Invocation,
    SubmitRequest,
    SubmitResult,
)
from .base import StoreBase, dialect_insert
from .claims import Placer, claim_params, head_params, key_limit, pick_statement, take_statement
from .direct import Direct
from .engine import Database, retry_on_disconnect
from .notify import Notifier, invocation_channels, run_queue_channel
from .placement import NO_OFFER, Needs, Offer, needs_of, not_before_of
from .workers import queue_command

CANCEL_REASON = "cancelled by producer"
LEASE_EXPIRED = {
    "type": "LeaseExpired",
    "message": "the worker stopped renewing the lease on the last allowed attempt (run_config.max_attempts)",
}

_inv = t.invocations
_att = t.invocation_attempts
LOST = "lost"  # an attempt whose lease lapsed (invocation_attempts.state)
LEASE_LOST = {"type": "LeaseExpired", "message": "the worker stopped renewing the lease; requeued"}
KNOWN_MAX = 10_000  # queues and functions remembered as already in the store
_INV_COLS = tuple(c.name for c in _inv.c)


def row_to_invocation(r: Row[Any]) -> Invocation:
    """An Invocation from a row holding every invocations column (``select(_inv)`` / returning)."""
    return invocation_from(dict(zip(_INV_COLS, r, strict=True)))


def invocation_from(m: Mapping[str, Any]) -> Invocation:
    """An Invocation from a mapping of invocations columns; the two blobs may be left out (a
    listing reads neither): the arguments are then empty and the result None."""
    args_blob, result_blob = m.get("args_blob"), m.get("result_blob")
    return Invocation(
        invocation_id=m["invocation_id"],
        queue=m["queue"],
        state=m["state"],
        priority=int(m["priority"]),
        function=m["function"],
        args_blob=bytes(args_blob) if args_blob is not None else b"",
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
        args_ref=m.get("args_ref"),
        result_ref=m.get("result_ref"),
        not_before=m.get("not_before"),
        shape=m.get("shape") or "",
        preemptions=int(m.get("preemptions") or 0),
        checkpoint_ref=m.get("checkpoint_ref"),
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
    "args_ref",
    "shape",
    "not_before",
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
        self.insert_invocation = Direct(  # the writer's hottest statements: store/direct.py
            dialect_insert(dialect, _inv)
            .values({col: B(col, type_=_inv.c[col].type) for col in _SUBMIT_COLS})
            .on_conflict_do_nothing()
            .returning(_inv.c.invocation_id),
            dialect,
        )
        self.roots_of = sa.select(_inv.c.invocation_id, _inv.c.root_invocation_id).where(
            _inv.c.invocation_id.in_(B("ids", expanding=True))
        )
        self.same_id = sa.select(_inv.c.queue, _inv.c.content_hash).where(_inv.c.invocation_id == B("id"))
        self.same_key = sa.select(_inv.c.invocation_id).where(
            _inv.c.namespace == B("namespace"), _inv.c.queue == B("queue"), _inv.c.idempotency_key == B("key")
        )
        self.get = sa.select(_inv).where(_inv.c.invocation_id == B("id"))
        self.get_many = sa.select(_inv).where(_inv.c.invocation_id.in_(B("ids", expanding=True)))
        # ``ack``: one ack, RETURNING whether it applied; ``ack_many``: the same without RETURNING,
        # for an executemany of many acks (one round trip: psycopg pipelines it).
        self.ack: dict[tuple[bool, bool], Any] = {}
        self.ack_many: dict[tuple[bool, bool], Any] = {}
        for by_attempt in (False, True):
            for by_worker in (False, True):
                conds = [_inv.c.invocation_id == B("id"), _inv.c.state == "running"]
                if by_attempt:
                    conds.append(_inv.c.attempt == B("b_attempt"))
                if by_worker:
                    conds.append(_inv.c.worker_id == B("worker"))
                update = (
                    sa.update(_inv)
                    .where(*conds)
                    .values(
                        state=B("b_state"),
                        finished_at=B("now"),
                        result_blob=B("blob", type_=_inv.c.result_blob.type),
                        error=B("b_error", type_=_inv.c.error.type),
                        result_ref=B("b_ref", type_=_inv.c.result_ref.type),
                        lease_expires_at=None,
                    )
                )
                self.ack_many[by_attempt, by_worker] = Direct(update, dialect)
                self.ack[by_attempt, by_worker] = Direct(
                    update.returning(_inv.c.invocation_id, _inv.c.queue, _inv.c.namespace, _inv.c.shape),
                    dialect,
                )
        # a retry: the row back to queued (claimable at ``not_before``, NULL: now), conditional on
        # the attempt it ends still running; and that attempt's outcome kept in the history.
        self.retry_row = sa.select(
            _inv.c.state,
            _inv.c.queue,
            _inv.c.namespace,
            _inv.c.attempt,
            _inv.c.max_attempts,
            _inv.c.worker_id,
            _inv.c.started_at,
            _inv.c.run_config,
            _inv.c.cancel_requested,
            _inv.c.preemptions,
            _inv.c.shape,
        ).where(_inv.c.invocation_id == B("id"))
        self.requeue = (
            sa.update(_inv)
            .where(
                _inv.c.invocation_id == B("id"), _inv.c.state == "running", _inv.c.attempt == B("b_attempt")
            )
            .values(
                state="queued",
                worker_id=None,
                lease_expires_at=None,
                started_at=None,
                error=B("b_error", type_=_inv.c.error.type),
                not_before=B("b_not_before", type_=_inv.c.not_before.type),
            )
            .returning(_inv.c.invocation_id)
        )
        # a preempted attempt: back to queued at once, one more preemption (spends no attempt)
        self.preempt = (
            sa.update(_inv)
            .where(
                _inv.c.invocation_id == B("id"), _inv.c.state == "running", _inv.c.attempt == B("b_attempt")
            )
            .values(
                state="queued",
                worker_id=None,
                lease_expires_at=None,
                started_at=None,
                error=B("b_error", type_=_inv.c.error.type),
                not_before=None,
                preemptions=_inv.c.preemptions + 1,
            )
            .returning(_inv.c.invocation_id)
        )
        self.insert_attempt = dialect_insert(dialect, _att).on_conflict_do_nothing()
        self.attempt_of = sa.select(_att).where(
            _att.c.invocation_id == B("id"), _att.c.attempt == B("b_attempt")
        )
        self.renew = (
            sa.update(_inv)
            .where(
                sa.tuple_(_inv.c.invocation_id, _inv.c.attempt).in_(B("pairs", expanding=True)),
                _inv.c.state == "running",
                _inv.c.worker_id == B("worker"),
            )
            .values(lease_expires_at=B("lease"))
            .returning(_inv.c.invocation_id, _inv.c.cancel_requested)
        )


@functools.cache
def _statements(dialect: str) -> _Statements:
    return _Statements(dialect)


class Lease(Protocol):
    """What a lease check reads of an invocation (an :class:`Invocation`, or a row of those columns)."""

    invocation_id: str
    state: str
    attempt: int
    worker_id: str | None


def freed_channels(freed: tuple[str, str, str] | None) -> tuple[str, ...]:
    """The wake-up for the room a call's end freed under a limit (``AckResult.freed``): a poll
    that fits its shape, and one of the queue's plain calls (a queue's limit covers both)."""
    if freed is None:
        return ()
    namespace, queue, shape = freed
    plain = invocation_channels(namespace, queue)
    return (*plain, run_queue_channel(namespace, queue, shape)) if shape else plain


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


def _ack_refusal(req: AckRequest, inv: Invocation | None) -> AckResult:
    """The answer to an ack that did not apply, from the row as it stands: unknown, superseded,
    not this worker's, a repeat of the recorded outcome (ok, duplicate) or refused."""
    invocation_id = req.invocation_id
    if inv is None:
        return AckResult(ok=False, reason=f"unknown invocation {invocation_id}", status=UNKNOWN)
    refused = lease_refusal(inv, req.attempt, req.worker_id)
    if refused is not None:
        return AckResult(ok=False, state=inv.state, reason=refused[1], status=refused[0])
    if (
        inv.state == req.state
        and (inv.result_blob or None) == req.result_blob
        and inv.error == req.error
        and inv.result_ref == req.result_ref
    ):
        return AckResult(ok=True, duplicate=True, state=inv.state)
    return AckResult(
        ok=False, state=inv.state, reason=f"{invocation_id} is {inv.state}, not running; outcome refused"
    )


class _Prepared:
    """A validated submit: its invocations row, less the root and the time (set in the batch)."""

    __slots__ = ("needs", "row")

    def __init__(self, row: dict[str, Any], needs: Needs | None = None) -> None:
        self.row = row
        self.needs = needs or Needs()


class _Known:
    """The queues and functions this store has written: a submit skips their inserts.

    Rows of ``queues`` and ``functions`` are never deleted, so remembering them is safe; each set
    is bounded (cleared past ``KNOWN_MAX``: the next submits re-insert, ``ON CONFLICT DO NOTHING``).
    """

    def __init__(self) -> None:
        self.queues: set[str] = set()
        self.functions: set[str] = set()

    def remember(self, queue: str, function_key: str) -> None:
        for known, value in ((self.queues, queue), (self.functions, function_key)):
            if len(known) >= KNOWN_MAX:
                known.clear()
            known.add(value)


class InvocationStore(StoreBase):
    """Invocations from submit to their outcome."""

    def __init__(self, db: Database, notifier: Notifier) -> None:
        super().__init__(db, notifier)
        self._inv_st = _statements(db.dialect)
        self._known = _Known()
        self._placer = Placer()

    # -- producer side ---------------------------------------------------------------------------

    @retry_on_disconnect
    def submit(self, req: SubmitRequest) -> SubmitResult:
        prepared = self._prepare_submit(req)
        with self.db.tx(write=True) as conn:
            (result,) = self._submit_many_in(conn, [prepared], time.time())
        if isinstance(result, PlaneError):
            raise result
        self._submitted([prepared], [result])
        return result

    def _prepare_submit(self, req: SubmitRequest) -> _Prepared:
        """Validate ``req`` and build its row (everything but the root and the time), outside any
        transaction; raises PlaneError(400) for a malformed submit."""
        queue = req.queue or str(req.run_config.get("queue") or "") or "default"
        run_config = values.json_safe({**req.run_config, "queue": queue}, "run_config")
        function = values.json_safe(req.function, "function")
        code_context = values.json_safe(req.code_context or {}, "code_context")
        key = values.idempotency_key(run_config)
        needs = needs_of(run_config)
        row = {
            "invocation_id": req.invocation_id,
            "queue": queue,
            "state": "queued",
            "priority": values.normalize_priority(run_config.get("priority")),
            "function_key": values.function_key(function),
            "function": function,
            "args_blob": bytes(req.args_blob),
            "run_config": run_config,
            "code_context": code_context,
            "namespace": req.namespace or DEFAULT_NAMESPACE,
            "content_hash": values.content_hash(req, queue, run_config),
            "attempt": 0,
            "max_attempts": values.normalize_max_attempts(run_config.get("max_attempts")),
            "parent_invocation_id": req.parent_invocation_id,
            "root_invocation_id": None,
            "idempotency_key": key,
            "submitted_at": 0.0,
            "cancel_requested": False,
            "args_ref": values.json_safe(req.args_ref, "args_ref") if req.args_ref is not None else None,
            "shape": needs.key(),
            "not_before": not_before_of(run_config),
        }
        return _Prepared(row, needs)

    def _submit_many_in(
        self, conn: Connection, batch: Sequence[_Prepared], now: float
    ) -> list[SubmitResult | PlaneError]:
        """Insert the prepared submits in the caller's transaction, in order, with one statement
        each for the new queues, the new functions and the invocations (a multi-row insert).

        Queues and functions this store already wrote are skipped (``_known``; remembered only once
        the transaction committed, by ``_submitted``). ``ON CONFLICT DO NOTHING`` covers the id and
        the (queue, key) unique index, so only a submit whose row was not inserted needs the
        lookups that tell a duplicate from a clash (a PlaneError(409) in its place)."""
        st = self._inv_st
        rows = [p.row for p in batch]
        queues = sorted({r["queue"] for r in rows} - self._known.queues)
        if queues:
            conn.execute(st.insert_queue, [{"queue": q, "now": now} for q in queues])
        functions: dict[str, Any] = {}
        for r in rows:
            if r["function_key"] not in self._known.functions:
                functions.setdefault(r["function_key"], r["function"])
        if functions:
            conn.execute(
                st.insert_function,
                [{"fkey": k, "function": f, "now": now} for k, f in sorted(functions.items())],
            )
        self._shapes_in(conn, batch, now)
        parents = {r["parent_invocation_id"] for r in rows if r["parent_invocation_id"]}
        roots: dict[str, str | None] = {}
        if parents:
            roots = {r[0]: r[1] for r in conn.execute(st.roots_of, {"ids": sorted(parents)})}
        batch_roots: dict[str, str | None] = {}
        params = []
        for r in rows:
            parent = r["parent_invocation_id"]
            root = None
            if parent:  # an unknown parent is taken as the root; a parent of this batch counts
                root = roots.get(parent) or batch_roots.get(parent) or parent
            batch_roots.setdefault(r["invocation_id"], root)
            params.append({**r, "root_invocation_id": root, "submitted_at": now})
        inserted = set(conn.execute(st.insert_invocation, params).scalars())
        out: list[SubmitResult | PlaneError] = []
        for r in rows:
            inv_id = r["invocation_id"]
            if inv_id in inserted:
                inserted.discard(inv_id)  # a second submit of this id in the batch is a repeat
                out.append(SubmitResult(invocation_id=inv_id, queue=r["queue"]))
                continue
            try:
                existing = self._existing(conn, r)
            except PlaneError as exc:
                out.append(exc)
                continue
            out.append(
                existing
                if existing is not None
                else PlaneError(f"submit of {inv_id} conflicted; retry it", status=409)
            )
        return out

    def _shapes_in(self, conn: Connection, batch: Sequence[_Prepared], now: float) -> None:
        """Name the batch's new placement shapes in ``shapes``, and the ``max_concurrency`` of its
        concurrency keys in ``limits`` (the latest submit's value wins)."""
        new: dict[tuple[str, str], Needs] = {}
        keys: dict[str, int] = {}
        for p in batch:
            shape = p.row["shape"]
            if self._placer.learn(p.row["queue"], shape, p.needs):
                new[(p.row["queue"], shape)] = p.needs
            n = p.needs
            if (
                n.concurrency_key is not None
                and n.max_concurrency is not None
                and not self._placer.knows_limit(key_limit(n.concurrency_key), n.max_concurrency)
            ):
                keys[key_limit(n.concurrency_key)] = n.max_concurrency
        if new:
            conn.execute(
                dialect_insert(self.db.dialect, t.shapes).on_conflict_do_nothing(),
                [
                    {"queue": q, "shape": s, "needs": n.as_json(), "created_at": now}
                    for (q, s), n in new.items()
                ],
            )
        for name, most in sorted(keys.items()):
            self.set_limit_in(conn, name, most, now)

    def shape_needs(self, queue: str, shape: str) -> Needs | None:
        """The needs of a shape this store knows (cached); None when unknown."""
        return self._placer.shapes(queue).get(shape)

    def set_limit_in(self, conn: Connection, name: str, most: int | None, now: float) -> None:
        """Set (``most`` None: clear) the fleet-wide limit ``name`` in the caller's transaction."""
        lim = t.limits
        if most is None:
            conn.execute(sa.delete(lim).where(lim.c.name == name))
        else:
            ins = dialect_insert(self.db.dialect, lim).values(name=name, max_running=most, updated_at=now)
            conn.execute(
                ins.on_conflict_do_update(
                    index_elements=[lim.c.name], set_={"max_running": most, "updated_at": now}
                )
            )
        self._placer.set_limit(name, most)

    def _submitted(
        self,
        batch: Sequence[_Prepared],
        results: Sequence[SubmitResult | PlaneError],
        handed: Collection[str] = (),
    ) -> None:
        """After the commit: remember the queues and functions now in the store, wake the waiters
        (but the polls of the ``handed`` invocations: a pass of the same transaction has their
        wake, server/polls.py)."""
        channels: list[str] = []
        for p, res in zip(batch, results, strict=True):
            self._known.remember(p.row["queue"], p.row["function_key"])
            if isinstance(res, SubmitResult) and not res.duplicate:
                queued = invocation_channels(p.row["namespace"], res.queue, p.row["shape"])
                # a handed one's run-queue wake is its poll's already: the rest still hear it
                channels += queued[:1] if res.invocation_id in handed else queued
                channels.append(f"inv:{res.invocation_id}")
        self._notify(*channels)  # one run-queue:<ns>:<q> per new invocation: the poll hub wakes one poll each

    def _existing(self, conn: Connection, row: dict[str, Any]) -> SubmitResult | None:
        """The earlier submit a row that was not inserted repeats (same id and content, or the same
        idempotency key in its namespace and queue), None when there is none (a race: retry);
        PlaneError(409) for the same id with other content."""
        invocation_id, chash, queue, key = (
            row["invocation_id"],
            row["content_hash"],
            row["queue"],
            row["idempotency_key"],
        )
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
            params = {"namespace": row["namespace"], "queue": queue, "key": key}
            other = conn.execute(self._inv_st.same_key, params).scalar_one_or_none()
            if other is not None:
                return SubmitResult(invocation_id=other, queue=queue, duplicate=True)
        return None

    @retry_on_disconnect
    def get(self, invocation_id: str) -> Invocation | None:
        with self.db.tx(write=False) as conn:
            r = conn.execute(self._inv_st.get, {"id": invocation_id}).first()
        return row_to_invocation(r) if r is not None else None

    @retry_on_disconnect
    def get_many(self, invocation_ids: Sequence[str]) -> list[Invocation]:
        """The invocations of ``invocation_ids`` that exist, in one read (any order). A reader of
        outcomes only reads ``outcomes`` (store/outcomes.py), narrower."""
        if not invocation_ids:
            return []
        with self.db.tx(write=False) as conn:
            rows = conn.execute(self._inv_st.get_many, {"ids": list(invocation_ids)}).fetchall()
        return [row_to_invocation(r) for r in rows]

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
                .values(state="cancelled", finished_at=now, cancel_requested=True, not_before=None)
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
        offer: Offer = NO_OFFER,
    ) -> list[Invocation]:
        if not queues or limit < 1:
            return []
        with self.db.tx(write=True) as conn:
            got = self._claim_in(conn, worker_id, queues, limit, lease_s, time.time(), namespace, offer)
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
        offer: Offer = NO_OFFER,
    ) -> list[Invocation]:
        """Claim up to ``limit`` of what ``offer`` fits (store/claims.py)."""
        plan = self._placer.plan(conn, queues, offer, namespace, self.db.dialect)
        if not plan.heads:
            return []
        if not plan.placed:
            stmt, params = claim_params(queues, limit, worker_id, now, lease_s, namespace, plan.heads)
            rows = conn.execute(stmt, params).fetchall()
        else:
            picked = conn.execute(
                pick_statement(len(plan.heads), namespace is not None),
                {"limit": int(limit), **head_params(plan.heads, namespace)},
            ).fetchall()
            chosen = plan.choose(picked, limit, offer)
            if not chosen:
                return []
            params = {"ids": chosen, "worker": worker_id, "now": now, "lease": now + lease_s}
            rows = conn.execute(take_statement(), params).fetchall()
        return sorted(
            (row_to_invocation(r) for r in rows),
            key=lambda i: (-i.priority, i.submitted_at, i.invocation_id),
        )

    @retry_on_disconnect
    def ack(
        self,
        invocation_id: str,
        state: str,
        *,
        attempt: int | None,
        worker_id: str | None,
        result_blob: bytes | None,
        error: dict[str, Any] | None,
        result_ref: dict[str, Any] | None = None,
    ) -> AckResult:
        req = self._prepare_ack(
            AckRequest(invocation_id, state, attempt, worker_id, result_blob, error, result_ref)
        )
        with self.db.tx(write=True) as conn:
            result = self._ack_in(conn, req, time.time())
        if result.ok and not result.duplicate:
            again = (
                invocation_channels(
                    result.requeued_namespace or DEFAULT_NAMESPACE, result.requeued, result.requeued_shape
                )
                if result.requeued
                else ()
            )
            self._notify(f"inv:{invocation_id}", *again, *freed_channels(result.freed))
        return result

    def attempts(self, invocation_id: str) -> list[dict[str, Any]]:
        with self.db.tx(write=False) as conn:
            row = conn.execute(self._inv_st.get, {"id": invocation_id}).first()
            if row is None:
                return []
            kept = conn.execute(
                sa.select(_att).where(_att.c.invocation_id == invocation_id).order_by(_att.c.attempt)
            ).fetchall()
        inv = row_to_invocation(row)
        out = [
            {
                "attempt": r.attempt,
                "state": r.state,
                "worker_id": r.worker_id,
                "started_at": r.started_at,
                "finished_at": r.finished_at,
                "error": r.error,
                "retry_at": r.retry_at,
            }
            for r in kept
        ]
        done = {a["attempt"] for a in out}
        if inv.attempt > 0 and inv.attempt not in done:  # the current attempt: the row itself
            out.append(
                {
                    "attempt": inv.attempt,
                    "state": inv.state,
                    "worker_id": inv.worker_id,
                    "started_at": inv.started_at,
                    "finished_at": inv.finished_at,
                    "error": inv.error,
                    "retry_at": None,
                }
            )
        return out

    @staticmethod
    def _prepare_ack(req: AckRequest) -> AckRequest:
        """``req`` checked and normalised (error as a JSON-safe dict, an empty blob as None)."""
        if req.state not in ACK_STATES:
            raise PlaneError(
                f"cannot ack state {req.state!r}: use one of {', '.join(sorted(ACK_STATES))}", status=400
            )
        error = req.error
        if error is not None and not isinstance(error, dict):
            error = {"type": "DaemonError", "message": str(error)}
        if error is not None:
            error = values.json_safe(error, "error")
        blob = bytes(req.result_blob) if req.result_blob else None
        ref = values.json_safe(req.result_ref, "result_ref") if req.result_ref is not None else None
        if blob is not None and ref is not None:
            raise PlaneError("an ack carries result_blob or result_ref, not both", status=400)
        return AckRequest(req.invocation_id, req.state, req.attempt, req.worker_id, blob, error, ref)

    @staticmethod
    def _ack_params(req: AckRequest, now: float) -> dict[str, Any]:
        params: dict[str, Any] = {
            "id": req.invocation_id,
            "b_state": req.state,
            "now": now,
            "blob": req.result_blob,
            "b_error": req.error,
            "b_ref": req.result_ref,
        }
        if req.attempt is not None:
            params["b_attempt"] = req.attempt
        if req.worker_id is not None:
            params["worker"] = req.worker_id
        return params

    def _ack_in(
        self, conn: Connection, req: AckRequest, now: float, *, retry_first: bool = True
    ) -> AckResult:
        """Apply a prepared ack in the caller's transaction: a failure that queues another attempt
        (``_retry_in``), else one conditional UPDATE; a refusal (or a repeat) reads the row to say
        why, and changes nothing."""
        if req.state == PREEMPTED:
            return self._preempt_in(conn, req, now)
        if retry_first and req.state in retry.RETRY_STATES:
            retried = self._retry_in(conn, req, now)
            if retried is not None:
                return retried
        variant = (req.attempt is not None, req.worker_id is not None)
        done = conn.execute(self._inv_st.ack[variant], self._ack_params(req, now)).first()
        if done is not None:
            return AckResult(ok=True, state=req.state, freed=self._freed(done))
        return self._refusal_in(conn, req)

    def _freed(self, row: Any) -> tuple[str, str, str] | None:
        """``(namespace, queue, shape)`` of a call that stopped running under a fleet-wide limit
        (its end frees room: a poll is woken, ``freed_channels``); None when no limit covers it."""
        return (row.namespace, row.queue, row.shape) if self._placer.limited(row.queue, row.shape) else None

    def _refusal_in(self, conn: Connection, req: AckRequest) -> AckResult:
        """Why ``req`` did not apply; a repeat of an outcome that queued a retry is a duplicate."""
        if req.attempt is not None:
            kept = conn.execute(
                self._inv_st.attempt_of, {"id": req.invocation_id, "b_attempt": req.attempt}
            ).first()
            same = kept is not None and (kept.state, kept.error) == (req.state, req.error)
            if kept is not None and same and req.worker_id in (None, kept.worker_id):
                return AckResult(ok=True, duplicate=True, state=kept.state)
        row = conn.execute(self._inv_st.get, {"id": req.invocation_id}).first()
        return _ack_refusal(req, row_to_invocation(row) if row is not None else None)

    def _retry_in(self, conn: Connection, req: AckRequest, now: float) -> AckResult | None:
        """Queue another attempt instead of recording a failure, when the retry rule says so
        (store/retry.py); None when it does not (or the ack would be refused): the caller records
        the outcome as usual."""
        st = self._inv_st
        row = conn.execute(st.retry_row, {"id": req.invocation_id}).first()
        if row is None or row.state != "running":
            return None
        if (req.attempt is not None and req.attempt != row.attempt) or (
            req.worker_id is not None and req.worker_id != row.worker_id
        ):
            return None
        wait = retry.delay(
            row.run_config or {},
            req.state,
            req.error,
            row.attempt - row.preemptions,  # preempted attempts spend none of max_attempts
            row.max_attempts,
            cancel_requested=bool(row.cancel_requested),
        )
        if wait is None:
            return None
        not_before = now + wait if wait > 0 else None
        params = {
            "id": req.invocation_id,
            "b_attempt": row.attempt,
            "b_error": req.error,
            "b_not_before": not_before,
        }
        if conn.execute(st.requeue, params).first() is None:
            return None
        conn.execute(
            st.insert_attempt,
            {
                "invocation_id": req.invocation_id,
                "attempt": row.attempt,
                "state": req.state,
                "worker_id": row.worker_id,
                "started_at": row.started_at,
                "finished_at": now,
                "error": req.error,
                "retry_at": now + wait,
            },
        )
        return AckResult(
            ok=True,
            state="queued",
            requeued=row.queue if not_before is None else None,
            requeued_namespace=row.namespace if not_before is None else None,
            requeued_shape=row.shape if not_before is None else "",
        )

    @retry_on_disconnect
    def set_checkpoint(
        self, invocation_id: str, attempt: int, worker_id: str, ref: dict[str, Any]
    ) -> tuple[int, str] | None:
        """Record ``ref`` as the checkpoint the next attempt starts from, when ``worker_id`` holds
        ``attempt`` of the running invocation; else ``(status, reason)``: unknown (404), a
        superseded attempt or a lapsed lease (409), another worker's (403), not running (409). A
        stale attempt's checkpoint never overwrites the current one's."""
        with self.db.tx(write=True) as conn:
            done = conn.execute(
                sa.update(_inv)
                .where(
                    _inv.c.invocation_id == invocation_id,
                    _inv.c.state == "running",
                    _inv.c.attempt == attempt,
                    _inv.c.worker_id == worker_id,
                )
                .values(checkpoint_ref=ref)
                .returning(_inv.c.invocation_id)
            ).first()
            if done is not None:
                return None
            row = conn.execute(self._inv_st.get, {"id": invocation_id}).first()
        if row is None:
            return UNKNOWN, f"unknown invocation {invocation_id}"
        inv = row_to_invocation(row)
        refused = lease_refusal(inv, attempt, worker_id)
        return refused or (SUPERSEDED, f"{invocation_id} is {inv.state}, not running; checkpoint refused")

    def _preempt_in(self, conn: Connection, req: AckRequest, now: float) -> AckResult:
        """A ``preempted`` ack (the host stopped under the attempt): the call goes back to the
        queue at once, ``preemptions`` + 1, and the attempt is kept in the history as
        ``preempted``; past ``run_config.max_preemptions`` it fails ``{type: "Preempted"}``, and
        with a cancel requested it ends ``cancelled``. A refusal (superseded, another worker's, a
        repeat) is told as for any ack; nothing of a superseded attempt changes the row."""
        st = self._inv_st
        row = conn.execute(st.retry_row, {"id": req.invocation_id}).first()
        if (
            row is None
            or row.state != "running"
            or (req.attempt is not None and req.attempt != row.attempt)
            or (req.worker_id is not None and req.worker_id != row.worker_id)
        ):
            return self._refusal_in(conn, req)
        error = dict(req.error or {"type": retry.PREEMPTED_TYPE, "message": "the host stopped"})
        run_config = row.run_config or {}
        cancel = bool(row.cancel_requested)
        if not retry.may_requeue_preempted(run_config, row.preemptions, cancel_requested=cancel):
            if cancel:
                final, error = "cancelled", {"type": "Cancelled", "message": CANCEL_REASON}
            else:
                final = "failed"
                limit = retry.max_preemptions(run_config)
                error = {
                    **error,
                    "type": retry.PREEMPTED_TYPE,
                    "message": f"{error.get('message') or 'preempted'}; preempted {row.preemptions + 1} "
                    f"times, over run_config.max_preemptions ({limit})",
                }
            ended = AckRequest(req.invocation_id, final, row.attempt, row.worker_id, None, error, None)
            params = self._ack_params(ended, now)
            if conn.execute(st.ack[True, True], params).first() is None:
                return self._refusal_in(conn, req)
            return AckResult(ok=True, state=final)
        params = {"id": req.invocation_id, "b_attempt": row.attempt, "b_error": error}
        if conn.execute(st.preempt, params).first() is None:
            return self._refusal_in(conn, req)
        conn.execute(
            st.insert_attempt,
            {
                "invocation_id": req.invocation_id,
                "attempt": row.attempt,
                "state": PREEMPTED,
                "worker_id": row.worker_id,
                "started_at": row.started_at,
                "finished_at": now,
                "error": req.error,
                "retry_at": now,
            },
        )
        return AckResult(
            ok=True,
            state="queued",
            requeued=row.queue,
            requeued_namespace=row.namespace,
            requeued_shape=row.shape,
        )

    def _ack_many_in(
        self, conn: Connection, reqs: Sequence[AckRequest], now: float, *, retry_first: bool = True
    ) -> list[AckResult]:
        """Apply prepared acks of distinct invocations in the caller's transaction: one
        executemany per kind of ack (with or without attempt / worker). When the updates matched
        one row per ack (each UPDATE names one invocation id and holds the lease conditions: state
        running, the attempt, the worker) and no fleet limit is cached (no ack frees room), every
        ack applied and nothing is read back. Otherwise one read of the rows: an ack applied iff
        its row now holds its state with ``finished_at == now`` (this transaction's time: an
        earlier outcome has an earlier one); the others are refused or repeats, told apart as
        ``_ack_in`` does. Acks of one invocation twice go one by one."""
        if len(reqs) < 2 or len({r.invocation_id for r in reqs}) < len(reqs):
            return [self._ack_in(conn, r, now, retry_first=retry_first) for r in reqs]
        retried: dict[int, AckResult] = {}
        for k, r in enumerate(reqs):  # failures first: those that queue a retry answer so
            if r.state == PREEMPTED:
                retried[k] = self._preempt_in(conn, r, now)
            elif retry_first and r.state in retry.RETRY_STATES:
                got = self._retry_in(conn, r, now)
                if got is not None:
                    retried[k] = got
        if retried:
            rest = [k for k in range(len(reqs)) if k not in retried]
            answers = dict(retried)
            if rest:
                answers.update(
                    zip(
                        rest,
                        self._ack_many_in(conn, [reqs[k] for k in rest], now, retry_first=False),
                        strict=True,
                    )
                )
            return [answers[k] for k in range(len(reqs))]
        st = self._inv_st
        by_variant: dict[tuple[bool, bool], list[dict[str, Any]]] = {}
        for r in reqs:
            variant = (r.attempt is not None, r.worker_id is not None)
            by_variant.setdefault(variant, []).append(self._ack_params(r, now))
        matched = 0
        for variant, params in by_variant.items():
            matched += conn.execute(st.ack_many[variant], params).rowcount
        if (
            matched == len(reqs)
            and conn.dialect.supports_sane_multi_rowcount
            and not self._placer.any_limits()
        ):
            return [AckResult(ok=True, state=r.state) for r in reqs]
        rows = conn.execute(st.get_many, {"ids": [r.invocation_id for r in reqs]}).fetchall()
        found = {inv.invocation_id: inv for inv in map(row_to_invocation, rows)}
        out: list[AckResult] = []
        for r in reqs:
            inv = found.get(r.invocation_id)
            applied = inv is not None and inv.state == r.state and inv.finished_at == now
            out.append(
                AckResult(ok=True, state=r.state, freed=self._freed(inv))
                if applied
                else self._refusal_in(conn, r)
            )
        return out

    def _renew_in(
        self, conn: Connection, worker_id: str, running: Sequence[tuple[str, int]], lease: float
    ) -> dict[str, bool]:
        """Renew the worker's leases of ``running`` ``(invocation_id, attempt)`` pairs; the ids it
        still holds (the others were lost: superseded, expired or cancelled), each with whether a
        cancel was requested for it."""
        if not running:
            return {}
        params = {"pairs": sorted(running), "worker": worker_id, "lease": lease}
        return {r.invocation_id: bool(r.cancel_requested) for r in conn.execute(self._inv_st.renew, params)}

    def _expire_in(
        self, conn: Connection, now: float
    ) -> tuple[list[Row[Any]], list[Row[Any]], list[Row[Any]]]:
        """End the running invocations whose lease lapsed: cancelled when a cancel was requested,
        else requeued while attempts remain, else failed with ``LEASE_EXPIRED``. Returns the
        ``(invocation_id,)`` rows cancelled, the ``(invocation_id, queue, namespace, shape)`` rows requeued and the
        ``(invocation_id,)`` rows failed."""
        lapsed = (_inv.c.state == "running", _inv.c.lease_expires_at < now)
        gone = {"worker_id": None, "lease_expires_at": None}
        cancelled = conn.execute(
            sa.update(_inv)
            .where(*lapsed, _inv.c.cancel_requested == sa.true())
            .values(state="cancelled", finished_at=now, **gone)
            .returning(_inv.c.invocation_id)
        ).fetchall()
        # attempts spent: preempted ones are not (``preemptions``)
        retries = (*lapsed, _inv.c.attempt - _inv.c.preemptions < _inv.c.max_attempts)
        lost = conn.execute(
            sa.select(_inv.c.invocation_id, _inv.c.attempt, _inv.c.worker_id, _inv.c.started_at).where(
                *retries
            )
        ).fetchall()
        requeued = conn.execute(
            sa.update(_inv)
            .where(*retries)
            .values(state="queued", started_at=None, not_before=None, **gone)
            .returning(_inv.c.invocation_id, _inv.c.queue, _inv.c.namespace, _inv.c.shape)
        ).fetchall()
        back = {r.invocation_id for r in requeued}
        history = [
            {
                "invocation_id": r.invocation_id,
                "attempt": r.attempt,
                "state": LOST,
                "worker_id": r.worker_id,
                "started_at": r.started_at,
                "finished_at": now,
                "error": LEASE_LOST,
                "retry_at": now,
            }
            for r in lost
            if r.invocation_id in back
        ]
        if history:
            conn.execute(self._inv_st.insert_attempt, history)
        failed = conn.execute(
            sa.update(_inv)
            .where(*lapsed)
            .values(state="failed", finished_at=now, error=LEASE_EXPIRED, lease_expires_at=None)
            .returning(_inv.c.invocation_id)
        ).fetchall()
        return list(cancelled), list(requeued), list(failed)

    def _release_in(self, conn: Connection, now: float) -> list[Row[Any]]:
        """Make the retries whose backoff is over claimable (``not_before`` cleared, read off
        ``ix_invocations_delayed``); their ``(invocation_id, queue, namespace)`` rows."""
        return list(
            conn.execute(
                sa.update(_inv)
                .where(_inv.c.not_before.isnot(None), _inv.c.not_before <= now, _inv.c.state == "queued")
                .values(not_before=None)
                .returning(_inv.c.invocation_id, _inv.c.queue, _inv.c.namespace, _inv.c.shape)
            ).fetchall()
        )
