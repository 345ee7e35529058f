"""Invocations: submit, read, cancel and claim; composed with their acks (acks.py) and leases
(leases.py) into :class:`InvocationStore`.

State changes are single conditional ``UPDATE ... RETURNING`` statements, so a refusal never
half-applies. A submit is checked first (``_prepare_submit``), then applied in the caller's
transaction (``_submit_many_in``: many submits, one multi-row insert), which lets the group commit
of sql.py apply many in one transaction. The row's columns and hot statements are in
invocation_rows.py. Choices the seed leaves open, made here:

- an unknown ``parent_invocation_id`` is taken as the root (``root_invocation_id = parent``);
- a running invocation whose lease lapses after a cancel was requested becomes ``cancelled``
  instead of being requeued (leases.py).

Claims (see docs/architecture.md and :func:`claims.claim_statement`): the order is priority desc,
submitted_at asc, invocation_id asc, read straight off an index of queued rows, so a claim costs the
same at any backlog; ``FOR UPDATE SKIP LOCKED`` (ignored by SQLite, where ``BEGIN IMMEDIATE``
serialises writers) in a ``MATERIALIZED`` CTE picks the rows, and the claim updates them by primary
key.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.errors import PlaneError

from . import schema as t
from . import values
from .acks import AckStore
from .acks import Lease as Lease
from .acks import freed_channels as freed_channels
from .acks import lease_refusal as lease_refusal
from .api import (
    DEFAULT_LEASE_S,
    DEFAULT_NAMESPACE,
    Invocation,
    PollRequest,
    SubmitRequest,
    SubmitResult,
)
from .base import dialect_insert
from .claims import (
    MERGED_QUEUES_MAX,
    Placer,
    claim_params,
    claimed_insert_statement,
    head_params,
    key_limit,
    pick_rows,
    take_statement,
)
from .engine import Database, retry_on_disconnect
from .invocation_rows import CANCEL_REASON as CANCEL_REASON
from .invocation_rows import _inv, _statements, claimed_in_order, row_to_invocation
from .invocation_rows import invocation_from as invocation_from
from .leases import LEASE_EXPIRED as LEASE_EXPIRED
from .leases import LEASE_LOST as LEASE_LOST
from .leases import LOST as LOST
from .leases import LeaseStore
from .notify import Notifier, invocation_channels
from .placement import NO_OFFER, Needs, Offer, needs_of, not_before_of
from .quotas import count_queued_in, lock_queued_in, queued_refusal
from .workers import queue_command

KNOWN_MAX = 10_000  # queues and functions remembered as already in the store


class _Prepared:
    """A validated submit: its invocations row, less the root and the time (set in the batch),
    and the namespace quota it is checked against (``SubmitRequest.max_queued``, ``quota_group``)."""

    __slots__ = ("max_queued", "needs", "quota_group", "row", "texts")

    def __init__(
        self,
        row: dict[str, Any],
        needs: Needs | None = None,
        max_queued: int | None = None,
        quota_group: int | None = None,
        texts: Mapping[str, str] | None = None,
    ) -> None:
        self.row = row
        # the JSON columns' texts, as the checks encoded them: SQLite stores them as they are
        self.texts = texts or {}
        self.needs = needs or Needs()
        self.max_queued = max_queued
        self.quota_group = quota_group


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


class InvocationStore(AckStore, LeaseStore):
    """Invocations from submit to their outcome (acks: :class:`AckStore`, leases: :class:`LeaseStore`)."""

    # A lone submit's row inserted as the pass it was handed would claim it (``_claim_on_insert_in``);
    # False: that pass claims with its statement, as any other (tests compare the two).
    claim_on_insert = True

    def __init__(self, db: Database, notifier: Notifier) -> None:
        super().__init__(db, notifier)
        self._inv_st = _statements(db.dialect)
        self._known = _Known()
        self._placer = Placer()

    # -- producer side ---------------------------------------------------------------------------

    @retry_on_disconnect
    def submit(self, req: SubmitRequest) -> SubmitResult:
        prepared = self._prepare_submit(req)
        with self._placer.tentative(), self.db.tx(write=True) as conn:
            (result,) = self._submit_many_in(conn, [prepared], time.time())
        if isinstance(result, PlaneError):
            raise result
        wakes, changed = self._submitted([prepared], [result])
        self._notify(*wakes, *changed)
        return result

    def _prepare_submit(self, req: SubmitRequest) -> _Prepared:
        """Validate ``req`` and build its row (everything but the root and the time), outside any
        transaction; raises PlaneError(400) for a malformed submit."""
        queue = req.queue or str(req.run_config.get("queue") or "") or "default"
        run_config, run_config_text = values.json_encoded({**req.run_config, "queue": queue}, "run_config")
        function, function_text = values.json_encoded(req.function, "function")
        code_context, code_context_text = values.json_encoded(req.code_context or {}, "code_context")
        key = values.idempotency_key(run_config)
        namespace = req.namespace or DEFAULT_NAMESPACE
        needs = needs_of(run_config, namespace)
        row = {
            "invocation_id": req.invocation_id,
            "queue": queue,
            "state": "queued",
            "priority": values.normalize_priority(run_config.get("priority")),
            "function_key": values.function_key(function, function_text),
            "function": function,
            "args_blob": bytes(req.args_blob),
            "run_config": run_config,
            "code_context": code_context,
            "namespace": namespace,
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
        limit = None if req.max_queued is None else max(0, int(req.max_queued))
        texts = {"run_config": run_config_text, "function": function_text, "code_context": code_context_text}
        return _Prepared(row, needs, limit, req.quota_group, texts)

    def _submit_many_in(
        self, conn: Connection, batch: Sequence[_Prepared], now: float
    ) -> list[SubmitResult | PlaneError]:
        """Insert the prepared submits in the caller's transaction, in order, with one statement
        each for the new queues, the new functions and the invocations (a multi-row insert).

        Queues and functions this store already wrote are skipped (``_known``; remembered only once
        the transaction committed, by ``_submitted``). ``ON CONFLICT DO NOTHING`` covers the id and
        the (queue, key) unique index, so only a submit whose row was not inserted needs the
        lookups that tell a duplicate from a clash (a PlaneError(409) in its place).

        Submits that carry their namespace's ``max_queued`` are held to it here, in this
        transaction (``_hold_quotas_in``); the others pay nothing for it."""
        st = self._inv_st
        queued = self._queued_in(conn, batch)
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
        texts = self.db.dialect == "sqlite"  # (PostgreSQL's binds wrap the values for psycopg)
        for p in batch:
            r = p.row
            parent = r["parent_invocation_id"]
            root = None
            if parent:  # an unknown parent is taken as the root; a parent of this batch counts
                root = roots.get(parent) or batch_roots.get(parent) or parent
            batch_roots.setdefault(r["invocation_id"], root)
            params.append(
                {**r, **(p.texts if texts else {}), "root_invocation_id": root, "submitted_at": now}
            )
        # SQLite: one call up to a conflict; the rest (PostgreSQL: all) each one's answer told apart
        done = st.append_invocations.append(conn, params) if st.append_invocations and params else 0
        inserted = {p["invocation_id"] for p in params[:done]}
        if done < len(params):
            inserted |= set(st.insert_invocation.run_rows(conn, params[done:]).scalars())
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
        if queued:
            self._hold_quotas_in(conn, batch, out, queued)
        return out

    def _queued_in(self, conn: Connection, batch: Sequence[_Prepared]) -> dict[str, int]:
        """The queued (due) invocations of each namespace a quota-checked submit of ``batch``
        names, counted up to its quota, before the batch's rows go in; empty (no statement) when
        none is checked. On PostgreSQL the namespaces' advisory locks are taken first, so no
        other process's quota-checked submit of them commits between this count and our commit."""
        most: dict[str, int] = {}
        for p in batch:
            if p.max_queued is not None:
                ns = p.row["namespace"]
                most[ns] = max(most.get(ns, 0), p.max_queued)
        if not most:
            return {}
        lock_queued_in(conn, self.db.dialect, most)
        return {ns: count_queued_in(conn, ns, up_to) for ns, up_to in most.items()}

    def _hold_quotas_in(
        self,
        conn: Connection,
        batch: Sequence[_Prepared],
        out: list[SubmitResult | PlaneError],
        queued: dict[str, int],
    ) -> None:
        """Refuse the quota-checked submits that took their namespace past ``max_queued``, in
        batch order: each one alone, or a ``quota_group`` (one submit-batch) all together. Only
        the rows this batch inserted and made due count (a duplicate, a clash or a submit with a
        ``not_before`` still ahead adds nothing to the queue). A refused submit's row is deleted
        in this transaction (no other saw it) and its answer is :func:`queued_refusal` (429); a
        repeat in the batch of a refused one is refused with it."""
        units: dict[tuple[str, int], list[int]] = {}
        for k, p in enumerate(batch):
            if p.max_queued is not None:
                unit = ("group", p.quota_group) if p.quota_group is not None else ("alone", k)
                units.setdefault(unit, []).append(k)
        refused: dict[str, PlaneError] = {}
        for members in units.values():
            adds: dict[str, int] = {}
            limits: dict[str, int] = {}
            for k in members:
                p, res = batch[k], out[k]
                ns, limit = p.row["namespace"], p.max_queued
                assert limit is not None
                limits[ns] = min(limits.get(ns, limit), limit)
                if isinstance(res, SubmitResult) and not res.duplicate and p.row["not_before"] is None:
                    adds[ns] = adds.get(ns, 0) + 1
            over = [ns for ns, n in adds.items() if queued[ns] + n > limits[ns]]
            if not over:
                for ns, n in adds.items():
                    queued[ns] += n
                continue
            ns = over[0]
            refusal = queued_refusal(ns, limits[ns], queued[ns], adds[ns])
            for k in members:
                res = out[k]
                if isinstance(res, SubmitResult) and not res.duplicate:
                    refused[res.invocation_id] = refusal
                out[k] = refusal
        if not refused:
            return
        conn.execute(sa.delete(_inv).where(_inv.c.invocation_id.in_(sorted(refused))))
        for k, res in enumerate(out):
            if isinstance(res, SubmitResult) and res.invocation_id in refused:
                out[k] = refused[res.invocation_id]  # a repeat of a refused submit: nothing to repeat

    def _lone_insert(self, p: _Prepared) -> bool:
        """Whether ``_submit_many_in`` of ``p`` alone writes with one statement, the invocation's
        insert: its queue and function known, no parent to look up, no new shape or limit to
        name (then its lookups, should the insert meet a conflict, are reads)."""
        row, needs = p.row, p.needs
        return (
            p.max_queued is None  # (a quota's lock and count go before the insert)
            and row["queue"] in self._known.queues
            and row["function_key"] in self._known.functions
            and not row["parent_invocation_id"]
            and self._placer.knows_shape(row["queue"], row["shape"])
            and (
                needs.concurrency_key is None
                or needs.max_concurrency is None
                or self._placer.knows_limit(key_limit(needs.concurrency_key), needs.max_concurrency)
            )
        )

    def _claimable_on_insert(self, p: _Prepared, q: PollRequest) -> bool:
        """Whether ``q``, handed ``p`` and written right after it, may claim it by its insert
        (``_claim_on_insert_in``): SQLite, a pass that claims, a lone insert due now."""
        return (
            self.claim_on_insert
            and self.db.dialect == "sqlite"
            and bool(q.queues)
            and q.limit >= 1
            and p.row["invocation_id"] in q.handed
            and p.row["not_before"] is None
            and self._lone_insert(p)
        )

    def _claim_on_insert_in(
        self, conn: Connection, p: _Prepared, q: PollRequest, now: float
    ) -> tuple[SubmitResult, list[Invocation]] | None:
        """``_submit_many_in([p])`` then ``q``'s ``_claim_in`` as one insert, when the claim would
        take the new row alone (``claimed_insert_statement``): a plain plan, the row of one of its
        heads (and namespace), none of them holding a due row. None, nothing written, when not."""
        plan = self._placer.plan(conn, q.queues, q.offer, q.namespace, self.db.dialect)
        row = p.row
        if (
            plan.placed
            or len(plan.heads) > MERGED_QUEUES_MAX
            or (row["queue"], row["shape"]) not in plan.heads
            or (q.namespace is not None and q.namespace != row["namespace"])
        ):
            return None
        params = {**row, **p.texts, "submitted_at": now, "state": "running", "attempt": row["attempt"] + 1}
        params.update(worker_id=q.worker_id, started_at=now, lease_expires_at=now + q.lease_s)
        params.update(head_params(plan.heads, q.namespace))
        stmt = claimed_insert_statement(len(plan.heads), q.namespace is not None)
        got = stmt.run(conn, [params]).first()
        if got is None:
            return None
        return SubmitResult(invocation_id=row["invocation_id"], queue=row["queue"]), [row_to_invocation(got)]

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
    ) -> tuple[list[str], list[str]]:
        """After the commit: remember the queues and functions now in the store; the waiters to
        wake (the caller's to notify), as ``(wakes, changed)``: one ``run-queue:<ns>:<q>`` per new
        invocation (the poll hub wakes one poll each), but for the ``handed`` invocations (a pass
        of the same transaction has their wake, server/polls.py), and each one's ``inv:<id>``."""
        wakes: list[str] = []
        changed: list[str] = []
        for p, res in zip(batch, results, strict=True):
            self._known.remember(p.row["queue"], p.row["function_key"])
            if isinstance(res, SubmitResult) and not res.duplicate:
                queued = invocation_channels(p.row["namespace"], res.queue, p.row["shape"])
                # a handed one's run-queue wake is its poll's already: the rest still hear it
                wakes += queued[:1] if res.invocation_id in handed else queued
                changed.append(f"inv:{res.invocation_id}")
        return wakes, changed

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
        if not plan.placed and len(plan.heads) <= MERGED_QUEUES_MAX:
            stmt, params = claim_params(queues, limit, worker_id, now, lease_s, namespace, plan.heads)
            rows = conn.execute(stmt, params).fetchall()
        else:
            picked = pick_rows(conn, plan.heads, limit, namespace)  # (in groups past MERGED_QUEUES_MAX)
            chosen = plan.choose(picked, limit, offer) if plan.placed else [r[0] for r in picked[:limit]]
            if not chosen:
                return []
            params = {"ids": chosen, "worker": worker_id, "now": now, "lease": now + lease_s}
            rows = conn.execute(take_statement(), params).fetchall()
        return claimed_in_order(rows)
