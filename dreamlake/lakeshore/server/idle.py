"""What the control plane remembers of each daemon between its requests, so that an idle fleet's
poll renewals and heartbeats cost no transaction.

1,000 idle nymphs send about 100 heartbeats and 50 poll renewals a second (a heartbeat every 10 s,
a long poll of 20 s renewed as it ends). Each used to be a write of the group commit: touch the
worker, take its commands, read its pinned version, and for a renewal a claim pass that finds
nothing. On PostgreSQL that kept the one writer busy about half the time, so a claim queued behind
them, and each request cost 2-3 ms of the server's CPU. Two of them can be answered from memory
without losing anything a transaction would have found:

- **A poll renewal** (the same daemon's next poll with the same queues, within
  ``RENEW_WITHIN_S`` of its previous one ending with nothing left for it: empty after waiting in
  the hub, or answered by a pass with room to spare, which claimed less than its ``max`` and so
  took all there was) skips its opening pass and waits at once, from the notifier position of that
  daemon's last pass that left nothing (a daemon that just claimed the one submit of a quiet
  queue polls again without a transaction). The
  poll hub hands it any wake-up since then that no waiting poll took (kept wakes), and a command
  for its worker ends the wait at once (``notifier.fired``), exactly as if its pass had just run:
  the store notifies once per unit of new work (submits, requeues, retries come due), so work
  that arrived between the two polls is in a kept wake or went to another waiting poll. A kept wake
  the hub ever dropped (``PollHub.dropped_upto``) makes every renewal from before it pass again.
  A renewal that carries acks (``lakeshore worker`` acking the call its last poll took) writes
  them alone, then waits: what they put back (a retry queued at once, room under a limit) is
  notified after that position, so it wakes the poll like any other new work.
- **A heartbeat with nothing running** (``running`` and ``running_exec`` empty: a heartbeat
  without ``running_exec`` renews every exec job its worker holds), from a daemon whose long poll
  is waiting in the hub right now, renews no lease and has no command to take (a command for its worker wakes that poll,
  whose pass takes it). It is answered with the pinned version its last pass read.
- **A poll pass** of a daemon no command was notified for since its last full write only claims:
  one statement instead of four (touch, take commands, claim, read the pin) on the claim path.

Either only while every wake-up reaches this replica (``PollHub.reliable``), and only within
``FULL_EVERY_S`` (jittered between half and all of it) of the daemon's last full write here (a pass
or a heartbeat's transaction: touch, commands, pinned version). So an idle daemon is written at
least that often: its ``last_seen`` stays within ``FULL_EVERY_S`` (the live window is 300 s), and
a pin or a re-register made through another replica reaches it within that; through this replica
it is seen at once (:meth:`forget`, :meth:`forget_all`). A daemon with work running heartbeats
through the group commit as before.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from dreamlake.lakeshore.server.polls import PollHub
from dreamlake.lakeshore.store.placement import Offer

RENEW_WITHIN_S = 5.0  # a poll that follows its daemon's empty one this soon is its renewal
FULL_EVERY_S = 60.0  # the longest an idle daemon goes without a write of its own (jittered down to half)
MAX_DAEMONS = 100_000  # daemons remembered at most (the oldest are forgotten first)

RenewKey = tuple[tuple[str, ...], bool, str | None, Offer]  # queues, exec jobs, namespace, offer


@dataclass
class _Daemon:
    full_until: float  # monotonic time its last full write here stops standing in for the next
    full_mark: int  # the notifier position before it
    pinned: str | None  # the pinned version it read
    renew: tuple[RenewKey, int, float] | None = None  # (key, since, ended at): see left_nothing


class DaemonMemo:
    """The memory the module docstring describes, for one control-plane process (one loop)."""

    def __init__(self, hub: PollHub) -> None:
        self.hub = hub
        self._daemons: OrderedDict[str, _Daemon] = OrderedDict()
        self._epoch = 0  # advanced by every forget: a write begun before one may have read the old

    def begin(self) -> tuple[int, int]:
        """Taken before a full write: the notifier position and this memo's epoch."""
        return self.hub.notifier.mark(), self._epoch

    def wrote(self, worker_id: str, began: tuple[int, int], pinned: str | None) -> None:
        """The daemon's commands were taken and its pinned version read (``pinned``) by a write
        that began at ``began`` (:meth:`begin`). Not remembered when a pin or a register came
        while it ran: it may have read what they replaced."""
        mark, epoch = began
        if epoch != self._epoch:
            self._daemons.pop(worker_id, None)
            return
        d = self._daemons.pop(worker_id, None)
        renew = d.renew if d is not None else None
        # jittered, so a fleet registered together does not come back for its writes together
        until = time.monotonic() + FULL_EVERY_S * random.uniform(0.5, 1.0)
        self._daemons[worker_id] = _Daemon(until, mark, pinned, renew)
        while len(self._daemons) > MAX_DAEMONS:
            self._daemons.popitem(last=False)

    def left_nothing(self, worker_id: str, key: RenewKey, since: int) -> None:
        """The daemon's poll with ``key`` ends, and from position ``since`` on nothing it could
        claim was left: it waited in the hub from there (after a fruitless pass, or as a renewal)
        and nothing came, or its last pass, begun there, had room to spare."""
        d = self._daemons.get(worker_id)
        if d is not None:
            d.renew = (key, since, time.monotonic())

    def renewal(self, worker_id: str, key: RenewKey) -> tuple[int, str | None] | None:
        """For a poll that may skip its opening pass: the position to wait from and the pinned
        version to answer with; None when it must pass first. Taken once."""
        d = self._daemons.get(worker_id)
        if d is None or d.renew is None:
            return None
        (was, since, ended), d.renew = d.renew, None
        now = time.monotonic()
        if (
            was != key
            or now - ended > RENEW_WITHIN_S
            or not self._fresh(d, now)
            or since < self.hub.dropped_upto
        ):
            return None
        return since, d.pinned

    def known(self, worker_id: str) -> tuple[str | None] | None:
        """``(pinned,)`` while the daemon's last full write stands: no command can be waiting
        for it (none was notified since) and its pinned version is that write's. A poll pass then
        only claims (no touch, no DELETE of commands, no read of the pin). None otherwise."""
        d = self._daemons.get(worker_id)
        if d is None or not self._fresh(d, time.monotonic()):
            return None
        if self.hub.notifier.fired([f"worker:{worker_id}"], d.full_mark):
            return None  # a command may wait for it: a full write takes it
        return (d.pinned,)

    def quiet_heartbeat(self, worker_id: str) -> tuple[str | None] | None:
        """For a heartbeat with nothing running that needs no transaction (its daemon's long
        poll waits here, and :meth:`known`): ``(pinned,)``; None when it must be written."""
        return self.known(worker_id) if self.hub.is_waiting(worker_id) else None

    def _fresh(self, d: _Daemon, now: float) -> bool:
        return now < d.full_until and self.hub.reliable and not self.hub.closing

    def forget(self, worker_id: str) -> None:
        """The daemon (re-)registered: its next requests are written."""
        self._epoch += 1
        self._daemons.pop(worker_id, None)

    def forget_all(self) -> None:
        """A version was pinned: every daemon's next request is written (and reads the pin)."""
        self._epoch += 1
        self._daemons.clear()
