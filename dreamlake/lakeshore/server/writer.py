"""The group commit: the control plane's submits, acks, frames and heartbeats, many to a transaction.

A route hands its write to :meth:`GroupWriter.write` and awaits the answer. One writer task drains
the queue: it takes every write that arrived while the previous transaction was committing (up to
``max_batch``), applies them with ``store.write_batch`` in a thread of its own, and answers each
only after the transaction holding it committed (the store commits a batch's submits, then its
acks, frames and poll passes, then its heartbeats, and each is answered as soon as its own
transaction has committed). Durability is the store's, unchanged: nothing is
answered before it is written. One write's refusal (a superseded ack's 409, a submit's clash) is
that write's answer alone; the store isolates a failing write from the others of its batch.
A store outage (store/outage.py) is every write's 503, not a 500 and a traceback: the writer
tells :class:`~dreamlake.lakeshore.store.outage.Outages` of each commit that met one, and of each
that succeeded (which ends the outage).

A caller may hand several writes at once (:meth:`GroupWriter.write_many`, the submit-batch
route): they go into the same group commit, whole even past ``max_batch``, and are answered
together, each with its own result.

With ``handoff`` (the poll hub's :meth:`~.polls.PollHub.hand_off`), a batch's submits take
their waiting polls' passes along: each is written right after the submits, in their transaction,
and its answer goes straight to its poll (no wake-up, no second trip through the writer), ahead of
the submits' callers: the daemon's claim is what the call waits for next.

Where the store offers an inline lock (:meth:`~dreamlake.lakeshore.store.api.Store.inline_write_lock`:
SQLite's, whose commit is a few hundred microseconds of CPU with no network or flush to wait on), a
batch is written on the event loop itself when that lock is free: the hop to the writer's thread
and back (two wake-ups, the GIL handed over twice) cost as much CPU as the write. When the lock is
held (a lease sweep or a checkpoint writing in another thread) the batch goes to the writer's
thread as before, so the loop never waits on a lock. PostgreSQL offers none, and a server of
several worker processes (``--workers``) turns it off: there a sibling holds SQLite's file lock
half the time. On the loop the store begins each transaction without waiting for the file lock
(``write_batch(wait=False)``): should another process hold it (``lakeshore gc``, an admin
command's token or pin), it raises ``WriteLockBusy`` with the writes not yet applied, and those go
to the writer's thread, which waits; the loop goes on serving meanwhile.

Under load the batches grow by themselves (the longer a commit takes, the more writes wait for the
next one); an idle server commits each write at once, in a batch of one. On the loop that growth
stalls: while the loop commits, the requests that arrive wait unread in their sockets, and the
writer, woken by the first of them to reach it, would commit that one before the loop had read
the others (under 4 closed-loop producers, 1.6 submits a transaction). So once a batch written on
the loop held writes of several callers, the next batch waits ``GATHER_TURNS`` turns of the loop
before it is taken (the requests already read reach the writer; an idle turn of uvloop is about
1 us), which fills it (4 a transaction there; a transaction's fixed cost, most of a lone submit's,
shared again). A batch of one caller's writes turns the wait off: a lone caller (the warm path, an
idle server) is written at once, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.store.api import (
    AckRequest,
    FrameRequest,
    FramesRequest,
    HeartbeatRequest,
    PollRequest,
    Store,
    SubmitRequest,
    WriteRequest,
    WriteResult,
)
from dreamlake.lakeshore.store.outage import Outages, StoreOutage, WriteLockBusy, classify

log = logging.getLogger(__name__)

MAX_BATCH = 256  # writes per transaction at most
MAX_BEATS = 32  # heartbeats per transaction at most (a claim waits for at most that many)
GATHER_TURNS = 2  # loop turns a batch on the loop waits for more writes, while they come together
BEAT_PATIENCE_S = 0.5  # the longest a heartbeat is set aside while other writes keep coming
_KINDS = {
    SubmitRequest: "submit",
    AckRequest: "ack",
    FrameRequest: "frame",
    FramesRequest: "frames",
    HeartbeatRequest: "heartbeat",
    PollRequest: "poll",
}  # the ``kind`` label of lakeshore_write_seconds

# A batch's submits -> the poll passes handed them, each with what to call with its answer
Handoff = Callable[[Sequence[SubmitRequest]], list[tuple[PollRequest, Callable[[Any], None]]]]


class _Handed:
    """Where a handed poll pass's answer goes: to its poll the moment the answer is set, with no
    future and no callback a loop turn later. It stands in a batch where a caller's future does
    (``done``, ``set_result``), ahead of the batch's callers (see ``GroupWriter._commit``)."""

    __slots__ = ("_deliver", "_done")

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self._deliver = deliver
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, results: list[Any]) -> None:
        self._done = True
        try:
            self._deliver(results[0])
        except Exception:  # the poll's own failure, never the writer's or its batch's
            log.exception("delivering a handed poll pass failed")


