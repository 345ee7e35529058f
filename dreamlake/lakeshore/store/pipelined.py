"""The group commit's order of writes, and its plain daemon transaction on PostgreSQL sent in one
round trip (psycopg's pipeline mode).

A busy nymph's transaction is polls and the acks they carry (each poll refills the slots its acks
freed). Written statement by statement, each is a round trip of its own: ``BEGIN``, the duties
(``pg_duties``), an ack run's ``UPDATE``, a claim a poll, ``COMMIT``; about six for the two polls
such a transaction holds under load (stop 55's count), three a poll. None of those statements
needs an earlier one's rows to be written, only to be answered, and PostgreSQL runs them in the
order sent (a claim sees what an ack before it changed, as before). :func:`send_plain` sends them
all in one pipeline (``direct.pipeline``), which syncs once; their answers are read after it, and
the transaction commits as before: two round trips, whatever the batch holds.

It takes the plain case only, where the statements sent are exactly those the sequential path
(sql.py's ``_apply_writes``) would run, in the same order (:func:`write_steps`):

- every write a poll, or an ack ``_lone_ack`` takes (no failure the retry rule may turn into
  another attempt, no preemption: their first statement is a read that decides the next);
- acks of distinct invocations;
- no fleet limit cached: an ack then frees no room that a later claim counts, and no plan reads
  (and locks) a limit's row;
- each claiming poll's plan plain (no GPU shape to place, whose take needs its pick's rows) and of
  at most ``MERGED_QUEUES_MAX`` heads: its claim is one statement.

Anything else (a submit, a frame, a heartbeat, a limit, a placed shape) is written the sequential
way. What needs an answer before it may run still runs after the sync, in the same transaction:
an ack whose ``UPDATE`` matched no row is read back to say why (``_acks_checked_in``; after the
claims now, which never take a finished row: only a refusal's reason can differ, when this very
poll claimed the call the stale ack names); a poll that claimed fewer calls than it asked for
then claims exec jobs; a changed GPU offer is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.engine import Connection

from .api import AckRequest, AckResult, Command, Invocation, PollRequest
from .claims import MERGED_QUEUES_MAX, Plan, claim_params
from .direct import Sent, pipeline, pipeline_supported
from .invocation_rows import claimed_in_order
from .invocations import _Prepared

if TYPE_CHECKING:
    from .claims import Placer
    from .engine import Database


class _Store(Protocol):
    """What :func:`send_plain` uses of the store (sql.py's ``SqlStore``)."""

    db: Database
    _placer: Placer

    def _lone_ack(self, prepared: Any) -> bool: ...
    def _pg_duties_send(
        self, conn: Connection, asks: Sequence[tuple[str, str | None]], now: float
    ) -> Sent: ...
    def _pg_duties_read(
        self, asks: Sequence[tuple[str, str | None]], rows: Iterable[Any]
    ) -> list[tuple[list[Command], str | None]]: ...
    def _acks_send(self, conn: Connection, reqs: Sequence[AckRequest], now: float) -> list[Sent]: ...
    def _acks_sent(
        self, conn: Connection, reqs: Sequence[AckRequest], now: float, sent: Sequence[Sent]
    ) -> list[AckResult]: ...


# One step of a transaction's writes after its submits: a run of acks applied together (one
# statement on PostgreSQL), then writes one at a time (the polls the run passed; else a frame, a
# heartbeat or a poll). Indexes into the batch.
Step = tuple[list[tuple[int, AckRequest]], list[tuple[int, Any]]]


def write_steps(batch: Sequence[tuple[int, Any]]) -> list[Step]:
    """The order the group commit writes ``batch``'s acks, polls, frames and heartbeats in (its
    submits are written before them all). A run of acks runs on past the polls of workers none
    of its later acks belong to (the polls then follow it): a pass claims queued calls and records
    its own worker's offer and commands, so another worker's ack changes nothing it does but free
    room under a limit, as it would have had the ack come first. A later ack of a passed poll's own
    worker (or one that names no worker) ends the run before it: one worker's writes keep the
    order they came in."""
    steps: list[Step] = []
    acks: list[tuple[int, AckRequest]] = []
    passed: list[tuple[int, Any]] = []  # (polls only, and only while ``acks`` holds acks)
    for k, (_, p) in enumerate(batch):
        if isinstance(p, AckRequest):
            if passed and (p.worker_id is None or any(q.worker_id == p.worker_id for _, q in passed)):
                steps.append((acks, passed))
                acks, passed = [], []
            acks.append((k, p))
        elif acks and isinstance(p, PollRequest):
            passed.append((k, p))
        else:
            if acks:
                steps.append((acks, passed))
                acks, passed = [], []
            if not isinstance(p, _Prepared):  # (the submits are written before)
                steps.append(([], [(k, p)]))
    if acks:
        steps.append((acks, passed))
    return steps


@dataclass
class Answers:
    """What :func:`send_plain`'s statements answered, by index into the batch: each daemon's
    duties (as ``_duties_in``), each ack's outcome, each claiming poll's claimed calls."""

    duties: dict[int, tuple[list[Command], str | None]] = field(default_factory=dict)
    acked: dict[int, AckResult] = field(default_factory=dict)
    claimed: dict[int, list[Invocation]] = field(default_factory=dict)


def send_plain(
    store: _Store,
    conn: Connection,
    batch: Sequence[tuple[int, Any]],
    steps: Sequence[Step],
    daemons: Sequence[tuple[int, Any]],
    now: float,
) -> Answers | None:
    """Write ``batch`` (in ``steps``' order) as the sequential path would, its statements in one
    pipeline (see the module docstring); None, with nothing written, when it is not the plain
    case. ``daemons``: the batch's writes that take duties, as ``_apply_writes`` lists them."""
    if store.db.dialect != "postgresql" or not pipeline_supported():
        return None
    ids: list[str] = []
    for _, p in batch:
        if isinstance(p, AckRequest):
            if not store._lone_ack(p):
                return None
            ids.append(p.invocation_id)
        elif not isinstance(p, PollRequest) or p.handed:
            return None
    if len(set(ids)) < len(ids):
        return None
    plans: dict[int, Plan] = {}
    for k, (_, p) in enumerate(batch):  # (a plan may read the cache's tables: before the pipeline)
        if isinstance(p, PollRequest) and p.queues and p.limit >= 1:
            plan = store._placer.plan(conn, p.queues, p.offer, p.namespace, "postgresql")
            if plan.placed or len(plan.heads) > MERGED_QUEUES_MAX:
                return None
            plans[k] = plan
    if store._placer.any_limits():
        return None
    asks = [(p.worker_id, p.namespace) for _, p in daemons]
    duties: Sent | None = None
    acks: list[tuple[list[tuple[int, AckRequest]], list[Sent]]] = []
    claims: dict[int, Sent] = {}
    answers = Answers()
    with pipeline(conn):
        if asks:
            duties = store._pg_duties_send(conn, asks, now)
        for run, writes in steps:
            if run:
                acks.append((run, store._acks_send(conn, [a for _, a in run], now)))
            for k, p in writes:
                claiming = plans.get(k)
                if claiming is None:
                    continue
                if not claiming.heads:  # nothing it may claim: as ``_claim_in`` answers
                    answers.claimed[k] = []
                    continue
                stmt, params = claim_params(
                    p.queues, p.limit, p.worker_id, now, p.lease_s, p.namespace, claiming.heads
                )
                claims[k] = stmt.send(conn, params)
    if duties is not None:
        got = store._pg_duties_read(asks, duties.result())
        answers.duties = dict(zip((k for k, _ in daemons), got, strict=True))
    for k, sent in claims.items():
        answers.claimed[k] = claimed_in_order(sent.result())
    for run, sent_acks in acks:
        outcomes = store._acks_sent(conn, [a for _, a in run], now, sent_acks)
        answers.acked.update(zip((k for k, _ in run), outcomes, strict=True))
    return answers
