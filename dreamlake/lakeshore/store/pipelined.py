"""The group commit's order of writes, and its plain daemon transaction on PostgreSQL sent in one
round trip (libpq's pipeline mode, store/libpq.py).

A busy nymph's transaction is polls and the acks they carry (each poll refills the slots its acks
freed). Written statement by statement, each is a round trip of its own: ``BEGIN``, the duties
(``pg_duties``), an ack run's ``UPDATE``, a claim a poll, ``COMMIT``; about six for the two polls
such a transaction holds under load (stop 55's count), three a poll. None of those statements
needs an earlier one's rows to be written, only to be answered, and PostgreSQL runs them in the
order sent (a claim sees what an ack before it changed, as before). :func:`send_plain` sends them
all in one pipeline on libpq (store/libpq.py: each statement prepared once per connection, one
flush, no psycopg cursor), ``BEGIN`` and ``COMMIT`` too, which syncs once: one round trip for the
transaction. Its answers are read after it (:meth:`Pending.read`); the writes are answered after
the commit, as before (durable first).

It takes the plain case only, where the statements sent are the sequential path's (sql.py's
``_apply_writes``), in its order (:func:`write_steps`):

- every write a poll, or an ack ``_lone_ack`` takes (no failure the retry rule may turn into
  another attempt, no preemption: their first statement is a read that decides the next);
- acks of distinct invocations;
- no fleet limit cached: an ack then frees no room that a later claim counts, and no plan reads
  (and locks) a limit's row;
- each claiming poll's plan plain (no GPU shape to place, whose take needs its pick's rows) and of
  at most ``MERGED_QUEUES_MAX`` heads: its claim is one statement, and it takes no GPU, so what it
  leaves free of its offer (``_offered_in``) is known before its answer: written once a worker,
  its last pass's, with that pass's claim (the passes, ``_poll_in``, then write none).

Anything else (a submit, a frame, a heartbeat, a limit, a placed shape) is written the sequential
way. Two things need an answer first:

- A poll that claims exec jobs too (``kinds`` with ``exec``: nymph's ``--allow-exec``) claims them
  for the slots its claim left, after the sync, so its transaction stays open after the pipeline
  and commits as before: three round trips (the pipeline with its ``BEGIN``, the exec claim,
  ``COMMIT``).
- An ack whose ``UPDATE`` matched no row (a refusal, a repeat) is read back to say why
  (``_acks_checked_in``). That read comes after the claims, which never take a finished row, so
  only a refusal's reason can differ (when this very poll claimed the call the stale ack names).
  With ``COMMIT`` gone before it, the caller reads it after the transaction, in one of its own
  (``Answers.unread``): should that read fail, the acks of its run answer the store's error (a
  daemon sends an ack again) and their calls' waiters are woken all the same; the transaction's
  other writes stand, answered as written.

Once the pipeline's ``COMMIT`` has synced, nothing of the batch is written again: an error while
reading its answers fails the writes not yet answered (sql.py), where a retry would have its polls
claim a second time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.engine import Connection

from .api import AckRequest, AckResult, Command, Invocation, PollRequest
from .claims import MERGED_QUEUES_MAX, Plan, claim_params
from .invocation_rows import claimed_in_order
from .invocations import _Prepared
from .libpq import Sent as Statement
from .libpq import pipeline, pipeline_supported

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
    ) -> Statement: ...
    def _pg_duties_read(
        self, asks: Sequence[tuple[str, str | None]], rows: Iterable[Any]
    ) -> list[tuple[list[Command], str | None]]: ...
    def _acks_send(self, conn: Connection, reqs: Sequence[AckRequest], now: float) -> list[Statement]: ...
    def _acks_applied(
        self, reqs: Sequence[AckRequest], sent: Sequence[Statement]
    ) -> list[AckResult] | None: ...
    def _acks_checked_in(
        self, conn: Connection, reqs: Sequence[AckRequest], now: float
    ) -> list[AckResult]: ...
    def _offered_send(self, conn: Connection, worker_id: str, gpus: int) -> Statement | None: ...
    def _offered_forget(self, workers: Iterable[str]) -> None: ...


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
    # the runs of acks whose UPDATEs matched fewer rows than acks, once the pipeline's COMMIT has
    # gone: which applied and why the others did not is for the caller to read after the
    # transaction (``_acks_checked_in``), in one of its own
    unread: list[list[tuple[int, AckRequest]]] = field(default_factory=list)


@dataclass
class Pending:
    """What :func:`send_plain` sent, its answers not read yet (:meth:`read`)."""

    committed: bool  # its COMMIT went in the pipeline: the transaction is over
    daemons: Sequence[tuple[int, Any]]
    duties: Statement | None = None
    acks: list[tuple[list[tuple[int, AckRequest]], list[Statement]]] = field(default_factory=list)
    claims: dict[int, Statement] = field(default_factory=dict)
    offers: list[Statement] = field(default_factory=list)
    unclaimed: list[int] = field(default_factory=list)  # claiming polls with no head to claim from

    @property
    def asks(self) -> list[tuple[str, str | None]]:
        """The daemons' ``(worker_id, namespace)``, as ``_duties_in`` takes them."""
        return [(p.worker_id, p.namespace) for _, p in self.daemons]

    def statements(self) -> list[Statement]:
        return [
            *([self.duties] if self.duties else []),
            *(s for _, sent in self.acks for s in sent),
            *self.claims.values(),
            *self.offers,
        ]

    def read(self, store: _Store, conn: Connection, now: float) -> Answers:
        """The answers of what was sent (once its pipeline has synced: no round trip), but a
        refused ack's reason once committed (``Answers.unread``); before the commit, that is read
        here, in the transaction."""
        answers = Answers(claimed={k: [] for k in self.unclaimed})
        for offered in self.offers:
            offered.result()
        if self.duties is not None:
            got = store._pg_duties_read(self.asks, self.duties.result())
            answers.duties = dict(zip((k for k, _ in self.daemons), got, strict=True))
        for k, sent in self.claims.items():
            answers.claimed[k] = claimed_in_order(sent.result())
        for run, sent_acks in self.acks:
            reqs = [a for _, a in run]
            outcomes = store._acks_applied(reqs, sent_acks)
            if outcomes is None and self.committed:
                answers.unread.append(run)
                continue
            if outcomes is None:
                outcomes = store._acks_checked_in(conn, reqs, now)
            answers.acked.update(zip((k for k, _ in run), outcomes, strict=True))
        return answers


