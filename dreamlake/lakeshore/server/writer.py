"""The group commit: the control plane's submits, acks, frames and heartbeats, many to a transaction.

A route hands its write to :meth:`GroupWriter.write` and awaits the answer. One writer task drains
the queue: it takes every write that arrived while the previous transaction was committing (up to
``max_batch``), applies them with ``store.write_batch`` in a thread of its own, and answers each
only after the transaction holding it committed. Durability is the store's, unchanged: nothing is
answered before it is written. One write's refusal (a superseded ack's 409, a submit's clash) is
that write's answer alone; the store isolates a failing write from the others of its batch.

Under load the batches grow by themselves (the longer a commit takes, the more writes wait for the
next one); an idle server commits each write at once, in a batch of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.store.api import Store, WriteRequest, WriteResult

log = logging.getLogger(__name__)

MAX_BATCH = 256  # writes per transaction at most

# One caller's writes (one, or a batch route's many: they land in one transaction together)
_Item = tuple[list[WriteRequest], "asyncio.Future[list[WriteResult | PlaneError]]"]


class GroupWriter:
    """Commits the writes of one event loop in batches (see the module docstring)."""

    def __init__(self, store: Store, *, max_batch: int = MAX_BATCH, observe: Any = None) -> None:
        self._store = store
        self._max = max(1, max_batch)
        self._observe = observe  # called with each batch's size (a histogram's ``observe``)
        self._queue: asyncio.Queue[_Item | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lakeshore-writer")
        self._closed = False

    async def write(self, request: WriteRequest) -> WriteResult:
        """Queue ``request`` for the next group commit; its result once committed. Raises the
        PlaneError the store answered for this write (a refusal, or a store failure as a 500)."""
        (result,) = await self.write_many([request])
        if isinstance(result, PlaneError):
            raise result
        return result

    async def write_many(self, requests: list[WriteRequest]) -> list[WriteResult | PlaneError]:
        """Queue ``requests`` for the next group commit, all in the same one (a batch may pass
        ``max_batch`` by itself: it is never split); each one's result, or the PlaneError the store
        answered for it, in order, once committed."""
        if self._closed:
            raise PlaneError("the control plane is shutting down; retry", status=503)
        if not requests:
            return []
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._queue))
        fut: asyncio.Future[list[WriteResult | PlaneError]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((list(requests), fut))
        return await fut

    async def _run(self, queue: asyncio.Queue[_Item | None]) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            item = await queue.get()
            if item is None:
                break
            batch = [item]
            size = len(item[0])
            while size < self._max and not queue.empty():
                nxt = queue.get_nowait()
                if nxt is None:
                    stopping = True
                    break
                batch.append(nxt)
                size += len(nxt[0])
            if self._observe is not None:
                self._observe(size)
            writes = [req for reqs, _ in batch for req in reqs]
            try:
                results = await loop.run_in_executor(self._pool, self._store.write_batch, writes)
            except Exception as exc:  # the store raised outside any one write: all of them failed
                log.exception("a group commit of %d writes failed", len(writes))
                failed = PlaneError(f"the store failed: {type(exc).__name__}", status=500)
                results = [failed] * len(writes)
            at = 0
            for reqs, fut in batch:
                mine, at = results[at : at + len(reqs)], at + len(reqs)
                if not fut.done():  # a caller that went away (cancelled) gets nothing
                    fut.set_result(mine)

    async def aclose(self) -> None:
        """Commit and answer what is queued, then stop."""
        self._closed = True
        if self._queue is not None and self._task is not None:
            self._queue.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=True)
