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

**A lone replica sends nothing.** Every ``LISTEN`` connection holds a shared advisory lock
(``PRESENCE_KEYS``) for its life, so ``pg_locks`` counts the replicas listening, whatever their
role (no privilege is needed to read it). Before it sends, the relay reads that count, at most
``PEERS_FRESH_S`` old; with no other holder it drops the batch: nobody would hear it but this
replica, which drops its own anyway. A submit burst on one replica (every wake unclaimed locally)
sent a ``pg_notify`` and received it back per group commit: sampled, about a fifth of the event
loop's busy time.
A replica that just started listening says so (:attr:`PgRelay.listening`) only ``ANNOUNCE_S``
after its lock is held, more than twice ``PEERS_FRESH_S``: until then its hub re-checks waiting
polls as when it is not listening, and by then every other replica's count includes it.
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
# pg_advisory_lock_shared(int, int) of each LISTEN connection: "lake", "wake" (the two-key space
# does not overlap the one-key locks, such as the migration's in store/engine.py)
PRESENCE_KEYS = (0x6C616B65, 0x77616B65)
PEERS_FRESH_S = 1.0  # how old the count of listening replicas may be when it drops a batch
ANNOUNCE_S = 2.5  # from holding the lock to claiming to listen: > 2 x PEERS_FRESH_S
_PEERS_SQL = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s"
    " AND objsubid = 2 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND pid <> %s"
)
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
        self.dropped = 0  # channels not sent: no other replica was listening
        self._listener_pid = 0  # the backend of this replica's LISTEN connection (0: none)
        self._listens = 0  # LISTEN connections made: a stale announcement is not made
        self._peers = True  # another replica may be listening (as of _peers_at)
        self._peers_at = float("-inf")  # loop time the count was asked for

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
                    await conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", PRESENCE_KEYS)
                    self._listener_pid = conn.info.backend_pid
                    self._listens += 1
                    asyncio.get_running_loop().call_later(ANNOUNCE_S, self._announce, self._listens)
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
                self._listens += 1  # the pending announcement (if any) is this connection's
                self._listener_pid = 0
                self._set_listening(False)
            await asyncio.sleep(_backoff(tries))

    def _announce(self, listens: int) -> None:
        """``ANNOUNCE_S`` after the LISTEN connection ``listens`` took its lock: every other
        replica's count includes it now, so what they send reaches this one."""
        if listens == self._listens:
            self._set_listening(True)

    async def _alone(self, conn: Any) -> bool:
        """Whether no other replica listens, from a count at most ``PEERS_FRESH_S`` old."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        if asked - self._peers_at >= PEERS_FRESH_S:
            cur = await conn.execute(_PEERS_SQL, (*PRESENCE_KEYS, self._listener_pid))
            row = await cur.fetchone()
            self._peers, self._peers_at = bool(row and row[0]), asked
        return not self._peers

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
                        alone = await self._alone(conn)
                        if not alone:
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
                    if alone:
                        self.dropped += n
                    else:
                        self.sent += n
                    del self._outbox[:n]
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