def send_plain(
    store: _Store,
    conn: Connection,
    batch: Sequence[tuple[int, Any]],
    steps: Sequence[Step],
    daemons: Sequence[tuple[int, Any]],
    now: float,
) -> Pending | None:
    """Send ``batch``'s statements (in ``steps``' order) as the sequential path would write them,
    in one pipeline (see the module docstring); None, with nothing sent, when it is not the plain
    case. ``daemons``: the batch's writes that take duties, as ``_apply_writes`` lists them. The
    polls' free GPUs are written here (each worker's last), not by their passes (``_poll_in``'s
    ``offer_written``). Raises what a statement raised, its transaction not committed."""
    if store.db.dialect != "postgresql" or not pipeline_supported() or store._placer.any_limits():
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
    # a poll that may claim exec jobs claims them for the slots its claim leaves: after its answer
    sent = Pending(not any(batch[k][1].exec_jobs for k in plans), daemons)
    # what each worker's plain passes leave free of their offers: all of it (they take no GPU);
    # the last one's, as the passes one by one would leave it
    offered = {p.worker_id: max(0, p.offer.gpus) for _, p in batch if isinstance(p, PollRequest)}
    try:
        with pipeline(conn) as piped:
            if daemons:
                sent.duties = store._pg_duties_send(conn, sent.asks, now)
            for run, writes in steps:
                if run:
                    sent.acks.append((run, store._acks_send(conn, [a for _, a in run], now)))
                for k, p in writes:
                    gpus = offered.pop(p.worker_id, None)
                    if gpus is not None and (free := store._offered_send(conn, p.worker_id, gpus)):
                        sent.offers.append(free)
                    claiming = plans.get(k)
                    if claiming is None:
                        continue
                    if not claiming.heads:  # nothing it may claim: as ``_claim_in`` answers
                        sent.unclaimed.append(k)
                        continue
                    stmt, params = claim_params(
                        p.queues, p.limit, p.worker_id, now, p.lease_s, p.namespace, claiming.heads
                    )
                    sent.claims[k] = stmt.send(conn, params)
            if sent.committed:
                piped.commit()
    except BaseException:  # (the caller rolls the transaction back)
        for statement in sent.statements():
            statement.close()
        store._offered_forget(p.worker_id for _, p in batch if isinstance(p, PollRequest))
        raise
    return sent
