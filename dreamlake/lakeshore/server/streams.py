"""Frame streams: ``GET .../result/stream`` and ``GET /v1/producer/topics/:name/stream``.

Frames are written verbatim (``application/x-msgpack-stream``, no delimiter), those already at
hand together in one chunk (a journal page, or what waits in the live buffer). A follower first
subscribes to the live fan-out of its owner (one subscription, one bounded buffer, per follower:
:mod:`~dreamlake.lakeshore.server.fanout`; in process, or over Redis across replicas), then replays
the journal from ``since``, then takes frames from the subscription in memory, skipping seqs it has
sent. It goes back to the journal only when the live feed cannot be trusted to be complete: a lag
(the follower fell behind its buffer), a poke (an ack, or a frame too big for Redis), a gap in the
seqs, or a second of silence (writes through another replica without Redis). A follower that falls
behind therefore never slows the writer or the other followers; it catches up from the journal.
A fan-out without ``subscribe`` (or a dead one) leaves the follower on the journal, woken by the
store notifier.

A stream ends on a final frame (END / ERROR), on a terminal invocation with no further frames,
after ``timeout`` seconds without a frame, or when the server shuts down (within ``recheck_s``);
the client tells silence from END because no final frame came. A store outage mid-stream ends it
the same way (the client's next request meets the outage's 503).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.fanout import POKE
from dreamlake.lakeshore.store.api import TERMINAL_STATES
from dreamlake.lakeshore.store.outage import StoreOutage

log = logging.getLogger(__name__)

PAGE = 1000
CHUNK = 256 * 1024  # frames waiting in a follower's buffer go out together, up to this many bytes


class _Cursor:
    """What a follower has sent: the last seq, and whether the stream is over."""

    def __init__(self, since: int) -> None:
        self.last = since
        self.done = False

    def take(self, seq: int, final: bool) -> bool:
        """True when the frame ``seq`` is the next to send (and marks it sent)."""
        if seq <= self.last or self.done:
            return False
        self.last = seq
        self.done = final
        return True


async def _replay(ctx: Context, owner_id: str, cur: _Cursor) -> AsyncIterator[bytes]:
    """The journal's frames after the cursor, a page per chunk, until the end or a final frame."""
    while not cur.done:
        frames = await ctx.call(ctx.store.read_frames, owner_id, cur.last, PAGE)
        chunk: list[bytes] = []
        for frame in frames:
            if cur.take(frame.seq, frame.final):
                chunk.append(frame.data)
                if cur.done:
                    break
        if chunk:
            yield b"".join(chunk)
        if len(frames) < PAGE:
            return


async def _ended(ctx: Context, owner_id: str, cur: _Cursor, invocation: bool) -> AsyncIterator[bytes]:
    """For an invocation in a terminal state: the frames that raced the state check, then done."""
    if not invocation:
        return
    inv = await ctx.call(ctx.store.get, owner_id)
    if inv is None or inv.state in TERMINAL_STATES:
        async for data in _replay(ctx, owner_id, cur):
            yield data
        cur.done = True


async def _catch_up(ctx: Context, owner_id: str, cur: _Cursor, invocation: bool) -> AsyncIterator[bytes]:
    """The journal past ``cur``; when it held nothing new, the end an ended invocation left."""
    sent = cur.last
    async for data in _replay(ctx, owner_id, cur):
        yield data
    if not cur.done and cur.last == sent:
        async for data in _ended(ctx, owner_id, cur, invocation):
            yield data


async def follow(
    ctx: Context, owner_id: str, channel: str, since: int, timeout: float, *, invocation: bool
) -> AsyncIterator[bytes]:
    """Yield the encoded frames of ``owner_id`` with seq > ``since``, as the module docstring says.
    A store outage met once the answer has begun ends the stream there, as silence does (no final
    frame: the client resumes from its last seq, and its next request meets the outage's 503)."""
    try:
        async for data in _follow(ctx, owner_id, channel, since, timeout, invocation=invocation):
            yield data
    except StoreOutage:
        return  # counted and logged once by ctx.outages


async def _follow(
    ctx: Context, owner_id: str, channel: str, since: int, timeout: float, *, invocation: bool
) -> AsyncIterator[bytes]:
    fanout = ctx.fanout
    if fanout is None or not hasattr(fanout, "subscribe"):
        async for data in _follow_journal(ctx, owner_id, channel, since, timeout, invocation=invocation):
            yield data
        return
    cur = _Cursor(since)
    idle_until = time.monotonic() + timeout
    async with fanout.subscribe(owner_id) as sub:  # before the replay: no frame falls in between
        stale = True  # the journal may hold frames the subscription will not deliver
        while not cur.done:
            if stale:
                sent = cur.last
                async for data in _catch_up(ctx, owner_id, cur, invocation):
                    yield data
                if cur.done:
                    return
                if cur.last != sent:
                    idle_until = time.monotonic() + timeout
                stale = False
            if not sub.live:  # the live feed died: the journal alone, from here
                async for data in _follow_journal(ctx, owner_id, channel, cur.last, max(0.0, idle_until - time.monotonic()), invocation=invocation):  # fmt: skip
                    yield data
                return
            remaining = idle_until - time.monotonic()
            if remaining <= 0 or ctx.closing:  # the server stops: the client resumes elsewhere
                return
            item = await sub.get(timeout=min(remaining, ctx.config.recheck_s))
            if item is None:  # silence, lag or a dead backend: the journal knows
                stale = True
                continue
            chunk: list[bytes] = []
            size = 0
            while True:  # this item and those already waiting, sent as one chunk
                seq, data, final = item
                if seq == POKE or seq > cur.last + 1:  # a poke, or a gap: re-read the journal
                    stale = True
                    break
                if cur.take(seq, final):
                    chunk.append(data)
                    size += len(data)
                if cur.done or size >= CHUNK or not sub.ready():
                    break
                item = await sub.get(timeout=0)
                if item is None:  # a lag: the journal knows
                    stale = True
                    break
            if chunk:
                idle_until = time.monotonic() + timeout
                yield b"".join(chunk)


async def _follow_journal(
    ctx: Context, owner_id: str, channel: str, since: int, timeout: float, *, invocation: bool
) -> AsyncIterator[bytes]:
    """Follow the journal alone: re-read it whenever the store notifier wakes ``channel``, and
    about once a second (writes through other replicas wake nothing here)."""
    cur = _Cursor(since)
    idle_until = time.monotonic() + timeout
    while True:
        mark = ctx.wake.mark()
        sent = cur.last
        async for data in _catch_up(ctx, owner_id, cur, invocation):
            yield data
        if cur.done:
            return
        if cur.last != sent:
            idle_until = time.monotonic() + timeout
        remaining = idle_until - time.monotonic()
        if remaining <= 0 or ctx.closing:
            return
        await ctx.wake.wait([channel], min(remaining, ctx.config.recheck_s), since=mark)
