"""Wake-ups between control-plane replicas over PostgreSQL ``LISTEN`` / ``NOTIFY``.

Replicas over one PostgreSQL store each run a :class:`PgRelay`: two psycopg 3 connections of its
own, outside the store's pool. The poll hub (``server/polls.py``) publishes the wakes no local poll
could take (``run-queue:<ns>:<q>``, ``exec-queue:<ns>:<q>``) and commands for a worker with no poll here
(``worker:<id>``); the relay sends them, batched, with ``pg_notify`` right after the store
committed the work, and injects what the other replicas sent into the local notifier
(``notify(channel, relayed=True)``), where the hub wakes one local poll per wake. A payload is
``<origin>\\n<channel>\\n<channel>...`` (at most ``MAX_PAYLOAD`` bytes); a replica drops its own.

While the ``LISTEN`` connection is down (at start, or after PostgreSQL went away) notifications
from other replicas are missed: :attr:`PgRelay.listening` is False, the hub re-checks waiting polls
every ``recheck_s``, and the relay reconnects with jittered backoff. Wakes that could not be sent
stay queued (at most ``MAX_OUTBOX``, duplicates merged past that) and go out on reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

from dreamlake.lakeshore.backoff import backoff_s
from dreamlake.lakeshore.store.notify import Notifier

log = logging.getLogger(__name__)

CHANNEL = "lakeshore_wakeups"
MAX_PAYLOAD = 7900  # PostgreSQL refuses NOTIFY payloads of 8000 bytes and more
MAX_OUTBOX = 10_000
_KEEPALIVE: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def libpq_dsn(url: str) -> str:
    """A libpq connection string from the store's SQLAlchemy URL (``postgresql+psycopg://``)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _backoff(tries: int) -> float:
    return backoff_s(tries, base=0.25, cap=10.0, doublings=8)


class PgRelay:
    """LISTEN/NOTIFY wake-ups for one replica; ``run()`` is its task, ``publish`` its input."""

    def __init__(
        self, dsn: str, notifier: Notifier, *, on_listening: Callable[[bool], None] | None = None
    ) -> None:
        self.dsn = dsn
        self.notifier = notifier
        self.origin = secrets.token_hex(6)  # this replica, so it can drop its own notifications
        self._on_listening = on_listening
        self._listening = False
        self._outbox: list[str] = []
        self._kick = asyncio.Event()
        self.sent = 0  # channels sent and received, for tests and /metrics
        self.received = 0

    @property
    def listening(self) -> bool:
        return self._listening

    def publish(self, channel: str) -> None:
        """Send ``channel`` to the other replicas (event-loop thread only; never blocks)."""
        self._outbox.append(channel)
        if len(self._outbox) > MAX_OUTBOX:
            self._outbox = list(dict.fromkeys(self._outbox))
        self._kick.set()

    async def run(self) -> None:
        """Listen and send until cancelled."""
        try:
            async with asyncio.TaskGroup() as tasks:  # one failing cancels the other
                tasks.create_task(self._listen_forever())
                tasks.create_task(self._send_forever())
        except Exception:
            log.exception("wake-up relay failed; long polls re-check the store every recheck_s from now on")

    def _set_listening(self, value: bool) -> None:
        if value != self._listening:
            self._listening = value
            if self._on_listening is not None:
                self._on_listening(value)

    async def _connect(self) -> Any:
        import psycopg

        return await psycopg.AsyncConnection.connect(self.dsn, autocommit=True, **_KEEPALIVE)

    async def _listen_forever(self) -> None:
        import psycopg

        tries = 0
        while True:
            try:
                async with await self._connect() as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self._set_listening(True)
                    if tries:
                        log.info("wake-up relay: listening again on PostgreSQL after %d tries", tries)
                    tries = 0
                    async for note in conn.notifies():
                        self._receive(note.payload)
            except (psycopg.Error, OSError) as exc:
                tries += 1
                log.log(  # once per outage; the retries meanwhile are DEBUG lines
                    logging.WARNING if tries == 1 else logging.DEBUG,
                    "wake-up relay: LISTEN connection failed (%s); polls re-check the store until it is back",
                    exc,
                )
            finally:
                self._set_listening(False)
            await asyncio.sleep(_backoff(tries))

    def _receive(self, payload: str) -> None:
        origin, _, body = payload.partition("\n")
        if origin == self.origin or not body:
            return
        for channel in body.split("\n"):
            self.received += 1
            self.notifier.notify(channel, relayed=True)

    def _batch(self) -> tuple[str, int]:
        """The next payload and how many outbox entries it carries."""
        size = len(self.origin)
        n = 0
        for channel in self._outbox:
            size += len(channel.encode()) + 1
            if size > MAX_PAYLOAD and n:
                break
            n += 1
        return "\n".join([self.origin, *self._outbox[:n]]), n

    async def _send_forever(self) -> None:
        import psycopg

        conn: Any = None
        tries = 0
        try:
            while True:
                await self._kick.wait()
                self._kick.clear()
                while self._outbox:
                    payload, n = self._batch()
                    try:
                        if conn is None or conn.closed:
                            conn = await self._connect()
                        await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
                    except (psycopg.Error, OSError) as exc:
                        tries += 1
                        log.log(  # once per outage; the retries meanwhile are DEBUG lines
                            logging.WARNING if tries == 1 else logging.DEBUG,
                            "wake-up relay: NOTIFY failed (%s); retrying",
                            exc,
                        )
                        if conn is not None:
                            with contextlib.suppress(Exception):
                                await conn.close()
                        conn = None
                        await asyncio.sleep(_backoff(tries))
                        continue
                    if tries:
                        log.info("wake-up relay: NOTIFY works again after %d tries", tries)
                    tries = 0
                    self.sent += n
                    del self._outbox[:n]
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
