"""The store's side tables: workers, namespaces (pinned nymph version), tokens and exec jobs.

Mixed into ``SqlStore``; it shares its ``Database`` and notifier.

Tokens: ``create_token`` returns ``"lsk_" + secrets.token_urlsafe(32)`` once; only its sha256 is
stored, and ``verify_token`` looks the hash up (no secret ever compared byte by byte).

Exec jobs (seed 003): ``create_exec`` queues a job (``state`` queued); ``claim_exec`` flips jobs of
the given queues (and of ``namespace``, when one is given: a daemon token bound to a namespace
never sees another namespace's jobs) that are meant for any worker or for the caller to running and returns the exec
command bodies ``{exec_id, namespace, command, payload_inline, payload_ref, timeout_s, attempt}``.
A claim holds a lease like an invocation's (``attempt + 1``, ``lease_expires_at = now + lease_s``),
renewed by the claimer's heartbeat; ``expire_leases`` (sql.py) requeues a lapsed one or, on its last
attempt, finishes it with exit code -1. ``publish_exec_result`` records the first published result
(``{exit_code, stdout, stderr, resultInline?, resultRef?}``, any msgpack-able dict) and marks it
done, from the worker of the latest claim only (an admin, ``worker_id=None``, is not checked): a
superseded claim or another worker is refused. A claim whose lease lapsed may still publish while
no other claim has taken the job (its work is not thrown away). ``get_exec`` returns ``{exec_id,
namespace, state, queue, worker_id, command, timeout_s, created_at, claimed_at, finished_at,
attempt, max_attempts, result}`` where ``result`` is the published dict or None.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

import msgpack
import sqlalchemy as sa
from sqlalchemy.engine import Row

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid

from . import schema as t
from .api import AckResult, Principal
from .engine import Database
from .notify import exec_queue_channel
from .values import json_safe, normalize_max_attempts

# The result of an exec job whose lease lapsed on its last allowed attempt (see expire_leases).
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
TOKEN_PREFIX = "lsk_"
TOKEN_KINDS = frozenset({"admin", "producer", "daemon", "namespace"})


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


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


class SideMixin:
    db: Database

    def _insert(self, table: sa.Table) -> Any:
        raise NotImplementedError

    def _notify(self, *channels: str) -> None:
        raise NotImplementedError

    # -- workers and namespaces ------------------------------------------------------------------

    def register_worker(self, worker_id: str, info: dict[str, Any]) -> None:
        now = time.time()
        info = json_safe(info, "worker info")
        w = t.workers
        with self.db.tx(write=True) as conn:
            conn.execute(
                self._insert(w)
                .values(worker_id=worker_id, info=info, registered_at=now, last_seen=now)
                .on_conflict_do_update(index_elements=[w.c.worker_id], set_={"info": info, "last_seen": now})
            )

    def worker_info(self, worker_id: str) -> dict[str, Any] | None:
        w = t.workers
        with self.db.tx(write=False) as conn:
            info = conn.execute(sa.select(w.c.info).where(w.c.worker_id == worker_id)).scalar_one_or_none()
        return dict(info) if isinstance(info, dict) else None

    def pinned_version_for_worker(self, worker_id: str, namespace: str | None = None) -> str | None:
        w, n = t.workers, t.namespaces
        with self.db.tx(write=False) as conn:
            if namespace is None:
                info = conn.execute(
                    sa.select(w.c.info).where(w.c.worker_id == worker_id)
                ).scalar_one_or_none()
                registered = info.get("namespace") if isinstance(info, dict) else None
                namespace = registered if isinstance(registered, str) and registered else "default"
            return conn.execute(
                sa.select(n.c.nymph_version).where(n.c.name == namespace)
            ).scalar_one_or_none()

    def pin_version(self, namespace: str, version: str | None) -> None:
        now = time.time()
        n = t.namespaces
        with self.db.tx(write=True) as conn:
            conn.execute(
                self._insert(n)
                .values(name=namespace, nymph_version=version, updated_at=now)
                .on_conflict_do_update(
                    index_elements=[n.c.name], set_={"nymph_version": version, "updated_at": now}
                )
            )

    def pinned_version(self, namespace: str) -> str | None:
        n = t.namespaces
        with self.db.tx(write=False) as conn:
            return conn.execute(
                sa.select(n.c.nymph_version).where(n.c.name == namespace)
            ).scalar_one_or_none()

    # -- tokens ----------------------------------------------------------------------------------

    def create_token(self, kind: str, name: str, namespace: str | None = None) -> str:
        if kind not in TOKEN_KINDS:
            raise PlaneError(
                f"unknown token kind {kind!r}: use one of {', '.join(sorted(TOKEN_KINDS))}", status=400
            )
        if kind == "namespace" and not namespace:
            raise PlaneError("a namespace token needs a namespace: pass namespace=NAME", status=400)
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self.db.tx(write=True) as conn:
            conn.execute(
                sa.insert(t.tokens).values(
                    token_id=new_ulid(),
                    secret_sha256=_sha256(secret),
                    kind=kind,
                    namespace=namespace,
                    name=name,
                    created_at=time.time(),
                )
            )
        return secret

    def verify_token(self, secret: str) -> Principal | None:
        if not isinstance(secret, str) or not secret.startswith(TOKEN_PREFIX):
            return None
        digest = _sha256(secret)
        tk = t.tokens
        with self.db.tx(write=False) as conn:
            r = conn.execute(sa.select(tk).where(tk.c.secret_sha256 == digest)).first()
        if r is None or not hmac.compare_digest(r.secret_sha256, digest):
            return None
        return Principal(token_id=r.token_id, kind=r.kind, namespace=r.namespace, name=r.name)

    def count_tokens(self) -> int:
        with self.db.tx(write=False) as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t.tokens)).scalar_one())

    # -- exec jobs -------------------------------------------------------------------------------

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
                sa.insert(t.exec_jobs).values(
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
        e = t.exec_jobs
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
        e = t.exec_jobs
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