class _Settling:
    """A caller's future with ``settle`` called on its writes' results first, the moment the
    writer answers them (on the loop, before the caller's own continuation, a loop turn later):
    an ack's outcome goes to the producers waiting on it at its commit (``daemon_acks``)."""

    __slots__ = ("_fut", "_settle")

    def __init__(self, fut: asyncio.Future[list[Any]], settle: Callable[[list[Any]], None]) -> None:
        self._fut = fut
        self._settle = settle

    def done(self) -> bool:
        return self._fut.done()

    def set_result(self, results: list[Any]) -> None:
        try:
            self._settle(results)
        except Exception:  # the caller's own failure, never the writer's or its batch's
            log.exception("settling a write's results failed")
        self._fut.set_result(results)


# One caller's writes (one, or a batch route's many: they land in one transaction together), and
# where their answers go
_Item = tuple[list[WriteRequest], "asyncio.Future[list[WriteResult | PlaneError]] | _Handed | _Settling"]


class _Answers:
    """The answers of one group commit, by the index of each write in it: a caller's future is
    set once all of its writes are answered (a batch route's submits commit together, so they are
    answered together)."""

    def __init__(self, batch: list[_Item]) -> None:
        self.futures = [fut for _, fut in batch]
        self.owner: list[int] = []  # write index -> the caller it belongs to
        self.results: list[list[Any]] = []
        self.left: list[int] = []
        self.offset: list[int] = []
        for k, (reqs, _) in enumerate(batch):
            self.offset.append(len(self.owner))
            self.owner += [k] * len(reqs)
            self.results.append([None] * len(reqs))
            self.left.append(len(reqs))

    def answer(self, pairs: list[tuple[int, Any]]) -> None:
        for i, result in pairs:
            k = self.owner[i]
            slot = i - self.offset[k]
            if self.results[k][slot] is None:
                self.results[k][slot] = result
                self.left[k] -= 1
            if self.left[k] == 0 and not self.futures[k].done():  # a caller that went away gets nothing
                self.futures[k].set_result(self.results[k])


