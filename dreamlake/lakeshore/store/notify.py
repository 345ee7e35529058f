"""In-process wake-ups: the store says "something changed on this channel", waiters wake.

Channels the store notifies (after the transaction commits):

- ``queue:<name>``  work became claimable on that queue: a submit, a lease-expiry requeue, or a
  new exec job.
- ``inv:<id>``      an invocation changed state (claim, ack, cancel, expiry) or got a frame.
- ``topic:<name>``  a frame was posted to the topic (the frames' owner_id, ``topic:<name>``).
- ``worker:<id>``   a cancel command was queued for that worker, or an exec job targets it.
- ``exec:<id>``     an exec job's result was published.

A notification is a hint, never the data: a woken waiter re-reads the store. To close the gap
between "read the store, found nothing" and "start waiting", take ``mark()`` before the read and
pass it as ``since``: a notification after the mark wakes the wait at once. Only this process is
woken; several control-plane replicas over one PostgreSQL still see each other's changes on their
next poll (waits always carry a timeout).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Iterable

MAX_CHANNELS = 10_000  # recent channels remembered for ``since`` checks


class Notifier:
    """Thread-safe channel notifications with blocking and asyncio waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq = 0
        self._last: OrderedDict[str, int] = OrderedDict()
        self._async: list[tuple[asyncio.AbstractEventLoop, asyncio.Event, frozenset[str]]] = []

    def mark(self) -> int:
        """The current position; pass it as ``since`` to a later wait."""
        with self._cond:
            return self._seq

    def notify(self, channel: str) -> None:
        with self._cond:
            self._seq += 1
            self._last[channel] = self._seq
            self._last.move_to_end(channel)
            while len(self._last) > MAX_CHANNELS:
                self._last.popitem(last=False)
            self._cond.notify_all()
            waiters = [(loop, ev) for loop, ev, chans in self._async if channel in chans]
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # the waiter's loop is closed; nothing to wake
                pass

    def _fired(self, channels: frozenset[str], since: int) -> bool:
        return any(self._last.get(c, 0) > since for c in channels)

    def wait(self, channels: Iterable[str], timeout: float | None, since: int | None = None) -> bool:
        """Block until one of ``channels`` is notified after ``since`` (default: now) or timeout.

        Returns True when woken by a notification, False on timeout."""
        chans = frozenset(channels)
        with self._cond:
            mark = self._seq if since is None else since
            return self._cond.wait_for(lambda: self._fired(chans, mark), timeout)

    async def wait_async(
        self, channels: Iterable[str], timeout: float | None, since: int | None = None
    ) -> bool:
        """The asyncio form of ``wait``: the event loop is never blocked."""
        chans = frozenset(channels)
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        entry = (loop, ev, chans)
        with self._cond:
            if since is not None and self._fired(chans, since):
                return True
            self._async.append(entry)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._cond:
                self._async.remove(entry)
