"""Wake-ups for long polls and the thread the store runs in.

Awaits, streams and exec-result waits wait on the store's in-process
:class:`~dreamlake.lakeshore.store.notify.Notifier` (channels ``inv:<id>``, ``topic:<name>``,
``exec:<id>``), which the store notifies after each commit; a store without one gets a private
notifier that the routes notify themselves. Other replicas never reach this process, so those
waits also re-check the store every ``recheck_s``. Daemon long polls wait in the poll hub instead
(``server/polls.py``), which listens to the same notifier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dreamlake.lakeshore.store.notify import Notifier

T = TypeVar("T")


class Wakeups:
    """The notifier long polls wait on; ``notify`` is for routes (a no-op when the store notifies)."""

    def __init__(self, store: Any) -> None:
        found = getattr(store, "notifier", None)
        self.own = not isinstance(found, Notifier)
        self.notifier: Notifier = found if isinstance(found, Notifier) else Notifier()
        self.closing = False  # the server is shutting down: waits end at once (``close_waits``)
        self._closing_channel = f"closing:{id(self)}"  # this app's alone, should a store be shared

    def mark(self) -> int:
        return self.notifier.mark()

    def notify(self, channel: str) -> None:
        if self.own:
            self.notifier.notify(channel)

    async def wait(self, channels: list[str], timeout: float, since: int | None = None) -> bool:
        """True when one of ``channels`` was notified after ``since``; False after ``timeout``."""
        if timeout <= 0 or self.closing:
            return False
        return await self.notifier.wait_async([*channels, self._closing_channel], timeout, since)

    def close_waits(self) -> None:
        """The server is stopping: end every wait now (each answers as after its timeout) and
        every later one at once, so long requests answer before the server stops."""
        self.closing = True
        self.notifier.notify(self._closing_channel)


class StoreRunner:
    """Runs the store's synchronous calls off the event loop, in a small dedicated pool.

    SQLite gets one thread: its writes serialize anyway, and one thread avoids lock contention.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lakeshore-store")

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        future = self._pool.submit(fn, *args, **kwargs)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
