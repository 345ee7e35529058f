"""Retention: finished invocations (with their frames and attempt history) and finished exec jobs
expire after a time set per queue, and are deleted in small batches.

``gc_batch`` deletes, in one transaction, at most ``limit`` invocations that finished (a terminal
state) longer ago than their queue's retention, with their journal (``frames``, a range of the
primary key per invocation) and their ``invocation_attempts`` rows, and at most ``limit`` exec jobs
(``done``) likewise. A call whose tree (its root and every descendant) still has a live call is
kept, so a tree goes whole. It answers the counts and the payload keys (``payload_ref.key`` of an
exec job and of its published result) the expired jobs referenced and no other job still names,
for the caller to delete from S3. The
candidates are read off ``ix_invocations_finished`` (finished_at, over finished rows only), so a
batch costs the same whatever the table holds; the server's sweep (``server/app.py``) and
``lakeshore gc`` call it until a batch comes back short, so the write lock (SQLite) or the rows
(PostgreSQL) are held for one small batch at a time.

Retention is ``default_s`` seconds, or ``per_queue[queue]`` for a queue named there; ``None`` or
``0`` keeps that queue's work for ever. Topics are not invocations and are kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.states import TERMINAL_STATES

from . import schema as t
from .api import GcResult as GcResult  # re-exported: gc_batch's answer
from .base import StoreBase
from .engine import retry_on_disconnect
from .exec_jobs import archive_keys

DEFAULT_GC_LIMIT = 200  # invocations (and exec jobs) per batch

_inv, _frames, _att, _exec = t.invocations, t.frames, t.invocation_attempts, t.exec_jobs


def _cutoffs(
    now: float, default_s: float | None, per_queue: Mapping[str, float | None]
) -> tuple[float | None, dict[str, float]]:
    """The default cutoff time (None: kept for ever) and each named queue's (absent: kept)."""
    default = now - default_s if default_s else None
    named = {q: now - s for q, s in per_queue.items() if s}
    return default, named


def _expired(
    table: sa.Table,
    key: sa.Column[Any],
    finished: Any,
    default: float | None,
    named: dict[str, float],
    kept: list[str],
) -> list[Any]:
    """One select per named queue (its cutoff) and one for the others (the default cutoff)."""
    selects = [
        sa.select(key).where(finished, table.c.queue == queue, table.c.finished_at < cutoff)
        for queue, cutoff in sorted(named.items())
    ]
    if default is not None:
        others = [finished, table.c.finished_at < default]
        if kept:
            others.append(table.c.queue.not_in(kept))
        selects.append(sa.select(key).where(*others))
    return selects


def _payload_keys(ref: Any, result: bytes | None) -> list[str]:
    """The S3 keys an exec job references: its ``payload_ref`` and its result's (``resultRef``),
    when present."""
    keys: list[str] = []
    refs = [ref]
    if result:
        try:
            published = msgpack.unpackb(result, raw=False)
        except Exception:  # a result that is not msgpack references nothing we know of
            published = None
        if isinstance(published, dict):  # resultRef: what the daemon published (server/namespaces.py)
            refs += [published.get("payload_ref"), published.get("payloadRef"), published.get("resultRef")]
    for item in refs:
        if isinstance(item, dict) and isinstance(item.get("key"), str):
            keys.append(item["key"])
    return keys


def _first_ids(conn: Connection, selects: Iterable[Any], limit: int) -> list[str]:
    """Up to ``limit`` ids from the expiry selects, taken in their order (one batch's worth)."""
    ids: list[str] = []
    for select in selects:
        if len(ids) >= limit:
            break
        ids += conn.execute(select.limit(limit - len(ids))).scalars().all()
    return ids


