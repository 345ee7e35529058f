"""The store's side tables: workers, namespaces (pinned nymph version), tokens and exec jobs.

Mixed into ``SqlStore``; it shares its ``Database`` and notifier.

Tokens: ``create_token`` returns ``"lsk_" + secrets.token_urlsafe(32)`` once; only its sha256 is
stored, and ``verify_token`` looks the hash up (no secret ever compared byte by byte).

Exec jobs (seed 003): ``create_exec`` queues a job (``state`` queued); ``claim_exec`` flips jobs of
the given queues (and of ``namespace``, when one is given: a daemon token bound to a namespace
never sees another namespace's jobs) that are meant for any worker or for the caller to running and returns the exec
command bodies ``{exec_id, namespace, command, payload_inline, payload_ref, timeout_s}``;
``publish_exec_result`` records the first published result (``{exit_code, stdout, stderr,
resultInline?, resultRef?}``, any msgpack-able dict) and marks it done; ``get_exec`` returns
``{exec_id, namespace, state, queue, worker_id, command, timeout_s, created_at, claimed_at,
finished_at, result}`` where ``result`` is the published dict or None.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

import msgpack
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid

from . import schema as t
from .api import Principal
from .engine import Database
from .values import json_safe

TOKEN_PREFIX = "lsk_"
TOKEN_KINDS = frozenset({"admin", "producer", "daemon", "namespace"})


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def exec_body(r: Row[Any]) -> dict[str, Any]:
    """The exec command body of a claimed exec_jobs row."""
    return {
        "exec_id": r.exec_id,
        "namespace": r.namespace,
        "command": r.command,
        "payload_inline": bytes(r.payload_inline) if r.payload_inline is not None else None,
        "payload_ref": r.payload_ref,
        "timeout_s": r.timeout_s,
    }


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
                )
            )
        self._notify(f"queue:{queue}", *([f"worker:{worker_id}"] if worker_id else []))
        return exec_id

    def claim_exec(
        self, worker_id: str, queues: list[str], limit: int = 1, *, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        if not queues or limit < 1:
            return []
        with self.db.tx(write=True) as conn:
            return self._claim_exec_in(conn, worker_id, queues, limit, time.time(), namespace)

    def _claim_exec_in(
        self,
        conn: Connection,
        worker_id: str,
        queues: list[str],
        limit: int,
        now: float,
        namespace: str | None = None,
    ) -> list[dict[str, Any]]:
        raise NotImplementedError

    def publish_exec_result(self, namespace: str, exec_id: str, result: dict[str, Any]) -> bool:
        """Record ``result``; False when no such job in that namespace. A repeat keeps the first."""
        e = t.exec_jobs
        try:
            blob = msgpack.packb(result, use_bin_type=True)
        except (TypeError, ValueError) as exc:
            raise PlaneError(f"exec result must be plain data (msgpack-able): {exc}", status=400) from exc
        with self.db.tx(write=True) as conn:
            found = conn.execute(
                sa.select(e.c.state).where(e.c.exec_id == exec_id, e.c.namespace == namespace)
            ).scalar_one_or_none()
            if found is None:
                return False
            conn.execute(
                sa.update(e)
                .where(e.c.exec_id == exec_id, e.c.state != "done")
                .values(state="done", result=blob, finished_at=time.time())
            )
        self._notify(f"exec:{exec_id}")
        return True

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
            "result": msgpack.unpackb(r.result, raw=False) if r.result is not None else None,
        }
