"""Live fan-out of journal frames to followers: in process, or across replicas over Redis streams.

The store's ``frames`` table is the truth; fan-out only makes following fast. A writer journals
the frame row first, then calls :meth:`Fanout.publish`. A follower (the stream route)::

    async with fanout.subscribe(owner_id) as sub:   # 1. subscribe first
        replay the store from its cursor             # 2. then replay the journal
        while ...:
            item = await sub.get(timeout=1.0)        # 3. then follow live
            if item is None:                         #    silence, lag or a dead backend:
                re-read the store from the cursor    #    the store has every frame
            else:
                seq, data, final = item              #    skip seq <= cursor (dedupe is the caller's)

Subscribing before replaying leaves no gap: a frame is either in the store when the replay reads
it, or published after the subscription started. The price is duplicates, so **the caller
dedupes by seq**. A subscription sees only frames published after it started (``subscribe()``
for :class:`LocalFanout`; the first ``get`` / ``async with`` / iteration for :class:`RedisFanout`).

Writers publish a batch with :meth:`Fanout.publish_many` (one Redis round trip), and
:meth:`Fanout.poke` sends a follower the cue "re-read the store" without a frame: an item with seq
:data:`POKE` (-1). The ack route pokes (the invocation may have ended without a final frame), and
:class:`RedisFanout` sends a poke in place of a frame larger than ``inline_max`` bytes, so Redis
never holds big frames; the follower reads those from the journal.

``get(timeout)`` returns ``(seq, data, final)`` or None. None means: nothing arrived within
``timeout`` (``timeout=None`` waits for ever), *or* frames may have been missed (the subscriber
lagged: the None comes at once, and frames published later keep coming), *or* the subscription
was closed (at once). When the backend fails, the ``get`` waiting at that moment returns None at
once and ``sub.live`` turns False; later calls behave like silence: None after ``timeout``, never
with ``timeout=None``. Every None is a cue to re-read
the store. Async iteration yields ``(seq, data, final)`` and ends after a final frame, on lag, or
when the backend fails; the caller then goes back to the store.

:class:`LocalFanout` keeps one bounded asyncio queue per subscriber (one event loop). A
subscriber more than ``max_pending`` frames or ``max_pending_bytes`` bytes behind is marked
lagging: its queue is emptied, its next ``get`` returns None at once, and it must catch up from the
store (frames after that keep coming). Publishing never waits for a subscriber, so a slow follower
slows neither the writer nor the other followers. Subscriptions that are dropped without being closed are forgotten when collected.

:class:`RedisFanout` XADDs each frame to the stream ``lakeshore:frames:<owner_id>`` (MAXLEN ~
10000, a TTL refreshed on every publish) and subscribers XREAD BLOCK from the last id they saw,
so followers on any replica see frames published on any other. Any Redis error is logged and
swallowed: ``publish`` never raises, and a subscriber whose Redis fails yields nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

Item = tuple[int, bytes, bool]

DEFAULT_MAX_PENDING = 1024
DEFAULT_MAX_PENDING_BYTES = 16 * 1024 * 1024
POKE = -1  # the seq of a poke: no frame, re-read the store
INLINE_MAX = 256 * 1024  # RedisFanout: a larger frame is published as a poke
STREAM_PREFIX = "lakeshore:frames:"
STREAM_MAXLEN = 10_000
STREAM_TTL_S = 3600
_REDIS_OP_TIMEOUT_S = 2.0
_XREAD_COUNT = 256
_MAX_BLOCK_MS = 5_000


def _check_owner(owner_id: object) -> str:
    if not isinstance(owner_id, str) or not owner_id or len(owner_id) > 256:
        raise ValueError(
            f"owner_id must be a non-empty string of at most 256 characters, got {owner_id!r:.60}"
        )
    return owner_id


@runtime_checkable
class Subscription(Protocol):
    """Frames of one owner published after the subscription started (see the module docstring)."""

    @property
    def live(self) -> bool:
        """False once nothing more can arrive (closed, or the backend failed)."""
        ...

    async def get(self, timeout: float | None = None) -> Item | None:
        """The next ``(seq, data, final)``, or None on timeout, lag or a dead backend."""
        ...

    def ready(self) -> int:
        """How many items ``get`` can return without waiting (a follower batches them)."""
        ...

    async def aclose(self) -> None:
        """Stop receiving; idempotent."""
        ...

    async def __aenter__(self) -> Subscription: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def __aiter__(self) -> AsyncIterator[Item]: ...


@runtime_checkable
class Fanout(Protocol):
    """Publishes journal frames to live followers. ``publish`` never raises on a backend failure."""

    async def publish(self, owner_id: str, seq: int, data: bytes, final: bool) -> None: ...

    async def publish_many(self, owner_id: str, items: list[Item]) -> None:
        """Publish ``(seq, data, final)`` items of one owner, in order."""
        ...

    async def poke(self, owner_id: str) -> None:
        """Tell the followers of ``owner_id`` to re-read the store (an item with seq ``POKE``)."""
        ...

    def subscribe(self, owner_id: str) -> Subscription: ...

    async def aclose(self) -> None: ...


class _BaseSubscription:
    """The shared async-context-manager and async-iterator behaviour over :meth:`get`."""

    _closed = False
    _lag_signal = False

    @property
    def live(self) -> bool:
        return not self._closed

    async def get(self, timeout: float | None = None) -> Item | None:
        return await self._next(timeout)

    def ready(self) -> int:
        return 0

    async def _next(self, timeout: float | None) -> Item | None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Item]:
        while self.live:
            item = await self._next(None)
            if item is None:
                return  # lag or a dead backend: the caller goes back to the store
            yield item
            if item[2]:
                return


class LocalSubscription(_BaseSubscription):
    """One follower of :class:`LocalFanout`: a bounded queue filled by ``publish``."""

    def __init__(self, fanout: LocalFanout, owner_id: str, max_pending: int, max_bytes: int) -> None:
        self._fanout = fanout
        self.owner_id = owner_id
        self._queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=max_pending)
        self._max_bytes = max_bytes
        self._bytes = 0  # of the frames queued
        self.lagged = 0  # how many times this subscriber fell behind

    def _offer(self, item: Item) -> None:
        if self._closed:
            return
        size = len(item[1])
        if self._queue.full() or (self._bytes + size > self._max_bytes and not self._queue.empty()):
            while not self._queue.empty():
                self._queue.get_nowait()
            self._bytes = 0
            self._lag_signal = True
            self.lagged += 1
            log.warning("live follower of %s fell behind (%d frames, %d bytes); it catches up from the journal",
                        self.owner_id, self._queue.maxsize, self._max_bytes)  # fmt: skip
        self._queue.put_nowait(item)
        self._bytes += size

    def ready(self) -> int:
        return self._queue.qsize()

    def _take(self) -> Item:
        item = self._queue.get_nowait()
        self._bytes -= len(item[1])
        return item

    async def _next(self, timeout: float | None) -> Item | None:
        if self._lag_signal:
            self._lag_signal = False
            return None
        if self._closed:
            return None
        if not self._queue.empty():
            return self._take()
        if timeout is not None and timeout <= 0:
            return None
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        self._bytes -= len(item[1])
        if self._lag_signal:  # emptied while this get was waking up: the item may follow a gap
            self._lag_signal = False
            return None
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._fanout._forget(self)


class LocalFanout:
    """In-process fan-out over bounded asyncio queues; for one control-plane process (one loop)."""

    def __init__(
        self, max_pending: int = DEFAULT_MAX_PENDING, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    ) -> None:
        if max_pending < 1 or max_pending_bytes < 1:
            raise ValueError(
                f"max_pending and max_pending_bytes must be >= 1, got {max_pending}, {max_pending_bytes}"
            )
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self._subs: dict[str, weakref.WeakSet[LocalSubscription]] = {}

    async def publish(self, owner_id: str, seq: int, data: bytes, final: bool) -> None:
        await self.publish_many(owner_id, [(seq, data, final)])

    async def publish_many(self, owner_id: str, items: list[Item]) -> None:
        subs = self._subs.get(owner_id)
        if not subs:
            self._subs.pop(owner_id, None)
            return
        ready = [(int(seq), bytes(data), bool(final)) for seq, data, final in items]
        for sub in list(subs):
            for item in ready:
                sub._offer(item)

    async def poke(self, owner_id: str) -> None:
        await self.publish_many(owner_id, [(POKE, b"", False)])

    def subscribe(self, owner_id: str) -> LocalSubscription:
        sub = LocalSubscription(self, _check_owner(owner_id), self.max_pending, self.max_pending_bytes)
        self._subs.setdefault(owner_id, weakref.WeakSet()).add(sub)
        return sub

    def subscriber_count(self, owner_id: str) -> int:
        """How many live subscriptions ``owner_id`` has (for metrics and tests)."""
        return len(self._subs.get(owner_id, ()))

    def _forget(self, sub: LocalSubscription) -> None:
        subs = self._subs.get(sub.owner_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.owner_id]

    async def aclose(self) -> None:
        for subs in list(self._subs.values()):
            for sub in list(subs):
                await sub.aclose()
        self._subs.clear()


class RedisSubscription(_BaseSubscription):
    """One follower of :class:`RedisFanout`: XREAD BLOCK from the last stream id it saw."""

    def __init__(self, fanout: RedisFanout, owner_id: str) -> None:
        self._fanout = fanout
        self.owner_id = owner_id
        self._key = fanout.stream_key(owner_id)
        self._last_id: bytes | None = None  # None until started
        self._buffer: deque[Item] = deque()
        self._failed = False

    @property
    def live(self) -> bool:
        return not (self._closed or self._failed)

    def ready(self) -> int:
        return len(self._buffer)

    async def __aenter__(self) -> RedisSubscription:
        await self._start()
        return self

    async def _start(self) -> None:
        """Pin the starting point: the stream's current last id (frames after it are ours)."""
        if self._last_id is not None or not self.live:
            return
        try:
            newest = await self._fanout._sub.xrevrange(self._key, count=1)
        except Exception as exc:
            self._fail(exc)
            return
        self._last_id = newest[0][0] if newest else b"0-0"

    def _fail(self, exc: BaseException) -> None:
        self._failed = True
        log.warning("live follow of %s over Redis failed (%s); the caller follows the journal instead",
                    self.owner_id, exc)  # fmt: skip

    async def get(self, timeout: float | None = None) -> Item | None:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        failed_before = self._failed
        item = await self._next(timeout)
        if item is None and failed_before and not self._closed:
            # A dead backend behaves like silence (for the rest of the timeout, or for ever), so
            # a caller that loops on get() and re-reads the store on None does not spin. The call
            # during which it died returns at once: the caller learns of it (``live``) promptly.
            if deadline is None:
                await asyncio.Event().wait()
            else:
                await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        return item

    async def _next(self, timeout: float | None) -> Item | None:
        if self._buffer:
            return self._buffer.popleft()
        await self._start()
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while self.live:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                block_ms = None
            else:
                block_ms = (
                    _MAX_BLOCK_MS if remaining is None else max(1, min(_MAX_BLOCK_MS, int(remaining * 1000)))
                )
            try:
                answer = await self._fanout._sub.xread(
                    {self._key: self._last_id or b"0-0"}, count=_XREAD_COUNT, block=block_ms
                )
            except Exception as exc:
                self._fail(exc)
                break
            for _key, entries in answer or ():
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    item = _decode(fields)
                    if item is not None:
                        self._buffer.append(item)
            if self._buffer:
                return self._buffer.popleft()
            if block_ms is None:
                return None
        return None


