"""The group commit: the control plane's submits, acks, frames and heartbeats, many to a transaction.

A route hands its write to :meth:`GroupWriter.write` and awaits the answer. One writer task drains
the queue: it takes every write that arrived while the previous transaction was committing (up to
``max_batch``), applies them with ``store.write_batch`` in a thread of its own, and answers each
only after the transaction holding it committed (the store commits a batch's submits, then its
acks, frames and poll passes, then its heartbeats, and each is answered as soon as its own
transaction has committed). Durability is the store's, unchanged: nothing is
answered before it is written. One write's refusal (a superseded ack's 409, a submit's clash) is
that write's answer alone; the store isolates a failing write from the others of its batch.

Under load the batches grow by themselves (the longer a commit takes, the more writes wait for the
next one); an idle server commits each write at once, in a batch of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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

log = logging.getLogger(__name__)

MAX_BATCH = 256  # writes per transaction at most
_KINDS = {
    SubmitRequest: "submit",
    AckRequest: "ack",
    FrameRequest: "frame",
    FramesRequest: "frames",
    HeartbeatRequest: "heartbeat",
    PollRequest: "poll",
}  # the ``kind`` label of lakeshore_write_seconds

_Item = tuple[WriteRequest, "asyncio.Future[WriteResult | PlaneError]"]


def _answer(futures: list[asyncio.Future[Any]], pairs: list[tuple[int, Any]]) -> None:
    for i, result in pairs:
        if not futures[i].done():  # a caller that went away (cancelled) gets nothing
            futures[i].set_result(result)


class GroupWriter:
    """Commits the writes of one event loop in batches (see the module docstring)."""

    def __init__(
        self, store: Store, *, max_batch: int = MAX_BATCH, observe: Any = None, timed: Any = None
    ) -> None:
        self._store = store
        self._max = max(1, max_batch)
        self._observe = observe  # called with each batch's size (a histogram's ``observe``)
        # called with a write's kind and its seconds from queued to answered (a labelled histogram)
        self._timed = timed
        self._queue: asyncio.Queue[_Item | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lakeshore-writer")
        self._closed = False

    async def write(self, request: WriteRequest) -> WriteResult:
        """Queue ``request`` for the next group commit; its result once committed. Raises the
        PlaneError the store answered for this write (a refusal, or a store failure as a 500)."""
        if self._closed:
            raise PlaneError("the control plane is shutting down; retry", status=503)
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._queue))
        fut: asyncio.Future[WriteResult | PlaneError] = asyncio.get_running_loop().create_future()
        queued = time.monotonic()
        self._queue.put_nowait((request, fut))
        result = await fut
        if self._timed is not None:
            self._timed(_KINDS.get(type(request), "other"), time.monotonic() - queued)
        if isinstance(result, PlaneError):
            raise result
        return result

    async def _run(self, queue: asyncio.Queue[_Item | None]) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            item = await queue.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < self._max and not queue.empty():
                nxt = queue.get_nowait()
                if nxt is None:
                    stopping = True
                    break
                batch.append(nxt)
            if self._observe is not None:
                self._observe(len(batch))
            futures = [fut for _, fut in batch]

            def committed(pairs: list[tuple[int, Any]], futures: list[Any] = futures) -> None:
                # in the store's thread: answer one committed transaction's writes on the loop now,
                # ahead of the batch's later transactions (a poll's claim before the heartbeats)
                loop.call_soon_threadsafe(_answer, futures, pairs)

            try:
                results = await loop.run_in_executor(
                    self._pool, self._store.write_batch, [req for req, _ in batch], committed
                )
            except Exception as exc:  # the store raised outside any one write: all of them failed
                log.exception("a group commit of %d writes failed", len(batch))
                failed = PlaneError(f"the store failed: {type(exc).__name__}", status=500)
                results = [failed] * len(batch)
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():  # a caller that went away (cancelled) gets nothing
                    fut.set_result(result)

    async def aclose(self) -> None:
        """Commit and answer what is queued, then stop."""
        self._closed = True
        if self._queue is not None and self._task is not None:
            self._queue.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=True)
