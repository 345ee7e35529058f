"""Exec jobs (seed 003): queued commands a daemon runs for a namespace, leased like invocations.

``create_exec`` queues a job (``state`` queued); ``claim_exec`` flips jobs of the given queues (and
of ``namespace``, when one is given: a daemon token bound to a namespace never sees another
namespace's jobs) that are meant for any worker or for the caller to running and returns the exec
command bodies ``{exec_id, namespace, command, payload_inline, payload_ref, timeout_s, attempt}``.
A claim holds a lease like an invocation's (``attempt + 1``, ``lease_expires_at = now + lease_s``),
renewed by the claimer's heartbeat (``_renew_exec_in``); ``_expire_exec_in`` (run by
``expire_leases``) requeues a lapsed one or, on its last attempt, finishes it with exit code -1.
``publish_exec_result`` records the first published result (``{exit_code, stdout, stderr,
resultInline?, resultRef?}``, any msgpack-able dict) and marks it done, from the worker of the
latest claim only (an admin, ``worker_id=None``, is not checked): a superseded claim or another
worker is refused. A claim whose lease lapsed may still publish while no other claim has taken the
job (its work is not thrown away). ``get_exec`` returns ``{exec_id, namespace, state, queue,
worker_id, command, timeout_s, created_at, claimed_at, finished_at, attempt, max_attempts, result}``
where ``result`` is the published dict or None.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import msgpack
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid

from . import schema as t
from .api import DEFAULT_LEASE_S, AckResult
from .base import StoreBase
from .engine import Database
from .notify import Notifier, exec_queue_channel
from .values import json_safe, normalize_max_attempts

# The result of an exec job whose lease lapsed on its last allowed attempt (see _expire_exec_in).
EXEC_LEASE_EXPIRED_NOTE = (
    "lakeshore: the daemon running this exec job stopped renewing its lease on the last allowed "
    "attempt (max_attempts); the command may not have finished and its output is lost\n"
)
EXEC_LEASE_EXPIRED: bytes = msgpack.packb(
    {
        "exit_code": -1,
        "stdout": "",
        "stderr": EXEC_LEASE_EXPIRED_NOTE,
        "error": {"type": "LeaseExpired", "message": EXEC_LEASE_EXPIRED_NOTE.strip()},
    },
    use_bin_type=True,
)

_e = t.exec_jobs


OUTPUT_STREAMS = ("stdout", "stderr")
ARCHIVE_KEY_RE = re.compile(r"^exec/\d{4}/\d{2}/\d{2}/[0-9A-HJKMNP-TV-Z]{26}/out/(stdout|stderr)$")


def archive_key(exec_id: str, created_at: float, stream: str) -> str:
    """Where an exec job's ``stream`` is archived in the payload store (seed 003's
    ``exec/<YYYY>/<MM>/<DD>/<exec_id>/out`` prefix, the UTC day the job was created; server/execout.py)."""
    day = datetime.fromtimestamp(created_at, UTC)
    return f"exec/{day:%Y}/{day:%m}/{day:%d}/{exec_id}/out/{stream}"


def archive_keys(exec_id: str, created_at: float) -> list[str]:
    return [archive_key(exec_id, created_at, stream) for stream in OUTPUT_STREAMS]


class _Statements:
    """The claim and lease statements, built once with bind parameters (see base.py)."""

    def __init__(self) -> None:
        B = sa.bindparam
        e = _e
        # One statement per "any namespace" / "this namespace only" (a daemon token bound to one).
        self.claim: dict[bool, Any] = {}
        for by_namespace in (False, True):
            conds = [
                e.c.state == "queued",
                e.c.queue.in_(B("queues", expanding=True)),
                sa.or_(e.c.worker_id.is_(None), e.c.worker_id == B("worker")),
            ]
            if by_namespace:
                conds.append(e.c.namespace == B("b_namespace"))
            pick = (
                sa.select(e.c.exec_id)
                .where(*conds)
                .order_by(e.c.created_at, e.c.exec_id)
                .limit(B("limit", type_=sa.Integer))
                .with_for_update(skip_locked=True)
                .cte("picked_exec")
                .prefix_with("MATERIALIZED")
            )
            self.claim[by_namespace] = (
                sa.update(e)
                .where(e.c.exec_id.in_(sa.select(pick.c.exec_id)), e.c.state == "queued")
                .values(
                    state="running",
                    claimed_by=B("worker"),
                    claimed_at=B("now"),
                    attempt=e.c.attempt + 1,
                    lease_expires_at=B("lease"),
                )
                .returning(*e.c)
            )
        # Also a job requeued after its lease lapsed but not claimed again (attempt and claimed_by
        # unchanged): its daemon is alive and still runs it, so it takes the job back instead of
        # the command running twice.
        self.renew = (
            sa.update(e)
            .where(
                sa.tuple_(e.c.exec_id, e.c.attempt).in_(B("pairs", expanding=True)),
                e.c.state.in_(("running", "queued")),
                e.c.claimed_by == B("worker"),
            )
            .values(state="running", lease_expires_at=B("lease"))
            .returning(e.c.exec_id)
        )
        # A daemon that does not report its exec jobs (before running_exec): its heartbeat renews
        # all of them, as before leases it kept them for ever; a dead one stops renewing them.
        self.renew_all = (
            sa.update(e)
            .where(e.c.claimed_by == B("worker"), e.c.state == "running")
            .values(lease_expires_at=B("lease"))
        )


@functools.cache
def _statements() -> _Statements:
    return _Statements()


def exec_body(r: Row[Any]) -> dict[str, Any]:
    """The exec command body of a claimed exec_jobs row."""
    return {
        "exec_id": r.exec_id,
        "namespace": r.namespace,
        "queue": r.queue,
        "command": r.command,
        "payload_inline": bytes(r.payload_inline) if r.payload_inline is not None else None,
        "payload_ref": r.payload_ref,
        "timeout_s": r.timeout_s,
        "attempt": r.attempt,
    }


def _publish_refusal(exec_id: str, row: Any, worker_id: str | None, attempt: int | None) -> str | None:
    """Why ``worker_id`` (None: an admin, never refused) may not publish the result of ``row``'s job."""
    if worker_id is None:
        return None
    if row.claimed_by is None:
        return f"exec job {exec_id} was never claimed; worker {worker_id} cannot publish its result"
    if row.claimed_by != worker_id:
        return (
            f"exec job {exec_id} is claimed by another worker (attempt {row.attempt}), not by worker "
            f"{worker_id}: only the daemon that claimed it publishes its result"
        )
    if attempt is not None and attempt != row.attempt:
        return f"attempt {attempt} of exec job {exec_id} was superseded by attempt {row.attempt}"
    return None