def _decode(fields: dict[bytes, bytes]) -> Item | None:
    try:
        return int(fields[b"seq"]), bytes(fields[b"data"]), fields[b"final"] == b"1"
    except (KeyError, ValueError) as exc:
        log.warning("skipping a malformed fan-out entry (%s)", exc)
        return None


class RedisFanout:
    """Fan-out over Redis streams (``redis.asyncio``), shared by every control-plane replica."""

    def __init__(
        self,
        url: str,
        *,
        maxlen: int = STREAM_MAXLEN,
        ttl_s: int = STREAM_TTL_S,
        inline_max: int = INLINE_MAX,
    ) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("a Redis URL was given but redis is not installed: pip install redis") from exc
        self.url = url
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.inline_max = inline_max
        # Publishing must never stall a writer for long; following blocks in XREAD, so no read timeout.
        self._pub: Any = aioredis.Redis.from_url(
            url, socket_timeout=_REDIS_OP_TIMEOUT_S, socket_connect_timeout=_REDIS_OP_TIMEOUT_S
        )
        self._sub: Any = aioredis.Redis.from_url(url, socket_connect_timeout=_REDIS_OP_TIMEOUT_S)

    @staticmethod
    def stream_key(owner_id: str) -> str:
        return STREAM_PREFIX + owner_id

    async def publish(self, owner_id: str, seq: int, data: bytes, final: bool) -> None:
        """XADD the frame (and refresh the stream's TTL); log and swallow any Redis failure."""
        await self.publish_many(owner_id, [(seq, data, final)])

    async def publish_many(self, owner_id: str, items: list[Item]) -> None:
        """XADD the frames in one pipeline (a frame over ``inline_max`` bytes as a poke)."""
        if not items:
            return
        key = self.stream_key(owner_id)
        try:
            async with self._pub.pipeline(transaction=False) as pipe:
                for seq, data, final in items:
                    if len(data) > self.inline_max:
                        seq, data, final = POKE, b"", False
                    fields: dict[Any, Any] = {
                        b"seq": str(int(seq)).encode(),
                        b"data": bytes(data),
                        b"final": b"1" if final else b"0",
                    }
                    pipe.xadd(key, fields, maxlen=self.maxlen, approximate=True)
                pipe.expire(key, self.ttl_s)
                await pipe.execute()
        except Exception as exc:
            log.warning("live publish of %s (%d frame(s) from seq %d) to Redis failed (%s); followers catch "
                        "up from the journal", owner_id, len(items), items[0][0], exc)  # fmt: skip

    async def poke(self, owner_id: str) -> None:
        await self.publish_many(owner_id, [(POKE, b"", False)])

    def subscribe(self, owner_id: str) -> RedisSubscription:
        return RedisSubscription(self, _check_owner(owner_id))

    async def aclose(self) -> None:
        for client in (self._pub, self._sub):
            try:
                await client.aclose()
            except Exception as exc:
                log.debug("closing a Redis client failed: %s", exc)


def make_fanout(redis_url: str | None) -> Fanout:
    """RedisFanout when a Redis URL is given (several replicas), else LocalFanout (one process)."""
    if redis_url:
        return RedisFanout(redis_url)
    return LocalFanout()