class RetentionStore(StoreBase):
    """Expiry of finished work (see the module docstring)."""

    @retry_on_disconnect
    def gc_batch(
        self,
        now: float,
        default_s: float | None,
        per_queue: Mapping[str, float | None] | None = None,
        *,
        limit: int = DEFAULT_GC_LIMIT,
    ) -> GcResult:
        """Delete one batch of expired work; see the module docstring."""
        per_queue = dict(per_queue or {})
        default, named = _cutoffs(now, default_s, per_queue)
        kept = sorted(per_queue)  # queues with their own rule (a cutoff, or kept for ever)
        limit = max(1, int(limit))
        out = GcResult()
        with self.db.tx(write=True) as conn:
            self._gc_invocations_in(conn, default, named, kept, limit, out)
            self._gc_exec_in(conn, default, named, kept, limit, out)
        return out

    def _gc_invocations_in(
        self,
        conn: Connection,
        default: float | None,
        named: dict[str, float],
        kept: list[str],
        limit: int,
        out: GcResult,
    ) -> None:
        terminal = sorted(TERMINAL_STATES)
        # a call's tree is kept whole while any call of it is live (the root, or a descendant:
        # ``root_invocation_id``, indexed): a finished parent deleted under a running child would
        # take the tree's status with it, and its cancel would no longer reach the child
        live, tree = _inv.alias("live"), sa.func.coalesce(_inv.c.root_invocation_id, _inv.c.invocation_id)
        idle_tree = ~sa.exists().where(
            sa.or_(live.c.root_invocation_id == tree, live.c.invocation_id == tree),
            live.c.state.not_in(terminal),
        )
        finished = sa.and_(_inv.c.finished_at.isnot(None), _inv.c.state.in_(terminal), idle_tree)
        selects = _expired(_inv, _inv.c.invocation_id, finished, default, named, kept)
        ids = _first_ids(conn, selects, limit)
        if not ids:
            return
        for (checkpoint,) in conn.execute(  # a finished call's checkpoint goes with it (issue 30)
            sa.select(_inv.c.checkpoint_ref).where(
                _inv.c.invocation_id.in_(ids), _inv.c.checkpoint_ref.isnot(None)
            )
        ):
            key = checkpoint.get("key") if isinstance(checkpoint, dict) else None
            if isinstance(key, str):
                out.payload_keys.append(key)
        owners = [*ids, *(f"send:{i}" for i in ids)]  # the journal and what was sent into the body
        out.frames += conn.execute(sa.delete(_frames).where(_frames.c.owner_id.in_(owners))).rowcount or 0
        out.attempts += conn.execute(sa.delete(_att).where(_att.c.invocation_id.in_(ids))).rowcount or 0
        out.invocations += conn.execute(sa.delete(_inv).where(_inv.c.invocation_id.in_(ids))).rowcount or 0

    def _gc_exec_in(
        self,
        conn: Connection,
        default: float | None,
        named: dict[str, float],
        kept: list[str],
        limit: int,
        out: GcResult,
    ) -> None:
        finished = sa.and_(_exec.c.finished_at.isnot(None), _exec.c.state == "done")
        ids = _first_ids(conn, _expired(_exec, _exec.c.exec_id, finished, default, named, kept), limit)
        if not ids:
            return
        keys: list[str] = []
        for exec_id, created_at, ref, result in conn.execute(
            sa.select(_exec.c.exec_id, _exec.c.created_at, _exec.c.payload_ref, _exec.c.result).where(
                _exec.c.exec_id.in_(ids)
            )
        ):
            keys += _payload_keys(ref, bytes(result) if result is not None else None)
            keys += archive_keys(exec_id, float(created_at))  # its output archive
        if keys:  # a payload another job still names (the same payloadRef sent twice) is kept
            still = set()
            for (ref,) in conn.execute(
                sa.select(_exec.c.payload_ref).where(
                    _exec.c.exec_id.not_in(ids), _exec.c.payload_ref.isnot(None)
                )
            ):
                still.update(_payload_keys(ref, None))
            keys = [k for k in keys if k not in still]
        out.payload_keys += keys
        out.exec_jobs += conn.execute(sa.delete(_exec).where(_exec.c.exec_id.in_(ids))).rowcount or 0

    def gc(
        self,
        now: float,
        default_s: float | None,
        per_queue: Mapping[str, float | None] | None = None,
        *,
        limit: int = DEFAULT_GC_LIMIT,
        max_batches: int = 1_000_000,
    ) -> GcResult:
        """``gc_batch`` until a batch comes back short (everything expired is gone)."""
        total = GcResult()
        for _ in range(max_batches):
            got = self.gc_batch(now, default_s, per_queue, limit=limit)
            total.add(got)
            if got.rows < limit:
                break
        return total
