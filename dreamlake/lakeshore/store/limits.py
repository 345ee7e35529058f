"""Fleet-wide limits as operators set and read them (``lakeshore queue limit``, ``lakeshore queues``).

The ``limits`` table holds caps on running calls, enforced in the claim transaction
(store/claims.py ``Placer``): ``queue:<name>`` (an operator's ``--max-running``, set here) and
``key:<concurrency_key>`` (a submit's ``max_concurrency``). A limit set on this replica applies
to its next claim; another replica reads it within ``claims.REFRESH_S``. Raising or clearing a
limit wakes the polls of that queue (``queue:<name>`` and the default namespace's run-queue
channel); a call held back by a limit in another namespace waits for the next pass of a poll of
its queue.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import sqlalchemy as sa

from dreamlake.lakeshore.errors import PlaneError

from . import schema as t
from .api import DEFAULT_NAMESPACE
from .base import StoreBase
from .claims import KEY_PREFIX, QUEUE_PREFIX, queue_limit
from .engine import retry_on_disconnect
from .notify import invocation_channels

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from .claims import Placer

MAX_RUNNING = 2**31 - 1


def check_max_running(value: object) -> int:
    """``value`` as a limit (a whole number from 0: 0 holds every call of the queue queued);
    PlaneError(400) otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RUNNING:
        raise PlaneError(
            f"max_running must be a whole number from 0 to {MAX_RUNNING} (0 holds every call queued), "
            f"got {value!r:.40}",
            400,
        )
    return value


class LimitStore(StoreBase):
    """Set, clear and read the fleet-wide limits."""

    if TYPE_CHECKING:  # InvocationStore's (the claim's cache of limits is kept there)
        _placer: Placer

        def set_limit_in(self, conn: Connection, name: str, most: int | None, now: float) -> None: ...

    @retry_on_disconnect
    def set_queue_limit(self, queue: str, max_running: int | None) -> None:
        """Cap the calls of ``queue`` running at once across the fleet (None: no cap)."""
        most = None if max_running is None else check_max_running(max_running)
        with self._placer.tentative(), self.db.tx(write=True) as conn:
            self.set_limit_in(conn, queue_limit(queue), most, time.time())
        self._notify(*invocation_channels(DEFAULT_NAMESPACE, queue))  # more room, maybe: a pass

    @retry_on_disconnect
    def limit_use(self, queue: str, concurrency_key: str | None) -> list[tuple[str, int, int]]:
        """``(limits row name, max_running, running now)`` of each limit that covers a call of
        ``queue`` (and of ``concurrency_key``): what ``lakeshore show`` says a queued call waits on.
        A key's running calls are counted over the shapes naming it (the ``shapes`` table)."""
        names = [queue_limit(queue)] + ([KEY_PREFIX + concurrency_key] if concurrency_key else [])
        lim, inv = t.limits, t.invocations
        running = sa.select(sa.func.count()).select_from(inv).where(inv.c.state == "running")
        out: list[tuple[str, int, int]] = []
        with self.db.tx(write=False) as conn:
            found = conn.execute(sa.select(lim.c.name, lim.c.max_running).where(lim.c.name.in_(names)))
            for name, most in sorted(found):
                if name.startswith(QUEUE_PREFIX):
                    n = conn.execute(running.where(inv.c.queue == queue)).scalar_one()
                else:
                    n = _key_running(conn, name.removeprefix(KEY_PREFIX))
                out.append((name, int(most), int(n)))
        return out

    @retry_on_disconnect
    def key_limit_use(self) -> list[tuple[str, int, int]]:
        """``(concurrency_key, max_concurrency, running now)`` of every key limit, by key: what
        ``lakeshore queues`` and the dashboard show beside the queues' own limits."""
        lim = t.limits
        out: list[tuple[str, int, int]] = []
        with self.db.tx(write=False) as conn:
            found = conn.execute(
                sa.select(lim.c.name, lim.c.max_running).where(
                    lim.c.name.startswith(KEY_PREFIX, autoescape=True)
                )
            )
            for name, most in sorted(found):
                key = name.removeprefix(KEY_PREFIX)
                out.append((key, int(most), _key_running(conn, key)))
        return out

    @retry_on_disconnect
    def limits(self) -> dict[str, dict[str, int]]:
        """Every limit: ``{"queues": {name: max_running}, "keys": {concurrency_key: max}}``."""
        lim = t.limits
        out: dict[str, dict[str, int]] = {"queues": {}, "keys": {}}
        with self.db.tx(write=False) as conn:
            for name, most in conn.execute(sa.select(lim.c.name, lim.c.max_running)):
                if name.startswith(QUEUE_PREFIX):
                    out["queues"][name.removeprefix(QUEUE_PREFIX)] = int(most)
                elif name.startswith(KEY_PREFIX):
                    out["keys"][name.removeprefix(KEY_PREFIX)] = int(most)
        return out


def _key_running(conn: Connection, key: str) -> int:
    """The calls running now whose shape names ``concurrency_key`` ``key`` (over the ``shapes``
    table: a key's calls may be of many shapes and queues)."""
    inv, sh = t.invocations, t.shapes
    pairs = [
        (q, s)
        for q, s, needs in conn.execute(sa.select(sh.c.queue, sh.c.shape, sh.c.needs))
        if isinstance(needs, dict) and needs.get("concurrency_key") == key
    ]
    if not pairs:
        return 0
    running = sa.select(sa.func.count()).select_from(inv).where(inv.c.state == "running")
    return int(conn.execute(running.where(sa.tuple_(inv.c.queue, inv.c.shape).in_(pairs))).scalar_one())
