"""Acks: an attempt's outcome recorded, a failure turned into a retry (store/retry.py), a
preempted attempt requeued, a checkpoint kept; and why a report from a worker is refused
(:func:`lease_refusal`, shared with frames.py and the server's sends).

A prepared ack (``_prepare_ack``) is applied in the caller's transaction (``_ack_in``, or many at
once: ``_ack_many_in``), which lets the group commit of sql.py apply many in one transaction. Each
state change is one conditional ``UPDATE ... RETURNING``, so a refusal never half-applies.
:class:`AckStore` is composed into ``InvocationStore`` (invocations.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.states import PREEMPTED

from . import retry, values
from .api import (
    ACK_STATES,
    ANOTHER_WORKER,
    DEFAULT_NAMESPACE,
    SUPERSEDED,
    UNKNOWN,
    AckRequest,
    AckResult,
    Invocation,
)
from .base import StoreBase
from .engine import retry_on_disconnect
from .invocation_rows import CANCEL_REASON, _att, _inv, row_to_invocation
from .libpq import Sent
from .notify import invocation_channels, run_queue_channel

if TYPE_CHECKING:
    from .claims import Placer
    from .invocation_rows import _Statements


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


class AckStore(StoreBase):
    """Outcomes of attempts: ack, retry, preemption, checkpoint, the attempts history."""

    if TYPE_CHECKING:  # InvocationStore's (bound in its ``__init__``)
        _inv_st: _Statements
        _placer: Placer

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
        why, and changes nothing. With no fleet limit cached (no ack frees room: ``_freed``), the
        UPDATE returns no row: its count (one, by primary key, or none) says whether it applied."""
        if req.state == PREEMPTED:
            return self._preempt_in(conn, req, now)
        if retry_first and req.state in retry.RETRY_STATES:
            retried = self._retry_in(conn, req, now)
            if retried is not None:
                return retried
        variant = (req.attempt is not None, req.worker_id is not None)
        params = [self._ack_params(req, now)]
        if not self._placer.any_limits() and conn.dialect.supports_sane_rowcount:
            if self._inv_st.ack_many[variant].run(conn, params).rowcount == 1:
                return AckResult(ok=True, state=req.state)
        else:
            done = self._inv_st.ack[variant].run(conn, params).first()
            if done is not None:
                return AckResult(ok=True, state=req.state, freed=self._freed(done))
        return self._refusal_in(conn, req)

    def _lone_ack(self, prepared: Any) -> bool:
        """Whether ``prepared`` (a batch's one write) is an ack that ``_ack_in`` writes with one
        statement, its conditional UPDATE (a refusal then reads why): not a preemption, not a
        failure the retry rule may turn into another attempt."""
        return (
            isinstance(prepared, AckRequest)
            and prepared.state != PREEMPTED
            and prepared.state not in retry.RETRY_STATES
        )

    def _freed(self, row: Any) -> tuple[str, str, str] | None:
        """``(namespace, queue, shape)`` of a call that stopped running under a fleet-wide limit
        (its end frees room: a poll is woken, ``freed_channels``); None when no limit covers it."""
        if not self._placer.any_limits():
            return None
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
            # preempted attempts, and those handed back before they started, spend no max_attempts
            row.attempt - row.preemptions - row.handbacks,
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
        with a cancel requested it ends ``cancelled``. One that hands back an attempt that never
        started (``error.started`` false: :func:`retry.is_hand_back`) counts ``handbacks`` + 1
        instead, and no preemption limit ends it. A refusal (superseded, another worker's, a
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
        handed = retry.is_hand_back(req.error, row.handbacks)  # it never started: spends nothing
        if (cancel or not handed) and not retry.may_requeue_preempted(
            run_config, row.preemptions, cancel_requested=cancel
        ):
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
        if conn.execute(st.hand_back if handed else st.preempt, params).first() is None:
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
        its row now holds its outcome with ``finished_at == now`` (this transaction's time: an
        earlier outcome has an earlier one) under its worker and attempt; the others are refused
        or repeats, told apart as ``_ack_in`` does. Acks of one invocation twice go one by one."""
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
        matched = 0
        for variant, params in self._ack_variants(reqs, now).items():
            if st.ack_rows:  # PostgreSQL: one statement for them all
                matched += st.ack_rows[variant].run_rows(conn, params).rowcount
            else:
                matched += conn.execute(st.ack_many[variant], params).rowcount
        if (
            matched == len(reqs)
            and conn.dialect.supports_sane_multi_rowcount
            and not self._placer.any_limits()
        ):
            return [AckResult(ok=True, state=r.state) for r in reqs]
        return self._acks_checked_in(conn, reqs, now)

    def _acks_send(self, conn: Connection, reqs: Sequence[AckRequest], now: float) -> list[Sent]:
        """``_ack_many_in``'s UPDATEs on PostgreSQL, their answers left to ``_acks_applied`` (a
        pipeline's: pipelined.py's ``send_plain``), for acks it writes with them alone: ``_lone_ack``'s,
        of distinct invocations, with no fleet limit cached."""
        st = self._inv_st
        sent: list[Sent] = []
        for variant, params in self._ack_variants(reqs, now).items():
            if len(params) == 1:  # as ``_ack_in`` writes one
                sent.append(st.ack_many[variant].send(conn, params[0]))
            else:
                sent += st.ack_rows[variant].send_rows(conn, params)
        return sent

    def _ack_variants(
        self, reqs: Sequence[AckRequest], now: float
    ) -> dict[tuple[bool, bool], list[dict[str, Any]]]:
        """Each ack's UPDATE parameters by the statement's variant (with an attempt, a worker)."""
        by_variant: dict[tuple[bool, bool], list[dict[str, Any]]] = {}
        for r in reqs:
            by_variant.setdefault((r.attempt is not None, r.worker_id is not None), []).append(
                self._ack_params(r, now)
            )
        return by_variant

    @staticmethod
    def _acks_applied(reqs: Sequence[AckRequest], sent: Sequence[Sent]) -> list[AckResult] | None:
        """The answers to ``reqs``, sent by ``_acks_send``, when their UPDATEs matched a row each
        (all applied); None when not, for ``_acks_checked_in`` to read back which did and why not."""
        if sum(s.result().rowcount for s in sent) != len(reqs):
            return None
        return [AckResult(ok=True, state=r.state) for r in reqs]

    def _acks_checked_in(self, conn: Connection, reqs: Sequence[AckRequest], now: float) -> list[AckResult]:
        """Which of ``reqs`` (acks of distinct invocations, just written) applied, and why each
        other did not (see ``_ack_many_in``)."""
        st = self._inv_st
        rows = conn.execute(st.get_many, {"ids": [r.invocation_id for r in reqs]}).fetchall()
        found = {inv.invocation_id: inv for inv in map(row_to_invocation, rows)}
        out: list[AckResult] = []
        for r in reqs:
            inv = found.get(r.invocation_id)
            # its row holds its outcome, from this transaction (an earlier outcome has an earlier
            # time), under its worker and attempt: an ack earlier in this transaction (another run
            # of acks) may have finished the row, and another worker's ack of it is not applied
            applied = (
                inv is not None
                and inv.finished_at == now
                and (inv.state, inv.result_blob) == (r.state, r.result_blob)
                and _same_json(inv.error, r.error)
                and _same_json(inv.result_ref, r.result_ref)
                and r.worker_id in (None, inv.worker_id)
                and r.attempt in (None, inv.attempt)
            )
            out.append(
                AckResult(ok=True, state=r.state, freed=self._freed(inv))
                if applied
                else self._refusal_in(conn, r)
            )
        return out


def _same_json(stored: Any, sent: Any) -> bool:
    """Whether a JSON column read back holds ``sent`` (a tuple comes back a list, an int key a
    string)."""
    return stored == sent or values.canonical(stored) == values.canonical(sent)
