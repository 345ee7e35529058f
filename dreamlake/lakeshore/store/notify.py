"""In-process wake-ups: the store says "something changed on this channel", waiters wake.

Channels the store notifies (after the transaction commits):

- ``queue:<name>``        an invocation became claimable on that queue: a submit or a lease-expiry
  requeue (wakes every waiter: the in-process worker of ``dispatch/local.py``).
- ``run-queue:<ns>:<q>``  the same invocation, with its namespace: the channel the poll hub routes,
  one poll per invocation, to a poll that may claim it (bound to ``<ns>``, or to no namespace).
- ``exec-queue:<ns>:<q>`` an exec job of namespace ``<ns>`` became claimable on queue ``<q>`` (one
  that targets a worker notifies ``worker:<id>`` instead: only that worker can claim it).
- ``inv:<id>``            an invocation changed state (claim, ack, cancel, expiry) or got a frame.
- ``topic:<name>``        a frame was posted to the topic (the frames' owner_id, ``topic:<name>``).
- ``worker:<id>``         a cancel command was queued for that worker, or an exec job targets it.
- ``exec:<id>``           an exec job's result was published.

A notification is a hint, never the data: a woken waiter re-reads the store. To close the gap
between "read the store, found nothing" and "start waiting", take ``mark()`` before the read and
pass it as ``since``: a notification after the mark wakes the wait at once.

``wait`` and ``wait_async`` wake every waiter of a channel (followers of one stream all want the
frame). Daemon long polls must not: one unit of work should wake one poll, so the control plane's
poll hub (``server/polls.py``) subscribes with ``add_listener`` and hands each notification to one
waiter itself. Listeners also carry notifications to other replicas (``server/relay.py``), whose
``notify(..., relayed=True)`` injects them here.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

MAX_CHANNELS = 10_000  # recent channels remembered for ``since`` checks

Listener = Callable[[str, int, bool], None]
"""``listener(channel, seq, relayed)``: called after every notification, in the notifying thread
(a store thread, or the event loop for a relayed one), outside the notifier's lock. It must be
cheap and must not block; ``relayed`` is True for a notification that came from another replica."""


def run_queue_channel(namespace: str, queue: str, shape: str = "") -> str:
    """The channel of a claimable invocation of ``namespace`` on ``queue`` (one notification per
    invocation; ``queue:<q>`` is notified beside it for waiters that serve every namespace), with
    ``:<shape>`` for one that needs something placement matches (store/placement.py)."""
    return f"run-queue:{namespace}:{queue}:{shape}" if shape else f"run-queue:{namespace}:{queue}"


def invocation_channels(namespace: str, queue: str, shape: str = "") -> tuple[str, str]:
    """What the store notifies for one invocation made claimable (a submit or a requeue)."""
    return f"queue:{queue}", run_queue_channel(namespace, queue, shape)


def exec_queue_channel(namespace: str, queue: str) -> str:
    """The channel of claimable exec jobs of ``namespace`` on ``queue``."""
    return f"exec-queue:{namespace}:{queue}"


class Notifier:
    """Thread-safe channel notifications with blocking and asyncio waits, and listeners."""

    def __init__(self) -> None:
        # one plain lock, taken directly (a ``Condition``'s ``with`` runs two Python calls around
        # it, and a notify_all with no thread waiting still walks its waiters in Python): the
        # condition over it is for blocking ``wait``s alone, notified only while one waits
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._blocked = 0  # threads in ``wait``
        self._seq = 0
        self._last: OrderedDict[str, int] = OrderedDict()
        self._forgot = 0  # the position of the newest channel forgotten (past MAX_CHANNELS)
        # asyncio waiters by channel: a notification looks up its own, never scans them all
        self._async: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]]] = {}
        self._listeners: tuple[Listener, ...] = ()

    def mark(self) -> int:
        """The current position; pass it as ``since`` to a later wait."""
        with self._lock:
            return self._seq

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def notify(self, channel: str, *, relayed: bool = False) -> None:
        self.notify_many((channel,), relayed=relayed)

    def notify_many(self, channels: Iterable[str], *, relayed: bool = False) -> None:
        """``notify`` each of ``channels``, in order, under one take of the lock (a transaction's
        wake-ups together); the waiters and listeners of each are called after, in that order."""
        heard: list[tuple[str, int, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]]]] = []
        with self._lock:
            last, waiting = self._last, self._async
            for channel in channels:
                self._seq += 1
                last[channel] = self._seq
                last.move_to_end(channel)
                heard.append((channel, self._seq, list(waiting[channel]) if channel in waiting else []))
            if not heard:
                return
            while len(last) > MAX_CHANNELS:
                self._forgot = last.popitem(last=False)[1]
            if self._blocked:
                self._cond.notify_all()
            listeners = self._listeners
        for channel, seq, waiters in heard:
            if waiters:
                here = asyncio._get_running_loop()
                for loop, fut in waiters:
                    if loop is here:  # notified on the waiter's own loop (the inline group commit)
                        _wake(fut)
                        continue
                    try:
                        loop.call_soon_threadsafe(_wake, fut)
                    except RuntimeError:  # the waiter's loop is closed; nothing to wake
                        pass
            for listener in listeners:
                listener(channel, seq, relayed)

    def fired(self, channels: Iterable[str], since: int) -> bool:
        """True when one of ``channels`` was notified after ``since`` (or may have been: it is
        no longer remembered, and a channel notified after ``since`` was forgotten)."""
        with self._lock:
            return self._fired(frozenset(channels), since)

    def _fired(self, channels: frozenset[str], since: int) -> bool:
        # A channel no longer remembered may have fired after ``since`` if anything was forgotten
        # since then: say so (a hint too many costs a re-read; one too few, a missed command).
        if since < self._forgot and any(c not in self._last for c in channels):
            return True
        return any(self._last.get(c, 0) > since for c in channels)

    def wait(self, channels: Iterable[str], timeout: float | None, since: int | None = None) -> bool:
        """Block until one of ``channels`` is notified after ``since`` (default: now) or timeout.

        Returns True when woken by a notification, False on timeout."""
        chans = frozenset(channels)
        with self._cond:
            mark = self._seq if since is None else since
            self._blocked += 1
            try:
                return self._cond.wait_for(lambda: self._fired(chans, mark), timeout)
            finally:
                self._blocked -= 1

    async def wait_async(
        self, channels: Iterable[str], timeout: float | None, since: int | None = None
    ) -> bool:
        """The asyncio form of ``wait``: the event loop is never blocked.

        One future per wait, set by the notification (at once when it comes from the waiter's own
        loop, else through ``call_soon_threadsafe``) or by a timer: a submit-and-wait waits twice
        per call, and ``asyncio.wait_for`` over an ``Event`` cost a task and three loop turns
        (and, from the loop's own thread, a write to its wake-up pipe) per wake."""
        chans = frozenset(channels)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        entry = (loop, fut)
        with self._lock:
            if since is not None and self._fired(chans, since):
                return True
            for c in chans:
                self._async.setdefault(c, set()).add(entry)
        timer = loop.call_later(timeout, _expire, fut) if timeout is not None else None
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                for c in chans:
                    waiting = self._async.get(c)
                    if waiting is not None:
                        waiting.discard(entry)
                        if not waiting:
                            del self._async[c]


def _wake(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(True)


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)
