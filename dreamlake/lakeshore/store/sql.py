"""SqlStore: the one implementation of ``api.Store``, over SQLite (file or ``:memory:``) or PostgreSQL.

One SQLAlchemy Core code path serves both dialects. The store is assembled from one class per
concern, each whole in its module (see base.py for how they combine):

- invocations.py  submit, get, cancel, claim; composed with acks.py (ack, retry, preemption,
                  checkpoint) and leases.py (renewal, expiry); the row and its statements:
                  invocation_rows.py
- frames.py       the frame journal of invocations and topics
- workers.py      workers and their commands, namespaces (pinned nymph version), tokens
- exec_jobs.py    exec jobs (seed 003) and their leases
- listing.py      the operators' read-only views: queues, workers, invocation pages, journal sizes
- retention.py    expiry of finished work, in batches (the server's sweep and ``lakeshore gc``)

This module holds what spans them: the daemon's one-transaction calls ``poll`` / ``poll_pass``
(commands, then invocations, then exec jobs up to the limit; ``poll_pass`` also reads the pinned
nymph version), ``heartbeat`` (renew both kinds of lease, take commands) and ``expire_leases``
(both kinds); the group commit ``write_batch`` (submits, acks, frames and heartbeats, many in one
transaction, each answered alone); and the store's construction (engine, migration).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid

from .activity import ActivityStore
from .api import (
    DEFAULT_LEASE_S,
    DEFAULT_NAMESPACE,
    AckRequest,
    AckResult,
    Command,
    FrameRequest,
    FramesRequest,
    FramesResult,
    HeartbeatRequest,
    HeartbeatResult,
    Invocation,
    PollRequest,
    PollResult,
    Store,
    SubmitRequest,
    SubmitResult,
    WriteRequest,
    WriteResult,
)
from .direct import ROWS_MAX
from .engine import Database, migrate, retry_on_disconnect
from .exec_jobs import ExecJobStore
from .frames import FrameStore, frame_channel
from .invocations import CANCEL_REASON, InvocationStore, _Prepared, freed_channels
from .limits import LimitStore
from .listing import ListingStore
from .notify import Notifier, exec_queue_channel, invocation_channels
from .outage import WriteLockBusy, classify
from .outcomes import OutcomeStore
from .pipelined import Answers, Pending, send_plain, write_steps
from .placement import NO_OFFER, Offer
from .quotas import QuotaStore
from .retention import RetentionStore
from .secrets import SecretStore
from .workers import WorkerStore

log = logging.getLogger(__name__)


def _cancels_again(renewed: dict[str, bool], taken: list[Command]) -> list[Command]:
    """A cancel for every invocation the heartbeat still reports running whose cancel was
    requested, unless one was taken with it. The queued cancel command goes out once (``DELETE ...
    RETURNING``), and an answer can be lost on its way (a poll whose daemon hung up, a nymph that
    had not yet entered the job it was just handed): the running invocation is asked again on
    every beat until its ack lands. nymph's cancel is idempotent."""
    asked = {c.body.get("invocation_id") for c in taken if c.kind == "cancel"}
    return [
        Command(new_ulid(), "cancel", {"invocation_id": inv, "reason": CANCEL_REASON})
        for inv, cancelling in sorted(renewed.items())
        if cancelling and inv not in asked
    ]


# ``write_batch``'s callback: the (index, answer) pairs of one committed transaction.
OnCommit = Callable[[list[tuple[int, "WriteResult | PlaneError"]]], None]


