"""SqlStore: the one implementation of the store's invocation, journal and lease rules.

One SQLAlchemy Core code path serves SQLite and PostgreSQL; the only dialect-specific pieces are
the ``INSERT ... ON CONFLICT`` constructor and ``FOR UPDATE SKIP LOCKED`` (ignored by SQLite,
where ``BEGIN IMMEDIATE`` serialises writers instead). State changes are single conditional
``UPDATE ... RETURNING`` statements, so a refusal never half-applies.

Choices the seed leaves open, made here:

- an unknown ``parent_invocation_id`` is taken as the root (``root_invocation_id = parent``);
- a running invocation whose lease lapses after a cancel was requested becomes ``cancelled``
  instead of being requeued;
- frames of an invocation are accepted without ``attempt``; with it, only from the current attempt
  (also after that attempt was acked, so a late journal upload is kept).

Tokens, namespaces, workers and exec jobs live in ``side.py`` (mixed in here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid

from . import schema as t
from . import values
from .api import (
    ACK_STATES,
    DEFAULT_LEASE_S,
    AckResult,
    ChunkResult,
    Command,
    Frame,
    Invocation,
    Store,
    SubmitRequest,
    SubmitResult,
)
from .engine import Database, migrate
from .notify import Notifier, exec_queue_channel
from .side import EXEC_LEASE_EXPIRED, SideMixin, exec_body

log = logging.getLogger(__name__)

TOPIC_PREFIX = "topic:"
FRAME_VALUE, FRAME_END = 1, 2  # wire.FRAME_VALUE / FRAME_END; the store does not import the codec
CANCEL_REASON = "cancelled by producer"
LEASE_EXPIRED = {
    "type": "LeaseExpired",
    "message": "the worker stopped renewing the lease on the last allowed attempt (run_config.max_attempts)",
}

_inv = t.invocations
_claim_order = (_inv.c.priority.desc(), _inv.c.submitted_at.asc(), _inv.c.invocation_id.asc())


_INV_COLS = tuple(c.name for c in _inv.c)


def _row_to_invocation(r: Row[Any]) -> Invocation:
    """An Invocation from a row holding every invocations column (``select(_inv)`` / returning)."""
    m = dict(zip(_INV_COLS, r, strict=True))
    result_blob = m["result_blob"]
    return Invocation(
        invocation_id=m["invocation_id"],
        queue=m["queue"],
        state=m["state"],
        priority=int(m["priority"]),
        function=m["function"],
        args_blob=bytes(m["args_blob"]),
        run_config=m["run_config"],
        code_context=m["code_context"],
        namespace=m["namespace"],
        attempt=m["attempt"],
        max_attempts=m["max_attempts"],
        parent_invocation_id=m["parent_invocation_id"],
        root_invocation_id=m["root_invocation_id"],
        idempotency_key=m["idempotency_key"],
        worker_id=m["worker_id"],
        submitted_at=m["submitted_at"],
        started_at=m["started_at"],
        finished_at=m["finished_at"],
        lease_expires_at=m["lease_expires_at"],
        result_blob=bytes(result_blob) if result_blob is not None else None,
        error=m["error"],
        cancel_requested=bool(m["cancel_requested"]),
    )


class _Statements:
    """The hot paths' statements, built once per dialect with bind parameters.

    Reusing one statement object lets SQLAlchemy memoize its cache key and reuse the compiled SQL
    from the engine's compiled cache, so a call pays for executing, not for building and compiling.
    Lists (queues of a claim, leases of a heartbeat) are ``expanding`` parameters.
    """

    def __init__(self, dialect: str) -> None:
        B = sa.bindparam
        insert: Any
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            insert = pg_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            insert = sqlite_insert
        f, tp, c = t.frames, t.topics, t.commands
        self.insert_queue = (
            insert(t.queues).values(name=B("queue"), created_at=B("now")).on_conflict_do_nothing()
        )
        self.insert_function = (
            insert(t.functions)
            .values(function_key=B("fkey"), function=B("function", type_=sa.JSON), created_at=B("now"))
            .on_conflict_do_nothing()
        )
        self.insert_invocation = (
            insert(_inv)
            .values({col: B(col, type_=_inv.c[col].type) for col in _SUBMIT_COLS})
            .on_conflict_do_nothing()
            .returning(_inv.c.invocation_id)
        )
        self.root_of = sa.select(_inv.c.root_invocation_id).where(_inv.c.invocation_id == B("id"))
        self.same_id = sa.select(_inv.c.queue, _inv.c.content_hash).where(_inv.c.invocation_id == B("id"))
        self.same_key = sa.select(_inv.c.invocation_id).where(
            _inv.c.queue == B("queue"), _inv.c.idempotency_key == B("key")
        )
        self.get = sa.select(_inv).where(_inv.c.invocation_id == B("id"))
        self.attempt_of = sa.select(_inv.c.attempt).where(_inv.c.invocation_id == B("id"))
        pick = (
            sa.select(_inv.c.invocation_id)
            .where(_inv.c.state == "queued", _inv.c.queue.in_(B("queues", expanding=True)))
            .order_by(*_claim_order)
            .limit(B("limit", type_=sa.Integer))
            .with_for_update(skip_locked=True)
            .cte("picked")
            .prefix_with("MATERIALIZED")  # evaluated once: a bare IN (subquery) may run it per row
        )
        self.claim = (
            sa.update(_inv)
            .where(_inv.c.invocation_id.in_(sa.select(pick.c.invocation_id)), _inv.c.state == "queued")
            .values(
                state="running",
                worker_id=B("worker"),
                attempt=_inv.c.attempt + 1,
                started_at=B("now"),
                lease_expires_at=B("lease"),
            )
            .returning(*_inv.c)
        )
        self.ack: dict[tuple[bool, bool], Any] = {}
        for by_attempt in (False, True):
            for by_worker in (False, True):
                conds = [_inv.c.invocation_id == B("id"), _inv.c.state == "running"]
                if by_attempt:
                    conds.append(_inv.c.attempt == B("b_attempt"))
                if by_worker:
                    conds.append(_inv.c.worker_id == B("worker"))
                self.ack[by_attempt, by_worker] = (
                    sa.update(_inv)
                    .where(*conds)
                    .values(
                        state=B("b_state"),
                        finished_at=B("now"),
                        result_blob=B("blob", type_=_inv.c.result_blob.type),
                        error=B("b_error", type_=_inv.c.error.type),
                        lease_expires_at=None,
                    )
                    .returning(_inv.c.invocation_id)
                )
        self.insert_frame = (
            insert(f)
            .values(owner_id=B("owner"), seq=B("seq"), data=B("data"), final=B("final"), created_at=B("now"))
            .on_conflict_do_nothing()
            .returning(f.c.seq)
        )
        self.read_frames = (
            sa.select(f.c.seq, f.c.data, f.c.final)
            .where(f.c.owner_id == B("owner"), f.c.seq > B("since"))
            .order_by(f.c.seq)
            .limit(B("limit", type_=sa.Integer))
        )
        self.touch_worker = (
            sa.update(t.workers).where(t.workers.c.worker_id == B("worker")).values(last_seen=B("now"))
        )
        self.renew = (
            sa.update(_inv)
            .where(
                sa.tuple_(_inv.c.invocation_id, _inv.c.attempt).in_(B("pairs", expanding=True)),
                _inv.c.state == "running",
                _inv.c.worker_id == B("worker"),
            )
            .values(lease_expires_at=B("lease"))
            .returning(_inv.c.invocation_id)
        )
        self.take_commands = (
            sa.delete(c)
            .where(c.c.worker_id == B("worker"))
            .returning(c.c.command_id, c.c.kind, c.c.body, c.c.created_at)
        )
        self.topic_next = (
            insert(tp)
            .values(name=B("name"), next_seq=1, created_at=B("now"))
            .on_conflict_do_update(index_elements=[tp.c.name], set_={"next_seq": tp.c.next_seq + 1})
            .returning(tp.c.next_seq)
        )
        self.topic_frame = sa.insert(f).values(
            owner_id=B("owner"), seq=B("seq"), data=B("data"), final=B("final"), created_at=B("now")
        )
        e = t.exec_jobs
        # One statement per "any namespace" / "this namespace only" (a daemon token bound to one).
        self.claim_exec: dict[bool, Any] = {}
        for by_namespace in (False, True):
            conds = [
                e.c.state == "queued",
                e.c.queue.in_(B("queues", expanding=True)),
                sa.or_(e.c.worker_id.is_(None), e.c.worker_id == B("worker")),
            ]
            if by_namespace:
                conds.append(e.c.namespace == B("b_namespace"))
            pick_exec = (
                sa.select(e.c.exec_id)
                .where(*conds)
                .order_by(e.c.created_at, e.c.exec_id)
                .limit(B("limit", type_=sa.Integer))
                .with_for_update(skip_locked=True)
                .cte("picked_exec")
                .prefix_with("MATERIALIZED")
            )
            self.claim_exec[by_namespace] = (
                sa.update(e)
                .where(e.c.exec_id.in_(sa.select(pick_exec.c.exec_id)), e.c.state == "queued")
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
        self.renew_exec = (
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
        self.renew_all_exec = (
            sa.update(e)
            .where(e.c.claimed_by == B("worker"), e.c.state == "running")
            .values(lease_expires_at=B("lease"))
        )


_SUBMIT_COLS = (
    "invocation_id",
    "queue",
    "state",
    "priority",
    "function_key",
    "function",
    "args_blob",
    "run_config",
    "code_context",
    "namespace",
    "content_hash",
    "attempt",
    "max_attempts",
    "parent_invocation_id",
    "root_invocation_id",
    "idempotency_key",
    "submitted_at",
    "cancel_requested",
)
_STATEMENTS: dict[str, _Statements] = {}


def _statements(dialect: str) -> _Statements:
    st = _STATEMENTS.get(dialect)
    if st is None:
        st = _STATEMENTS[dialect] = _Statements(dialect)
    return st


class SqlStore(SideMixin):
    """The Store protocol over SQLite (file or ``:memory:``) or PostgreSQL."""

    def __init__(self, url: str, *, notifier: Notifier | None = None, migrate_schema: bool = True) -> None:
        self.db = Database(url)
        self.notifier = notifier if notifier is not None else Notifier()
        self._st = _statements(self.db.dialect)
        if migrate_schema:
            migrate(self.db)

    @property
    def kind(self) -> str:
        """``"sqlite"`` or ``"postgresql"`` (for /healthz)."""
        return self.db.dialect

    def close(self) -> None:
        self.db.dispose()

    # -- helpers ---------------------------------------------------------------------------------

    def _insert(self, table: sa.Table) -> Any:
        if self.db.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)

    def _notify(self, *channels: str) -> None:
        for ch in channels:
            self.notifier.notify(ch)

    # -- producer side ---------------------------------------------------------------------------

    def submit(self, req: SubmitRequest) -> SubmitResult:
        st = self._st
        queue = req.queue or str(req.run_config.get("queue") or "") or "default"
        run_config = values.json_safe({**req.run_config, "queue": queue}, "run_config")
        function = values.json_safe(req.function, "function")
        code_context = values.json_safe(req.code_context or {}, "code_context")
        key = values.idempotency_key(run_config)
        chash = values.content_hash(req, queue, run_config)
        fkey = values.function_key(function)
        now = time.time()
        with self.db.tx(write=True) as conn:
            conn.execute(st.insert_queue, {"queue": queue, "now": now})
            conn.execute(st.insert_function, {"fkey": fkey, "function": function, "now": now})
            root = None
            if req.parent_invocation_id:
                parent_root = conn.execute(st.root_of, {"id": req.parent_invocation_id}).scalar_one_or_none()
                root = parent_root or req.parent_invocation_id
            row = {
                "invocation_id": req.invocation_id,
                "queue": queue,
                "state": "queued",
                "priority": values.normalize_priority(run_config.get("priority")),
                "function_key": fkey,
                "function": function,
                "args_blob": bytes(req.args_blob),
                "run_config": run_config,
                "code_context": code_context,
                "namespace": req.namespace or "default",
                "content_hash": chash,
                "attempt": 0,
                "max_attempts": values.normalize_max_attempts(run_config.get("max_attempts")),
                "parent_invocation_id": req.parent_invocation_id,
                "root_invocation_id": root,
                "idempotency_key": key,
                "submitted_at": now,
                "cancel_requested": False,
            }
            # Insert first: ON CONFLICT DO NOTHING covers the id and the (queue, key) unique index,
            # so only a conflict needs the lookups that tell a duplicate from a clash.
            if conn.execute(st.insert_invocation, row).first() is None:
                existing = self._existing(conn, req.invocation_id, chash, queue, key)
                if existing is None:
                    raise PlaneError(f"submit of {req.invocation_id} conflicted; retry it", status=409)
                return existing
        self._notify(f"queue:{queue}", f"inv:{req.invocation_id}")
        return SubmitResult(invocation_id=req.invocation_id, queue=queue)

    def _existing(
        self, conn: Connection, invocation_id: str, chash: str, queue: str, key: str | None
    ) -> SubmitResult | None:
        same = conn.execute(self._st.same_id, {"id": invocation_id}).first()
        if same is not None:
            if same.content_hash != chash:
                raise PlaneError(
                    f"invocation {invocation_id} already exists with different content; "
                    "submit new work under a new invocation_id",
                    status=409,
                )
            return SubmitResult(invocation_id=invocation_id, queue=same.queue, duplicate=True)
        if key is not None:
            other = conn.execute(self._st.same_key, {"queue": queue, "key": key}).scalar_one_or_none()
            if other is not None:
                return SubmitResult(invocation_id=other, queue=queue, duplicate=True)
        return None

    def get(self, invocation_id: str) -> Invocation | None:
        with self.db.tx(write=False) as conn:
            r = conn.execute(self._st.get, {"id": invocation_id}).first()
        return _row_to_invocation(r) if r is not None else None

    def cancel(self, invocation_id: str) -> str | None:
        now = time.time()
        notify: list[str] = []
        with self.db.tx(write=True) as conn:
            if conn.execute(
                sa.update(_inv)
                .where(_inv.c.invocation_id == invocation_id, _inv.c.state == "queued")
                .values(state="cancelled", finished_at=now, cancel_requested=True)
                .returning(_inv.c.invocation_id)
            ).first():
                state: str | None = "cancelled"
                notify.append(f"inv:{invocation_id}")
            else:
                worker = conn.execute(
                    sa.update(_inv)
                    .where(
                        _inv.c.invocation_id == invocation_id,
                        _inv.c.state == "running",
                        _inv.c.cancel_requested == sa.false(),
                    )
                    .values(cancel_requested=True)
                    .returning(_inv.c.worker_id)
                ).scalar_one_or_none()
                if worker is not None:
                    conn.execute(
                        sa.insert(t.commands).values(
                            command_id=new_ulid(),
                            worker_id=worker,
                            kind="cancel",
                            body={"invocation_id": invocation_id, "reason": CANCEL_REASON},
                            created_at=now,
                        )
                    )
                    notify += [f"worker:{worker}", f"inv:{invocation_id}"]
                state = conn.execute(
                    sa.select(_inv.c.state).where(_inv.c.invocation_id == invocation_id)
                ).scalar_one_or_none()
        self._notify(*notify)
        return state

    # -- daemon side -----------------------------------------------------------------------------

    def claim(
        self, worker_id: str, queues: list[str], limit: int = 1, lease_s: float = DEFAULT_LEASE_S
    ) -> list[Invocation]:
        if not queues or limit < 1:
            return []
        with self.db.tx(write=True) as conn:
            got = self._claim_in(conn, worker_id, queues, limit, lease_s, time.time())
        self._notify(*(f"inv:{i.invocation_id}" for i in got))
        return got

    def _claim_in(
        self, conn: Connection, worker_id: str, queues: list[str], limit: int, lease_s: float, now: float
    ) -> list[Invocation]:
        params = {
            "queues": list(queues),
            "limit": int(limit),
            "worker": worker_id,
            "now": now,
            "lease": now + lease_s,
        }
        rows = conn.execute(self._st.claim, params).fetchall()
        return sorted(
            (_row_to_invocation(r) for r in rows),
            key=lambda i: (-i.priority, i.submitted_at, i.invocation_id),
        )

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
        stmt = self._st.claim_exec[namespace is not None]
        rows = sorted(conn.execute(stmt, params), key=lambda r: (r.created_at, r.exec_id))
        return [exec_body(r) for r in rows]

    def _take_commands_in(self, conn: Connection, worker_id: str, now: float) -> list[Command]:
        st = self._st
        conn.execute(st.touch_worker, {"worker": worker_id, "now": now})
        # DELETE ... RETURNING: each pending command goes to exactly one caller.
        rows = sorted(
            conn.execute(st.take_commands, {"worker": worker_id}),
            key=lambda r: (r.created_at, r.command_id),
        )
        return [Command(id=r.command_id, kind=r.kind, body=r.body) for r in rows]

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
                claimed = self._claim_in(conn, worker_id, queues, limit, lease_s, now)
                if exec_jobs and len(claimed) < limit:
                    left = limit - len(claimed)
                    jobs = self._claim_exec_in(conn, worker_id, queues, left, now, namespace, lease_s)
        self._notify(*(f"inv:{i.invocation_id}" for i in claimed))
        return commands, claimed, jobs

    def ack(
        self,
        invocation_id: str,
        state: str,
        *,
        attempt: int | None,
        worker_id: str | None,
        result_blob: bytes | None,
        error: dict[str, Any] | None,
    ) -> AckResult:
        if state not in ACK_STATES:
            raise PlaneError(
                f"cannot ack state {state!r}: use one of {', '.join(sorted(ACK_STATES))}", status=400
            )
        if error is not None and not isinstance(error, dict):
            error = {"type": "DaemonError", "message": str(error)}
        if error is not None:
            error = values.json_safe(error, "error")
        blob = bytes(result_blob) if result_blob else None
        params: dict[str, Any] = {
            "id": invocation_id,
            "b_state": state,
            "now": time.time(),
            "blob": blob,
            "b_error": error,
        }
        if attempt is not None:
            params["b_attempt"] = attempt
        if worker_id is not None:
            params["worker"] = worker_id
        row: Row[Any] | None = None
        with self.db.tx(write=True) as conn:
            done = conn.execute(self._st.ack[attempt is not None, worker_id is not None], params).first()
            if done is None:
                row = conn.execute(self._st.get, {"id": invocation_id}).first()
        if done is not None:
            self._notify(f"inv:{invocation_id}")
            return AckResult(ok=True, state=state)
        if row is None:
            return AckResult(ok=False, reason=f"unknown invocation {invocation_id}")
        inv = _row_to_invocation(row)
        if attempt is not None and attempt != inv.attempt:
            return AckResult(
                ok=False,
                state=inv.state,
                reason=f"attempt {attempt} of {invocation_id} was superseded by attempt {inv.attempt}",
            )
        if worker_id is not None and worker_id != inv.worker_id:
            return AckResult(
                ok=False, state=inv.state, reason=f"{invocation_id} is not owned by worker {worker_id}"
            )
        if inv.state == state and (inv.result_blob or None) == blob and inv.error == error:
            return AckResult(ok=True, duplicate=True, state=inv.state)
        return AckResult(
            ok=False, state=inv.state, reason=f"{invocation_id} is {inv.state}, not running; outcome refused"
        )

    def append_frame(
        self, owner_id: str, seq: int, data: bytes, final: bool, *, attempt: int | None = None
    ) -> ChunkResult:
        if seq < 0:
            raise PlaneError(f"frame seq must be >= 0, got {seq}", status=400)
        with self.db.tx(write=True) as conn:
            if attempt is not None and not owner_id.startswith(TOPIC_PREFIX):
                current = conn.execute(self._st.attempt_of, {"id": owner_id}).scalar_one_or_none()
                if current is None:
                    return ChunkResult(ok=False, seq=seq, reason=f"unknown invocation {owner_id}")
                if current != attempt:
                    return ChunkResult(
                        ok=False,
                        seq=seq,
                        reason=f"attempt {attempt} of {owner_id} was superseded by attempt {current}",
                    )
            added = conn.execute(
                self._st.insert_frame,
                {
                    "owner": owner_id,
                    "seq": seq,
                    "data": bytes(data),
                    "final": bool(final),
                    "now": time.time(),
                },
            ).first()
        if added is None:
            return ChunkResult(ok=True, seq=seq, duplicate=True)
        self._notify(owner_id if owner_id.startswith(TOPIC_PREFIX) else f"inv:{owner_id}")
        return ChunkResult(ok=True, seq=seq)

    def read_frames(self, owner_id: str, since: int = -1, limit: int = 1000) -> list[Frame]:
        params = {"owner": owner_id, "since": since, "limit": max(0, limit)}
        with self.db.tx(write=False) as conn:
            rows = conn.execute(self._st.read_frames, params).fetchall()
        return [Frame(seq=int(seq), data=bytes(data), final=bool(final)) for seq, data, final in rows]

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
        wanted_exec = {(exec_id, int(att)) for exec_id, att in running_exec or ()}
        st = self._st
        lease = now + lease_s
        with self.db.tx(write=True) as conn:
            kept: set[str] = set()
            if wanted:
                params = {"pairs": sorted(wanted), "worker": worker_id, "lease": lease}
                kept = set(conn.execute(st.renew, params).scalars())
            if running_exec is None:
                conn.execute(st.renew_all_exec, {"worker": worker_id, "lease": lease})
            elif wanted_exec:
                params = {"pairs": sorted(wanted_exec), "worker": worker_id, "lease": lease}
                kept |= set(conn.execute(st.renew_exec, params).scalars())
            commands = self._take_commands_in(conn, worker_id, now)
        lost = sorted({i for i, _ in wanted} - kept) + sorted({i for i, _ in wanted_exec} - kept)
        return commands, lost

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        lapsed = (_inv.c.state == "running", _inv.c.lease_expires_at < now)
        gone = {"worker_id": None, "lease_expires_at": None}
        with self.db.tx(write=True) as conn:
            cancelled = conn.execute(
                sa.update(_inv)
                .where(*lapsed, _inv.c.cancel_requested == sa.true())
                .values(state="cancelled", finished_at=now, **gone)
                .returning(_inv.c.invocation_id)
            ).fetchall()
            requeued = conn.execute(
                sa.update(_inv)
                .where(*lapsed, _inv.c.attempt < _inv.c.max_attempts)
                .values(state="queued", started_at=None, **gone)
                .returning(_inv.c.invocation_id, _inv.c.queue)
            ).fetchall()
            failed = conn.execute(
                sa.update(_inv)
                .where(*lapsed)
                .values(state="failed", finished_at=now, error=LEASE_EXPIRED, lease_expires_at=None)
                .returning(_inv.c.invocation_id)
            ).fetchall()
            e = t.exec_jobs
            lapsed_exec = (e.c.state == "running", e.c.lease_expires_at < now)
            # claimed_by stays: the lapsed claim may still publish until another claim supersedes it
            exec_requeued = conn.execute(
                sa.update(e)
                .where(*lapsed_exec, e.c.attempt < e.c.max_attempts)
                .values(state="queued", lease_expires_at=None)
                .returning(e.c.exec_id, e.c.queue, e.c.namespace, e.c.worker_id)
            ).fetchall()
            exec_failed = conn.execute(
                sa.update(e)
                .where(*lapsed_exec)
                .values(state="done", finished_at=now, lease_expires_at=None, result=EXEC_LEASE_EXPIRED)
                .returning(e.c.exec_id)
            ).fetchall()
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

    # -- topics ----------------------------------------------------------------------------------

    def topic_post(self, name: str, body: bytes, final: bool = False) -> int:
        return self.topic_append(name, body, final).seq

    def topic_append(self, name: str, body: bytes, final: bool = False) -> Frame:
        now = time.time()
        st = self._st
        with self.db.tx(write=True) as conn:
            seq = int(conn.execute(st.topic_next, {"name": name, "now": now}).scalar_one()) - 1
            data = msgpack.packb([FRAME_END if final else FRAME_VALUE, seq, bytes(body), {"ts": now}])
            params = {
                "owner": TOPIC_PREFIX + name,
                "seq": seq,
                "data": data,
                "final": bool(final),
                "now": now,
            }
            conn.execute(st.topic_frame, params)
        self._notify(TOPIC_PREFIX + name)
        return Frame(seq=seq, data=data, final=bool(final))


def _conforms(store: SqlStore) -> Store:
    """Never called: makes mypy check SqlStore against the Store protocol."""
    return store
