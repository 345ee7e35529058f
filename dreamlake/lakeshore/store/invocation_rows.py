"""An invocation's row: its columns, its conversion to :class:`Invocation`, and the hot statements
that read and write it, built once per dialect; shared by submit and claim (invocations.py), acks
(acks.py) and leases (leases.py)."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Row

from . import schema as t
from .api import Invocation
from .base import dialect_insert
from .direct import Direct

CANCEL_REASON = "cancelled by producer"

_inv = t.invocations
_att = t.invocation_attempts
_INV_COLS = tuple(c.name for c in _inv.c)


# an Invocation's fields, in its order, and where each is in a row of every column
_FIELDS = [f.name for f in dataclasses.fields(Invocation)]
_PICK = operator.itemgetter(*(_INV_COLS.index(name) for name in _FIELDS))
_PRIORITY, _ARGS, _RESULT, _CANCEL, _SHAPE, _PREEMPTIONS, _HANDBACKS = (
    _FIELDS.index(name)
    for name in (
        "priority",
        "args_blob",
        "result_blob",
        "cancel_requested",
        "shape",
        "preemptions",
        "handbacks",
    )
)


def claimed_in_order(rows: Iterable[Row[Any]]) -> list[Invocation]:
    """A claim's rows (``RETURNING`` every column) as invocations, best first: priority, then
    submission time, then id (the order a claim's pick takes them in)."""
    return sorted(map(row_to_invocation, rows), key=lambda i: (-i.priority, i.submitted_at, i.invocation_id))


def row_to_invocation(r: Row[Any]) -> Invocation:
    """An Invocation from a row holding every invocations column (``select(_inv)`` / returning),
    its fields read off it at once (no mapping built first)."""
    if len(r) != len(_INV_COLS):
        raise ValueError(f"a row of {len(r)} columns, not the invocations' {len(_INV_COLS)}")
    return _converted(list(_PICK(r)))


def invocation_from(m: Mapping[str, Any]) -> Invocation:
    """An Invocation from a mapping of invocations columns; the two blobs may be left out (a
    listing reads neither): the arguments are then empty and the result None."""
    return _converted([m.get(name) for name in _FIELDS])


def _converted(v: list[Any]) -> Invocation:
    """An Invocation of its fields' column values, in its order, converted (the one rule of both
    readers): the priority an int, the blobs bytes (no arguments: empty), the flags and counters
    of their types, no shape ''."""
    v[_PRIORITY] = int(v[_PRIORITY])
    v[_ARGS] = bytes(v[_ARGS]) if v[_ARGS] is not None else b""
    v[_RESULT] = bytes(v[_RESULT]) if v[_RESULT] is not None else None
    v[_CANCEL] = bool(v[_CANCEL])
    v[_SHAPE] = v[_SHAPE] or ""
    v[_PREEMPTIONS] = int(v[_PREEMPTIONS] or 0)
    v[_HANDBACKS] = int(v[_HANDBACKS] or 0)
    return Invocation(*v)


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
        # SQLite: the same rows with neither (``Direct.append``: one executemany; the rows from a
        # conflict on go through ``insert_invocation``)
        self.append_invocations = (
            Direct(
                dialect_insert(dialect, _inv).values(
                    {col: B(col, type_=_inv.c[col].type) for col in _SUBMIT_COLS}
                ),
                dialect,
            )
            if dialect == "sqlite"
            else None
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
        self.ack: dict[tuple[bool, bool], Direct] = {}
        self.ack_many: dict[tuple[bool, bool], Direct] = {}
        # PostgreSQL: many acks as one UPDATE ... FROM (VALUES ...) (``Direct.run_rows``)
        self.ack_rows: dict[tuple[bool, bool], Direct] = {}
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
                if dialect == "postgresql":
                    self.ack_rows[by_attempt, by_worker] = _ack_rows(by_attempt, by_worker)
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
            _inv.c.handbacks,
            _inv.c.shape,
        ).where(_inv.c.invocation_id == B("id"))
        # a running attempt back to queued (a retry, a lapsed lease, a preemption): which row, and
        # what every way back clears; each statement below adds its own not_before (and count)
        running_attempt = sa.update(_inv).where(
            _inv.c.invocation_id == B("id"), _inv.c.state == "running", _inv.c.attempt == B("b_attempt")
        )
        queued_again: dict[str, Any] = {
            "state": "queued",
            "worker_id": None,
            "lease_expires_at": None,
            "started_at": None,
            "error": B("b_error", type_=_inv.c.error.type),
        }
        self.requeue = running_attempt.values(
            **queued_again, not_before=B("b_not_before", type_=_inv.c.not_before.type)
        ).returning(_inv.c.invocation_id)
        # a preempted attempt: back to queued at once, one more preemption (spends no attempt)
        self.preempt = running_attempt.values(
            **queued_again, not_before=None, preemptions=_inv.c.preemptions + 1
        ).returning(_inv.c.invocation_id)
        # an attempt handed back before it started: back to queued at once, spending nothing
        self.hand_back = running_attempt.values(
            **queued_again, not_before=None, handbacks=_inv.c.handbacks + 1
        ).returning(_inv.c.invocation_id)
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
def _ack_rows(by_attempt: bool, by_worker: bool) -> Direct:
    """``ack_many``'s UPDATE for PostgreSQL with its per-ack values in one ``VALUES`` row, so
    ``Direct.run_rows`` sends many acks as one statement (psycopg's pipelined executemany costs
    about what the round trips it saves did). Each value is cast: a column of only NULLs in the
    ``VALUES`` would be text, which a ``bytea`` or ``json`` column refuses. Strings are cast to
    unbounded ``VARCHAR``: a cast to ``VARCHAR(64)`` cuts a longer value short without an error,
    so an ack from a worker whose id only began with the holder's would have matched its row."""
    B = sa.bindparam
    text = sa.String()
    cols = [
        ("id", text),
        ("b_state", text),
        ("b_attempt", _inv.c.attempt.type),
        ("worker", text),
        ("blob", _inv.c.result_blob.type),
        ("b_error", _inv.c.error.type),
        ("b_ref", _inv.c.result_ref.type),
    ]
    if not by_attempt:
        cols = [c for c in cols if c[0] != "b_attempt"]
    if not by_worker:
        cols = [c for c in cols if c[0] != "worker"]
    v = sa.values(*(sa.column(name, type_) for name, type_ in cols), name="v").data(
        [tuple(sa.cast(B(name, type_=type_), type_) for name, type_ in cols)]
    )
    conds = [_inv.c.invocation_id == v.c.id, _inv.c.state == "running"]
    if by_attempt:
        conds.append(_inv.c.attempt == v.c.b_attempt)
    if by_worker:
        conds.append(_inv.c.worker_id == v.c.worker)
    update = (
        sa.update(_inv)
        .where(*conds)
        .values(
            state=v.c.b_state,
            finished_at=B("now"),
            result_blob=v.c.blob,
            error=v.c.b_error,
            result_ref=v.c.b_ref,
            lease_expires_at=None,
        )
    )
    return Direct(update, "postgresql")


def _statements(dialect: str) -> _Statements:
    return _Statements(dialect)
