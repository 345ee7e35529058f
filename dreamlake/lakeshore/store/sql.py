"""SqlStore: the one implementation of ``api.Store``, over SQLite (file or ``:memory:``) or PostgreSQL.

One SQLAlchemy Core code path serves both dialects. The store is assembled from one class per
concern, each whole in its module (see base.py for how they combine):

- invocations.py  submit, get, cancel, claim, ack, invocation leases
- frames.py       the frame journal of invocations and topics
- workers.py      workers and their commands, namespaces (pinned nymph version), tokens
- exec_jobs.py    exec jobs (seed 003) and their leases
- listing.py      the operators' read-only views: queues, workers, invocation pages, journal sizes

This module holds what spans them: the daemon's one-transaction calls ``poll`` (commands, then
invocations, then exec jobs up to the limit), ``heartbeat`` (renew both kinds of lease, take
commands) and ``expire_leases`` (both kinds), and the store's construction (engine, migration).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from .api import DEFAULT_LEASE_S, Command, Invocation, Store
from .engine import Database, migrate
from .exec_jobs import ExecJobStore
from .frames import FrameStore
from .invocations import InvocationStore
from .listing import ListingStore
from .notify import Notifier, exec_queue_channel
from .workers import WorkerStore

log = logging.getLogger(__name__)


class SqlStore(InvocationStore, FrameStore, WorkerStore, ExecJobStore, ListingStore):
    """The Store protocol over SQLite (file or ``:memory:``) or PostgreSQL."""

    def __init__(self, url: str, *, notifier: Notifier | None = None, migrate_schema: bool = True) -> None:
        super().__init__(Database(url), notifier if notifier is not None else Notifier())
        if migrate_schema:
            migrate(self.db)

    def poll(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        exec_jobs: bool = True,
        namespace: str | None = None,
    ) -> tuple[list[Command], list[Invocation], list[dict[str, Any]]]:
        now = time.time()
        with self.db.tx(write=True) as conn:
            commands = self._take_commands_in(conn, worker_id, now)
            claimed: list[Invocation] = []
            jobs: list[dict[str, Any]] = []
            if queues and limit >= 1:
                claimed = self._claim_in(conn, worker_id, queues, limit, lease_s, now, namespace)
                if exec_jobs and len(claimed) < limit:
                    left = limit - len(claimed)
                    jobs = self._claim_exec_in(conn, worker_id, queues, left, now, namespace, lease_s)
        self._notify(*(f"inv:{i.invocation_id}" for i in claimed))
        return commands, claimed, jobs

    def heartbeat(
        self,
        worker_id: str,
        running: Sequence[tuple[str, int]],
        lease_s: float = DEFAULT_LEASE_S,
        *,
        running_exec: Sequence[tuple[str, int]] | None = None,
    ) -> tuple[list[Command], list[str]]:
        now = time.time()
        wanted = {(inv_id, int(att)) for inv_id, att in running}
        wanted_exec = None if running_exec is None else {(exec_id, int(att)) for exec_id, att in running_exec}
        lease = now + lease_s
        with self.db.tx(write=True) as conn:
            kept = self._renew_in(conn, worker_id, sorted(wanted), lease)
            exec_list = None if wanted_exec is None else sorted(wanted_exec)
            kept |= self._renew_exec_in(conn, worker_id, exec_list, lease)
            commands = self._take_commands_in(conn, worker_id, now)
        lost = sorted({i for i, _ in wanted} - kept) + sorted({i for i, _ in wanted_exec or ()} - kept)
        return commands, lost

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        with self.db.tx(write=True) as conn:
            cancelled, requeued, failed = self._expire_in(conn, now)
            exec_requeued, exec_failed = self._expire_exec_in(conn, now)
        ids = [r.invocation_id for r in (*cancelled, *requeued, *failed)]
        exec_ids = [r.exec_id for r in (*exec_requeued, *exec_failed)]
        if ids or exec_ids:
            log.info(
                "lease expired: %d requeued, %d failed, %d cancelled; exec jobs: %d requeued, %d failed",
                len(requeued),
                len(failed),
                len(cancelled),
                len(exec_requeued),
                len(exec_failed),
            )
        self._notify(
            *(f"queue:{r.queue}" for r in requeued),  # one per invocation: a poll hub wakes one poll each
            *(f"inv:{i}" for i in ids),
            *(
                f"worker:{r.worker_id}" if r.worker_id else exec_queue_channel(r.namespace, r.queue)
                for r in exec_requeued
            ),
            *(f"exec:{i}" for i in exec_ids),
        )
        return ids + exec_ids


def _conforms(store: SqlStore) -> Store:
    """Never called: makes mypy check SqlStore against the Store protocol."""
    return store