class GroupWriter:
    """Commits the writes of one event loop in batches (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        max_batch: int = MAX_BATCH,
        observe: Any = None,
        timed: Any = None,
        handoff: Handoff | None = None,
        outages: Outages | None = None,
        inline_lock: threading.RLock | None = None,
    ) -> None:
        self._store = store
        # taken without waiting: held, the batch is written on the loop (see the module docstring)
        self.inline_lock = inline_lock
        self._outages = outages  # told of each commit that failed for a store outage, or succeeded
        self._handoff = handoff
        self._max = max(1, max_batch)
        self._observe = observe  # called with each batch's size (a histogram's ``observe``)
        # called with a write's kind and its seconds from queued to answered (a labelled histogram)
        self._timed = timed
        self._queue: asyncio.Queue[_Item | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lakeshore-writer")
        self._closed = False
        # the last batch written on the loop held several callers' writes: the next one waits
        # GATHER_TURNS loop turns for the writes on their way (see the module docstring)
        self._gather = False

    async def write(self, request: WriteRequest) -> WriteResult:
        """Queue ``request`` for the next group commit; its result once committed. Raises the
        PlaneError the store answered for this write (a refusal, or a store failure as a 500)."""
        (result,) = await self.write_many([request])
        if isinstance(result, PlaneError):
            raise result
        return result

    async def write_many(
        self, requests: list[WriteRequest], settle: Callable[[list[Any]], None] | None = None
    ) -> list[WriteResult | PlaneError]:
        """Queue ``requests`` for the next group commit, all in the same one (a batch may pass
        ``max_batch`` by itself: it is never split); each one's result, or the PlaneError the store
        answered for it, in order, once committed. ``settle``, when given, is called with those
        results on the loop as the writer answers them, before this returns (a loop turn later)."""
        if self._closed:
            raise PlaneError("the control plane is shutting down; retry", status=503)
        if not requests:
            return []
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._queue))
        fut: asyncio.Future[list[WriteResult | PlaneError]] = asyncio.get_running_loop().create_future()
        queued = time.monotonic()
        self._queue.put_nowait((list(requests), fut if settle is None else _Settling(fut, settle)))
        results = await fut
        if self._timed is not None:
            took = time.monotonic() - queued
            for request in requests:
                self._timed(_KINDS.get(type(request), "other"), took)
        return results

    async def _run(self, queue: asyncio.Queue[_Item | None]) -> None:
        """Take what has arrived, commit it, answer it; heartbeats wait for a quiet moment.

        A heartbeat only has to land within its lease (tens of seconds), while a submit's wake-up
        and a poll's claim are what a producer and a daemon wait on: a fleet's heartbeats (100 a
        second at 1,000 nymphs) must not hold the one writer while a claim waits. So writes that
        are only heartbeats are set aside, committed once nothing else is waiting, at most
        ``MAX_BEATS`` to a transaction, and never later than ``BEAT_PATIENCE_S``."""
        loop = asyncio.get_running_loop()
        stopping = False
        beats: deque[tuple[float, _Item]] = deque()  # heartbeats set aside, oldest first
        while not stopping or beats:
            batch: list[_Item] = []
            if not stopping and (not beats or not queue.empty()):
                item = await queue.get()
                if self._gather and item is not None:  # writes come together: let the next ones in
                    for _ in range(GATHER_TURNS):
                        await asyncio.sleep(0)
                if item is None:
                    stopping = True
                else:
                    batch.append(item)
                    size = len(item[0])
                    while size < self._max and not queue.empty():
                        nxt = queue.get_nowait()
                        if nxt is None:
                            stopping = True
                            break
                        batch.append(nxt)
                        size += len(nxt[0])
            now = time.monotonic()
            urgent = []
            for item in batch:
                if all(isinstance(req, HeartbeatRequest) for req in item[0]):
                    beats.append((now, item))
                else:
                    urgent.append(item)
            if urgent:
                await self._commit(loop, urgent)
                self._gather = self.inline_lock is not None and (len(urgent) > 1 or not queue.empty())
                overdue = beats and now - beats[0][0] > BEAT_PATIENCE_S
                if not queue.empty() and not stopping and not overdue:
                    continue  # more arrived meanwhile: it goes before the heartbeats
            if beats:
                take = [beats.popleft()[1] for _ in range(min(MAX_BEATS, len(beats)))]
                await self._commit(loop, take)

    async def _commit(self, loop: asyncio.AbstractEventLoop, batch: list[_Item]) -> None:
        """One ``store.write_batch`` of ``batch`` in the writer's thread; each caller answered as
        its writes' transaction commits."""
        submits = (
            [r for reqs, _ in batch for r in reqs if isinstance(r, SubmitRequest)] if self._handoff else []
        )
        if submits:
            assert self._handoff is not None
            try:
                handoffs = self._handoff(submits)
            except Exception:  # never the writer's end: the submits' wakes go out as usual
                log.exception("handing %d submits to waiting polls failed", len(submits))
                handoffs = []
            # first in the batch: answered before its submits' callers, so the daemon waiting on
            # a claim gets it before the submit routes go on (a submit-and-wait goes on to wait for
            # the very call the daemon is about to run). The store still writes the passes after
            # the submits (each group's submits go first).
            handed: list[_Item] = [([request], _Handed(deliver)) for request, deliver in handoffs]
            batch = [*handed, *batch]
        size = sum(len(reqs) for reqs, _ in batch)
        if self._observe is not None:
            self._observe(size)
        await self._write(loop, batch)

    async def _write(self, loop: asyncio.AbstractEventLoop, batch: list[_Item]) -> None:
        """``store.write_batch`` of ``batch``; should the store raise outside any one write (a
        bug a hostile value met), each caller not answered yet is written again alone, so the
        error is its own and never its neighbours' (the store isolates the writes it knows fail)."""
        answers = _Answers(batch)
        writes = [req for reqs, _ in batch for req in reqs]
        indexes: Sequence[int] = range(len(writes))  # which writes ``results`` answers

        def committed(pairs: list[tuple[int, Any]]) -> None:
            # in the store's thread: answer one committed transaction's writes on the loop now,
            # ahead of the batch's later transactions (a poll's claim before the heartbeats)
            loop.call_soon_threadsafe(answers.answer, pairs)

        try:
            lock = self.inline_lock
            if lock is not None and lock.acquire(blocking=False):
                busy: WriteLockBusy | None = None
                try:  # on the loop: each transaction's answers as it commits, no thread hop
                    results = self._store.write_batch(writes, answers.answer, wait=False)
                except WriteLockBusy as exc:  # another process writes the file: wait in the thread
                    busy = exc
                finally:
                    lock.release()
                if busy is not None:
                    pending = busy.pending
                    rest = [writes[i] for i in pending]

                    def rest_committed(pairs: list[tuple[int, Any]]) -> None:
                        committed([(pending[j], r) for j, r in pairs])

                    results = await loop.run_in_executor(
                        self._pool, self._store.write_batch, rest, rest_committed
                    )
                    indexes = pending  # the others were answered as their transactions committed
            else:
                results = await loop.run_in_executor(self._pool, self._store.write_batch, writes, committed)
        except Exception as exc:  # the store raised outside any one write
            failed: PlaneError | None = classify(exc)  # an outage: all fail, 503 (Outages logs it once)
            if failed is None and len(batch) > 1:  # one write's fault: each caller's again, alone
                log.warning(
                    "a group commit of %d writes failed (%s); writing each caller's alone",
                    len(writes),
                    type(exc).__name__,
                )
                # the callers first, then the handed passes (first in the batch, to be answered
                # first): a pass written alone before its submit would find nothing to claim
                for item in sorted(batch, key=lambda it: isinstance(it[1], _Handed)):
                    if not item[1].done():  # answered already: its transaction committed
                        await self._write(loop, [item])
                return
            if failed is None:
                log.exception("a group commit of %d writes failed", len(writes))
                failed = PlaneError(f"the store failed: {type(exc).__name__}", status=500)
            results = [failed] * len(writes)
            indexes = range(len(writes))
        answers.answer(list(zip(indexes, results, strict=True)))
        if self._outages is not None:
            down = [r for r in results if isinstance(r, StoreOutage)]
            if down:
                self._outages.failed(down[-1], len(down))
            elif not any(isinstance(r, PlaneError) and (r.status or 500) >= 500 for r in results):
                self._outages.succeeded()  # a bug's 500 says nothing about the store coming back

    async def aclose(self) -> None:
        """Commit and answer what is queued, then stop."""
        self._closed = True
        if self._queue is not None and self._task is not None:
            self._queue.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=True)
