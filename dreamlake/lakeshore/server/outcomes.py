"""Acks in flight, for the producers that wait on them: an ack's outcome reaches a waiting await
from memory, at its commit, with no store read.

The ack route calls :meth:`AcksInFlight.begin` before it hands the ack to the group commit and
:meth:`AcksInFlight.end` once the commit answered (with the outcome when the store took the ack,
``None`` when it refused it), which keeps a committed outcome for ``RECENT_S`` seconds. The
commit's notification (channel ``inv:<id>``) wakes a waiting
``/v1/producer/await`` (or ``submit`` with ``wait_s``); the waiter finds the ack in flight and
awaits its end instead of reading the store: the outcome it answers is the one just committed.

What a producer may see: only committed outcomes. The outcome is handed over after the ack's
transaction committed, never before, so a producer never holds a result that a crash could take
back; the producer's answer and the daemon's ack answer leave at the same moment. A refused ack
(superseded attempt, another worker) hands nothing over: the waiter reads the store as before.
Waits on another replica, a cancel, or a lease expiry read the store as before too.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

Outcome = dict[str, Any]  # {state, result_blob, error}, as ``producer.outcome`` answers


_NOTHING: Any = object()  # what the timer of a wait on a flight passes: no outcome

RECENT_MAX = 4096  # committed outcomes kept for waiters that wake just after the ack's answer
RECENT_S = 10.0


class AcksInFlight:
    """The acks of this process between their arrival and their commit's answer, and the outcomes
    committed in the last ``RECENT_S`` seconds (a waiter woken by the commit's notification may
    run only after the ack route has answered; at most ``RECENT_MAX`` kept)."""

    def __init__(self) -> None:
        self._flight: dict[str, list[asyncio.Future[Outcome | None]]] = {}
        self._recent: OrderedDict[str, tuple[float, Outcome]] = OrderedDict()

    def begin(self, invocation_id: str) -> asyncio.Future[Outcome | None]:
        fut: asyncio.Future[Outcome | None] = asyncio.get_running_loop().create_future()
        self._flight.setdefault(invocation_id, []).append(fut)
        return fut

    def end(self, invocation_id: str, fut: asyncio.Future[Outcome | None], outcome: Outcome | None) -> None:
        """The commit answered: hand ``outcome`` (None: refused) to whoever waits on ``fut``."""
        futs = self._flight.get(invocation_id)
        if futs is not None:
            if fut in futs:
                futs.remove(fut)
            if not futs:
                del self._flight[invocation_id]
        if outcome is not None:
            self._recent[invocation_id] = (time.monotonic() + RECENT_S, outcome)
            self._recent.move_to_end(invocation_id)
            while len(self._recent) > RECENT_MAX:
                self._recent.popitem(last=False)
        if not fut.done():
            fut.set_result(outcome)

    async def outcome(self, invocation_id: str, timeout: float) -> Outcome | None:
        """The committed outcome of an ack of ``invocation_id`` now in flight (waiting up to
        ``timeout`` for its commit's answer); None when none is in flight or it was refused."""
        recent = self._recent.get(invocation_id)
        if recent is not None:
            if recent[0] > time.monotonic():
                return recent[1]
            del self._recent[invocation_id]
        futs = self._flight.get(invocation_id)
        if not futs or timeout <= 0:
            return None
        flight = futs[-1]
        # the commit's notification wakes a waiter before the ack route has ended its flight (the
        # route goes on after its write's answer, a turn later): one future of this waiter's own,
        # set by the flight's end or a timer (asyncio.wait_for over a shield cost a task and two
        # more loop turns, on the path of every submit-and-wait's answer)
        loop = asyncio.get_running_loop()
        got: asyncio.Future[Outcome | None] = loop.create_future()

        def ended(f: asyncio.Future[Outcome | None]) -> None:  # the flight's, or _NOTHING at the timeout
            if not got.done():
                got.set_result(None if f is _NOTHING or f.cancelled() else f.result())

        flight.add_done_callback(ended)
        timer = loop.call_later(timeout, ended, _NOTHING)
        try:
            return await got
        finally:
            timer.cancel()
            flight.remove_done_callback(ended)