class ExecJobStore(StoreBase):
    """Exec jobs: create, claim, lease, publish, read."""

    def __init__(self, db: Database, notifier: Notifier) -> None:
        super().__init__(db, notifier)
        self._exec_st = _statements()

    def create_exec(
        self,
        namespace: str,
        command: str,
        *,
        payload_inline: bytes | None,
        payload_ref: dict[str, Any] | None,
        queue: str,
        worker_id: str | None,
        timeout_s: float | None,
        max_attempts: int | None = None,
    ) -> str:
        if payload_inline is not None and payload_ref is not None:
            raise PlaneError("payloadInline and payloadRef are mutually exclusive: send one", status=400)
        exec_id = new_ulid()
        queue = queue or "default"
        with self.db.tx(write=True) as conn:
            conn.execute(
                sa.insert(_e).values(
                    exec_id=exec_id,
                    namespace=namespace,
                    command=command,
                    payload_inline=bytes(payload_inline) if payload_inline is not None else None,
                    payload_ref=json_safe(payload_ref, "payloadRef") if payload_ref is not None else None,
                    queue=queue,
                    worker_id=worker_id,
                    timeout_s=timeout_s,
                    state="queued",
                    created_at=time.time(),
                    attempt=0,
                    max_attempts=normalize_max_attempts(max_attempts),
                )
            )
        self._notify(f"worker:{worker_id}" if worker_id else exec_queue_channel(namespace, queue))
        return exec_id

    def claim_exec(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        *,
        namespace: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> list[dict[str, Any]]:
        if not queues or limit < 1:
            return []
        with self.db.tx(write=True) as conn:
            return self._claim_exec_in(conn, worker_id, queues, limit, time.time(), namespace, lease_s)

    def _claim_exec_in(
        self,
        conn: Connection,
        worker_id: str,
        queues: list[str],
        limit: int,
        now: float,
        namespace: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> list[dict[str, Any]]:
        params = {
            "queues": list(queues),
            "limit": int(limit),
            "worker": worker_id,
            "now": now,
            "lease": now + lease_s,
            "b_namespace": namespace,
        }
        stmt = self._exec_st.claim[namespace is not None]
        rows = sorted(conn.execute(stmt, params), key=lambda r: (r.created_at, r.exec_id))
        return [exec_body(r) for r in rows]

    def _renew_exec_in(
        self, conn: Connection, worker_id: str, running: Sequence[tuple[str, int]] | None, lease: float
    ) -> set[str]:
        """Renew the leases of the worker's exec jobs (``(exec_id, attempt)`` pairs; None: all of
        them, for a daemon that does not report its exec jobs); the ids it still holds."""
        if running is None:
            conn.execute(self._exec_st.renew_all, {"worker": worker_id, "lease": lease})
            return set()
        if not running:
            return set()
        params = {"pairs": sorted(running), "worker": worker_id, "lease": lease}
        return set(conn.execute(self._exec_st.renew, params).scalars())

    def _expire_exec_in(self, conn: Connection, now: float) -> tuple[list[Row[Any]], list[Row[Any]]]:
        """Requeue the exec jobs whose lease lapsed, or finish those on their last attempt with exit
        code -1; the ``(exec_id, queue)`` rows requeued and the ``(exec_id,)`` rows finished."""
        lapsed = (_e.c.state == "running", _e.c.lease_expires_at < now)
        # claimed_by stays: the lapsed claim may still publish until another claim supersedes it
        requeued = conn.execute(
            sa.update(_e)
            .where(*lapsed, _e.c.attempt < _e.c.max_attempts)
            .values(state="queued", lease_expires_at=None)
            .returning(_e.c.exec_id, _e.c.queue, _e.c.namespace, _e.c.worker_id)
        ).fetchall()
        failed = conn.execute(
            sa.update(_e)
            .where(*lapsed)
            .values(state="done", finished_at=now, lease_expires_at=None, result=EXEC_LEASE_EXPIRED)
            .returning(_e.c.exec_id)
        ).fetchall()
        return list(requeued), list(failed)

    def publish_exec_result(
        self,
        namespace: str,
        exec_id: str,
        result: dict[str, Any],
        *,
        worker_id: str | None = None,
        attempt: int | None = None,
    ) -> AckResult:
        """Record ``result`` (see the module doc for who may); a repeat keeps the first."""
        e = _e
        try:
            blob = msgpack.packb(result, use_bin_type=True)
        except (TypeError, ValueError) as exc:
            raise PlaneError(f"exec result must be plain data (msgpack-able): {exc}", status=400) from exc
        with self.db.tx(write=True) as conn:
            # FOR UPDATE (PostgreSQL): a claim, expiry or other publish waits until this one is done
            row = conn.execute(
                sa.select(e.c.state, e.c.claimed_by, e.c.attempt, e.c.result)
                .where(e.c.exec_id == exec_id, e.c.namespace == namespace)
                .with_for_update()
            ).first()
            if row is None:
                return AckResult(ok=False, reason=f"unknown exec job '{exec_id}' in namespace '{namespace}'")
            refused = _publish_refusal(exec_id, row, worker_id, attempt)
            if refused is not None:
                return AckResult(ok=False, state=row.state, reason=refused)
            # The claimer's own result replaces the placeholder of a lease that lapsed on the last
            # attempt: the command did finish, and its output is the work the client waits for.
            expired = row.result is not None and bytes(row.result) == EXEC_LEASE_EXPIRED
            if row.state == "done" and not (expired and worker_id is not None):
                return AckResult(ok=True, duplicate=True, state="done")
            conn.execute(
                sa.update(e)
                .where(e.c.exec_id == exec_id)
                .values(state="done", result=blob, finished_at=time.time(), lease_expires_at=None)
            )
        self._notify(f"exec:{exec_id}")
        return AckResult(ok=True, state="done")

    def get_exec(self, namespace: str, exec_id: str) -> dict[str, Any] | None:
        e = _e
        with self.db.tx(write=False) as conn:
            r = conn.execute(sa.select(e).where(e.c.exec_id == exec_id, e.c.namespace == namespace)).first()
        if r is None:
            return None
        return {
            "exec_id": r.exec_id,
            "namespace": r.namespace,
            "state": r.state,
            "queue": r.queue,
            "worker_id": r.claimed_by or r.worker_id,
            "command": r.command,
            "timeout_s": r.timeout_s,
            "created_at": r.created_at,
            "claimed_at": r.claimed_at,
            "finished_at": r.finished_at,
            "attempt": r.attempt,
            "max_attempts": r.max_attempts,
            "result": msgpack.unpackb(r.result, raw=False) if r.result is not None else None,
        }
