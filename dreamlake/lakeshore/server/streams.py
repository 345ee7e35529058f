"""Frame streams: ``GET .../result/stream`` and ``GET /v1/producer/topics/:name/stream``.

Frames are written verbatim (``application/x-msgpack-stream``, no delimiter). A stream replays the
journal from ``since``, then follows it: it wakes on the store notifier (or the live fan-out when
one is configured), re-reads the journal, and re-checks about once a second for writes made by
other replicas. It ends on a final frame (END / ERROR), on a terminal invocation with no further
frames, or after ``timeout`` seconds without a frame; the client tells silence from END because
no final frame came.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.store.api import TERMINAL_STATES

log = logging.getLogger(__name__)

PAGE = 1000


async def _fanout_wake(ctx: Context, owner_id: str, event: asyncio.Event, stop: asyncio.Event) -> None:
    """Set ``event`` whenever the live fan-out delivers something for ``owner_id`` (a wake-up only:
    the frames themselves are always read from the journal, which has every one of them). When the
    live feed dies (Redis down), set it once more: the follower re-reads the journal at once and
    from then on follows it by re-checking every ``recheck_s``."""
    try:
        async with ctx.fanout.subscribe(owner_id) as sub:
            while sub.live and not stop.is_set():
                if await sub.get(timeout=1.0) is not None:
                    event.set()
        if not stop.is_set():
            log.warning("live fan-out follow of %s ended; following the journal only", owner_id)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.warning("live fan-out follow of %s failed; following the journal only", owner_id, exc_info=True)
    event.set()


def _cross_replica(fanout: Any) -> bool:
    """True for a fan-out that carries frames from other replicas (not the in-process one)."""
    if fanout is None or not hasattr(fanout, "subscribe"):
        return False
    from dreamlake.lakeshore.server.fanout import LocalFanout

    return not isinstance(fanout, LocalFanout)


async def follow(
    ctx: Context, owner_id: str, channel: str, since: int, timeout: float, *, invocation: bool
) -> AsyncIterator[bytes]:
    """Yield the encoded frames of ``owner_id`` with seq > ``since``, as the module docstring says."""
    last = since
    idle_until = time.monotonic() + timeout
    live = asyncio.Event()
    stop = asyncio.Event()
    live_task: asyncio.Task[Any] | None = None
    if _cross_replica(ctx.fanout):
        live_task = asyncio.create_task(_fanout_wake(ctx, owner_id, live, stop))
    try:
        while True:
            mark = ctx.wake.mark()
            live.clear()
            frames = await ctx.call(ctx.store.read_frames, owner_id, last, PAGE)
            for frame in frames:
                if frame.seq <= last:
                    continue
                last = frame.seq
                yield frame.data
                if frame.final:
                    return
            if frames:
                idle_until = time.monotonic() + timeout
                if len(frames) >= PAGE:
                    continue
            elif invocation:
                inv = await ctx.call(ctx.store.get, owner_id)
                if inv is None or inv.state in TERMINAL_STATES:
                    # Frames may have landed between the read above and the state check.
                    for frame in await ctx.call(ctx.store.read_frames, owner_id, last, PAGE):
                        if frame.seq > last:
                            last = frame.seq
                            yield frame.data
                            if frame.final:
                                return
                    return
            remaining = idle_until - time.monotonic()
            if remaining <= 0:
                return
            wait = min(remaining, ctx.config.recheck_s)
            if live_task is None:
                await ctx.wake.wait([channel], wait, since=mark)
            else:
                await _either(ctx.wake.wait([channel], wait, since=mark), live.wait(), wait)
    finally:
        if live_task is not None:
            # The stream is over: stop the live follow, but never let its shutdown hold the response
            # open (a cancel that lands inside the Redis client's blocking read can be absorbed; the
            # stop flag then ends the loop at its next read, within a second).
            stop.set()
            live_task.cancel()
            await asyncio.wait({live_task}, timeout=2.0)


async def _either(notified: Any, live: Any, timeout: float) -> None:
    tasks = [asyncio.ensure_future(notified), asyncio.ensure_future(live)]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