class SqlStore(
    InvocationStore,
    FrameStore,
    WorkerStore,
    ExecJobStore,
    ListingStore,
    OutcomeStore,
    RetentionStore,
    ActivityStore,
    SecretStore,
    LimitStore,
    QuotaStore,
):
    """The Store protocol over SQLite (file or ``:memory:``) or PostgreSQL."""

    def __init__(self, url: str, *, notifier: Notifier | None = None, migrate_schema: bool = True) -> None:
        super().__init__(Database(url), notifier if notifier is not None else Notifier())
        if migrate_schema:
            migrate(self.db)

    def poll(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        exec_jobs: bool = True,
        namespace: str | None = None,
    ) -> tuple[list[Command], list[Invocation], list[dict[str, Any]]]:
        got = self._poll(worker_id, queues, limit, lease_s, exec_jobs, namespace, pin=False)
        return got.commands, got.invocations, got.exec_jobs

    def poll_pass(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        exec_jobs: bool = True,
        namespace: str | None = None,
        offer: Offer = NO_OFFER,
    ) -> PollResult:
        return self._poll(worker_id, queues, limit, lease_s, exec_jobs, namespace, pin=True, offer=offer)

    @retry_on_disconnect
    def _poll(
        self,
        worker_id: str,
        queues: list[str],
        limit: int,
        lease_s: float,
        exec_jobs: bool,
        namespace: str | None,
        *,
        pin: bool,
        offer: Offer = NO_OFFER,
    ) -> PollResult:
        req = PollRequest(worker_id, queues, limit, lease_s, exec_jobs, namespace, offer=offer)
        with self.db.tx(write=True) as conn:
            got = self._poll_in(conn, req, time.time(), pin=pin)
        self._notify(*(f"inv:{i.invocation_id}" for i in got.invocations))
        return got

    def _poll_in(
        self,
        conn: Connection,
        req: PollRequest,
        now: float,
        *,
        pin: bool,
        duties: tuple[list[Command], str | None] | None = None,
        claimed: list[Invocation] | None = None,
        offer_written: bool = False,
    ) -> PollResult:
        """One poll pass in the caller's transaction (the waiters of what it claimed are the
        caller's to notify, after the commit). ``duties``: its commands and pinned version, when
        the caller took them for the whole batch (``_duties_in``). ``claimed``: what its claim
        took already (``_claim_on_insert_in``, pipelined.py), when it did. ``offer_written``: the
        free GPUs it leaves are written already (pipelined.py)."""
        if duties is not None:
            commands, pinned = duties
        else:
            commands = self._take_commands_in(conn, req.worker_id, now)
        jobs: list[dict[str, Any]] = []
        if not req.queues or req.limit < 1:
            claimed = []
        else:
            if claimed is None:
                claimed = self._claim_in(
                    conn, req.worker_id, req.queues, req.limit, req.lease_s, now, req.namespace, req.offer
                )
            if req.exec_jobs and len(claimed) < req.limit:
                left = req.limit - len(claimed)
                jobs = self._claim_exec_in(
                    conn, req.worker_id, req.queues, left, now, req.namespace, req.lease_s
                )
        if not offer_written:
            taken = sum(n.gpus for i in claimed if i.shape and (n := self.shape_needs(i.queue, i.shape)))
            self._offered_in(conn, req.worker_id, max(0, req.offer.gpus - taken))  # free after this pass
        if duties is None:
            pinned = self._pinned_in(conn, req.worker_id, req.namespace) if pin else None
        return PollResult(commands, claimed, jobs, pinned)

    @retry_on_disconnect
    def heartbeat(
        self,
        worker_id: str,
        running: Sequence[tuple[str, int]],
        lease_s: float = DEFAULT_LEASE_S,
        *,
        running_exec: Sequence[tuple[str, int]] | None = None,
    ) -> tuple[list[Command], list[str]]:
        req = HeartbeatRequest(
            worker_id, list(running), lease_s, None if running_exec is None else list(running_exec)
        )
        with self.db.tx(write=True) as conn:
            got = self._heartbeat_in(conn, req, time.time(), pin=False)
        return got.commands, got.lost

    def _heartbeat_in(
        self,
        conn: Connection,
        req: HeartbeatRequest,
        now: float,
        *,
        pin: bool,
        duties: tuple[list[Command], str | None] | None = None,
    ) -> HeartbeatResult:
        """Renew both kinds of lease and take the worker's commands (and, with ``pin``, read its
        pinned version) in the caller's transaction; ``duties`` as for ``_poll_in``. An idle
        daemon's heartbeat (nothing running) renews nothing: with ``duties`` it runs no
        statement of its own."""
        wanted = {(inv_id, int(att)) for inv_id, att in req.running}
        wanted_exec = None if req.running_exec is None else {(e, int(att)) for e, att in req.running_exec}
        lease = now + req.lease_s
        renewed = self._renew_in(conn, req.worker_id, sorted(wanted), lease)
        exec_list = None if wanted_exec is None else sorted(wanted_exec)
        kept = set(renewed) | self._renew_exec_in(conn, req.worker_id, exec_list, lease)
        if duties is not None:
            commands, pinned = duties
        else:
            commands = self._take_commands_in(conn, req.worker_id, now)
            pinned = self._pinned_in(conn, req.worker_id, req.namespace) if pin else None
        lost = sorted({i for i, _ in wanted} - kept) + sorted({i for i, _ in wanted_exec or ()} - kept)
        return HeartbeatResult(commands + _cancels_again(renewed, commands), lost, pinned)

    # -- group commit ----------------------------------------------------------------------------

    def write_batch(
        self, requests: Sequence[WriteRequest], on_commit: OnCommit | None = None, *, wait: bool = True
    ) -> list[WriteResult | PlaneError]:
        """See ``api.Store.write_batch``. Each request is checked first, outside the transaction
        (a malformed one answers its PlaneError and takes no part). The writes apply in three
        transactions, each committed (and its waiters woken) before the next begins: the
        submits (and the poll passes handed them, right after them); then the acks, frames and
        other poll passes, in order; then the heartbeats. Should one
        fail (a value a column refuses, a lost connection), it is rolled back and each of its
        requests is retried alone, in a transaction of its own, so the error lands on the request
        that caused it (as a PlaneError with status 500). ``on_commit`` is called (in this
        thread) with the ``(index, answer)`` pairs of each transaction but the last once it has
        committed, so the caller may answer them before the next ones are written (the last
        transaction's answers are the return's: one wake-up of the caller fewer). Submits that
        carry a ``max_queued`` are held to it in their transaction (``_submit_many_in``); written
        alone after such a failure, a ``quota_group``'s items are each held to it alone (never
        past the quota, though no longer all or none).

        The order is latency's: a submit's wake-up, which a waiting poll claims on, and a poll's
        claim, which a daemon waits for, must not wait behind the heartbeats of a fleet batched
        with them (on PostgreSQL 30 of them took 40-100 ms); a heartbeat only has to land within
        its lease. The polls' and heartbeats' shared duties (touch the worker, take its commands,
        read its pinned version) run once per transaction for all of them (``_duties_in``).

        ``wait=False`` (the group commit on the event loop, SQLite): a transaction that finds the
        file's write lock held by another process raises :class:`WriteLockBusy` naming the writes
        not applied, instead of waiting (those of the transactions before it committed)."""
        out: list[WriteResult | PlaneError | None] = [None] * len(requests)
        groups: tuple[list[tuple[int, Any]], ...] = ([], [], [])
        for i, req in enumerate(requests):
            try:
                prepared = self._prepare_write(req)
            except PlaneError as exc:
                out[i] = exc
                continue
            except Exception as exc:  # a bug met by this write alone: its 500, never its neighbours'
                log.exception("preparing a %s failed", type(req).__name__)
                out[i] = PlaneError(f"the store failed: {type(exc).__name__}", status=500)
                continue
            if isinstance(prepared, _Prepared) or (isinstance(prepared, PollRequest) and prepared.handed):
                group = 0  # a handed pass claims in its submits' transaction, right after them
            else:
                group = 2 if isinstance(prepared, HeartbeatRequest) else 1
            groups[group].append((i, prepared))
        refused = [(i, r) for i, r in enumerate(out) if r is not None]
        if refused and on_commit is not None:
            on_commit(refused)
        todo = [live for live in groups if live]
        for n, live in enumerate(todo, 1):
            try:
                self._apply_group(requests, live, out, nowait=not wait)
            except WriteLockBusy as busy:  # these and the later transactions' writes are not applied
                raise WriteLockBusy(busy.pending + [i for group in todo[n:] for i, _ in group]) from None
            finally:
                self.db.nowait = False
            if on_commit is not None and n < len(todo):  # the last ones go back with the return
                on_commit([(i, r) for i, _ in live if (r := out[i]) is not None])
        return [r for r in out if r is not None]

    def _apply_group(
        self,
        requests: Sequence[WriteRequest],
        live: list[tuple[int, Any]],
        out: list[WriteResult | PlaneError | None],
        *,
        nowait: bool = False,
    ) -> None:
        """Apply ``live`` in one transaction into ``out``; each alone should that fail. ``nowait``:
        each transaction begins without waiting for another process's lock on a SQLite file, and
        :class:`WriteLockBusy` names the writes of ``live`` not applied when one finds it held."""
        if len(live) > 1:
            try:
                self.db.nowait = nowait
                for i, res in zip((i for i, _ in live), self._apply_writes(live), strict=True):
                    out[i] = res
                live = []
            except WriteLockBusy:  # nothing of it written: the caller writes it where it may wait
                raise WriteLockBusy([i for i, _ in live]) from None
            except Exception as exc:  # a value a column refuses, a lost connection: find whose it is
                outage = classify(exc)
                if outage is not None:  # the store is down: no write of it can be applied alone
                    for i, _ in live:
                        out[i] = outage
                    return
                log.warning(
                    "a group commit of %d writes failed; retrying each alone", len(live), exc_info=True
                )
        for k, (i, prepared) in enumerate(live):
            try:
                self.db.nowait = nowait
                out[i] = self._apply_writes([(i, prepared)])[0]
            except WriteLockBusy:  # this one and those after it are not applied
                raise WriteLockBusy([j for j, _ in live[k:]]) from None
            except Exception as exc:
                outage = classify(exc)
                if outage is None:
                    log.exception("a %s failed in the store", type(requests[i]).__name__)
                out[i] = outage or PlaneError(f"the store failed: {type(exc).__name__}", status=500)

    def _prepare_write(self, req: WriteRequest) -> Any:
        if isinstance(req, SubmitRequest):
            return self._prepare_submit(req)
        if isinstance(req, AckRequest):
            return self._prepare_ack(req)
        if isinstance(req, FrameRequest):
            return self._prepare_frame(req)
        if isinstance(req, FramesRequest):
            return self._prepare_frames(req)
        if isinstance(req, (HeartbeatRequest, PollRequest)):
            return req
        raise TypeError(f"not a write of a group commit: {type(req).__name__}")

    @retry_on_disconnect
    def _apply_writes(self, batch: Sequence[tuple[int, Any]]) -> list[WriteResult | PlaneError]:
        """One transaction: the submits (one multi-row insert), then the other writes in order
        (``write_steps``: each run of acks as one ``_ack_many_in``, the polls of other workers it
        passes after it); the waiters are woken after the commit. On PostgreSQL a batch of polls
        and acks alone (a busy daemon's) sends its statements in one pipeline (``send_plain``)."""
        submits = [(k, p) for k, (_, p) in enumerate(batch) if isinstance(p, _Prepared)]
        results: list[WriteResult | PlaneError | None] = [None] * len(batch)
        channels: list[str] = []
        requeued: list[str] = []
        now = time.time()
        daemons = [
            (k, p)
            for k, (_, p) in enumerate(batch)
            if isinstance(p, HeartbeatRequest) or (isinstance(p, PollRequest) and p.duties)
        ]
        # submits whose rows are all they write (one statement: ``_submit_many_in``), or a lone
        # ack that is one UPDATE: their own transaction (PostgreSQL: one round trip, not three;
        # SQLite's are calls: ``tx`` ignores it there)
        single = False
        if self.db.dialect == "postgresql":
            if submits:
                single = len(submits) == len(batch) <= ROWS_MAX and all(
                    self._lone_insert(p) for _, p in submits
                )
            else:
                single = len(batch) == 1 and self._lone_ack(batch[0][1])
        # a lone submit and the pass it was handed, nothing else: the pass may claim it by its
        # insert (``_claim_on_insert_in``), else each is written as usual
        on_insert: tuple[int, PollRequest] | None = None
        if len(submits) == 1 and len(batch) == 2:
            k = 1 - submits[0][0]
            q = batch[k][1]
            if isinstance(q, PollRequest) and self._claimable_on_insert(submits[0][1], q):
                on_insert = (k, q)
        early: dict[int, list[Invocation]] = {}  # what a pass claimed by its submit's insert

        # (tentative: a shape or limit its submits named is forgotten should it roll back)
        def answer_acks(run: list[tuple[int, AckRequest]], acked: Sequence[AckResult]) -> None:
            for (j, req), ack in zip(run, acked, strict=True):
                results[j] = ack
                if ack.ok and not ack.duplicate:
                    channels.append(f"inv:{req.invocation_id}")
                    if ack.freed is not None:  # room under a limit
                        requeued.extend(freed_channels(ack.freed))
                if ack.requeued:  # a retry claimable now: one wake per invocation
                    requeued.extend(
                        invocation_channels(
                            ack.requeued_namespace or DEFAULT_NAMESPACE, ack.requeued, ack.requeued_shape
                        )
                    )

        steps = write_steps(batch)
        pending: Pending | None = None  # (the plain daemon transaction on PostgreSQL: one round trip)
        answered: Answers | None = None
        preps = [p for _, p in submits]
        submitted: list[SubmitResult | PlaneError] = []
        try:
            with self._placer.tentative(), self.db.tx(write=True, single=single) as conn:
                if not submits and not single:  # the plain daemon transaction on PostgreSQL
                    pending = send_plain(self, conn, batch, steps, daemons, now)
                    answered = pending.read(self, conn, now) if pending is not None else None
                if answered is not None:
                    duties, early = answered.duties, answered.claimed
                elif daemons:
                    asks = [(p.worker_id, p.namespace) for _, p in daemons]
                    duties = dict(zip((k for k, _ in daemons), self._duties_in(conn, asks, now), strict=True))
                else:
                    duties = {}
                got = self._claim_on_insert_in(conn, preps[0], on_insert[1], now) if on_insert else None
                if got is not None and on_insert is not None:
                    submitted = [got[0]]
                    early[on_insert[0]] = got[1]
                else:
                    submitted = self._submit_many_in(conn, preps, now) if preps else []
                for (k, _), res in zip(submits, submitted, strict=True):
                    results[k] = res

                def write(k: int, p: Any) -> None:
                    if isinstance(p, FrameRequest):
                        chunk = self._append_frame_in(conn, p, now)
                        results[k] = chunk
                        if chunk.ok and not chunk.duplicate:
                            channels.append(frame_channel(p.owner_id))
                    elif isinstance(p, FramesRequest):
                        chunks = self._append_frames_in(conn, p, now)
                        results[k] = FramesResult(chunks)
                        if any(c.ok and not c.duplicate for c in chunks):
                            channels.append(frame_channel(p.invocation_id))
                    elif isinstance(p, HeartbeatRequest):
                        results[k] = self._heartbeat_in(conn, p, now, pin=True, duties=duties[k])
                    elif isinstance(p, PollRequest):
                        polled = self._poll_in(
                            conn,
                            p,
                            now,
                            pin=True,
                            duties=duties.get(k, ([], None)),
                            claimed=early.get(k),
                            offer_written=pending is not None,
                        )
                        results[k] = polled
                        channels.extend(f"inv:{i.invocation_id}" for i in polled.invocations)

                for run, writes in steps:  # (``write_steps``: a run of acks together, then the rest)
                    if run and answered is None:
                        answer_acks(run, self._ack_many_in(conn, [a for _, a in run], now))
                    elif (
                        run and answered is not None and run[0][0] in answered.acked
                    ):  # (else read back below)
                        answer_acks(run, [answered.acked[j] for j, _ in run])
                    for k, p in writes:
                        write(k, p)
        except Exception as exc:
            if pending is None or not pending.committed:
                raise
            # committed already: never to be written again (its polls would claim again)
            log.exception("answering a committed transaction of %d writes failed", len(batch))
            for k, (_, p) in enumerate(batch):
                if results[k] is None:
                    results[k] = PlaneError(f"the store failed: {type(exc).__name__}", status=500)
                if isinstance(p, AckRequest):  # (a wake-up too many is harmless; one too few is not)
                    channels.append(f"inv:{p.invocation_id}")
        for run in answered.unread if answered is not None else ():
            self._read_back(run, now, results, answer_acks, channels)
        wakes: list[str] = []
        if preps:
            handed = {i for _, p in batch if isinstance(p, PollRequest) for i in p.handed}
            wakes, changed = self._submitted(preps, submitted, handed)
            channels[:0] = changed  # (a submit a pass claimed changed once: one inv:<id>)
        self._notify(*wakes, *dict.fromkeys(channels), *requeued)
        return [r for r in results if r is not None]

    def _read_back(
        self,
        run: list[tuple[int, AckRequest]],
        now: float,
        results: list[WriteResult | PlaneError | None],
        answer: Callable[[list[tuple[int, AckRequest]], Sequence[AckResult]], None],
        channels: list[str],
    ) -> None:
        """Which acks of ``run`` applied in a transaction committed already and why the others did
        not (``_acks_checked_in``), read in a transaction of its own (see pipelined.py); should
        that read fail, each answers the store's error (the rest of its batch stands), and each
        call's waiters are woken all the same (some of them did apply)."""
        try:
            with self.db.tx(write=False) as conn:
                acked = self._acks_checked_in(conn, [a for _, a in run], now)
        except Exception as exc:
            failed = classify(exc)
            if failed is None:
                log.exception("reading back %d acks failed", len(run))
            for j, req in run:
                results[j] = failed or PlaneError(f"the store failed: {type(exc).__name__}", status=500)
                channels.append(f"inv:{req.invocation_id}")
            return
        answer(run, acked)

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        with self.db.tx(write=True) as conn:
            cancelled, requeued, failed = self._expire_in(conn, now)
            due = self._release_in(conn, now)
            exec_requeued, exec_failed = self._expire_exec_in(conn, now)
        ids = [r.invocation_id for r in (*cancelled, *requeued, *failed)]
        exec_ids = [r.exec_id for r in (*exec_requeued, *exec_failed)]
        if ids or exec_ids:
            log.info(
                "lease expired: %d requeued, %d failed, %d cancelled; exec jobs: %d requeued, %d failed",
                len(requeued),
                len(failed),
                len(cancelled),
                len(exec_requeued),
                len(exec_failed),
            )
        if due:
            log.debug("%d retries due: claimable again", len(due))
        self._notify(
            # one per invocation: the poll hub wakes one poll each
            *(c for r in requeued for c in invocation_channels(r.namespace, r.queue, r.shape)),
            *(c for r in due for c in invocation_channels(r.namespace, r.queue, r.shape)),
            *(f"inv:{r.invocation_id}" for r in due),
            *(f"inv:{i}" for i in ids),
            *(
                f"worker:{r.worker_id}" if r.worker_id else exec_queue_channel(r.namespace, r.queue)
                for r in exec_requeued
            ),
            *(f"exec:{i}" for i in exec_ids),
        )
        return ids + exec_ids


def _conforms(store: SqlStore) -> Store:
    """Never called: makes mypy check SqlStore against the Store protocol."""
    return store
