"""Claim scheduling: which queued invocations a claim takes, and in what order.

The order is priority desc, submitted_at asc, invocation_id asc, read straight off an index of
queued rows (``ix_invocations_queued``: queue, shape, then that order), so a claim costs the same
at any backlog. A claim reads *heads*: one (queue, shape) range of that index each, the shapes
being those its poller may take (store/placement.py: what the call needs against what the poller
has free). :class:`Placer` decides the heads from the small ``shapes`` table (cached here) and
the ``limits`` table; the statements built here are run by ``InvocationStore._claim_in``
(invocations.py) inside the claim transaction:

- the *plain* claim (every head fits any number of calls, no limit applies: the usual case, and
  a poller offering nothing) is one statement, as before: the heads' first rows merged, the best
  ``limit`` of them updated (:func:`claim_statement`);
- a *placed* claim (a head needs GPUs, or a limit applies) picks the heads' first rows (locked,
  :func:`pick_statement`), takes them greedily in claim order while the poller's free GPUs and
  the limits' room last, and updates those by key (:func:`take_statement`). A call that does not
  fit is skipped, never claimed: it stays queued for a poller it fits.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import schema as t
from .direct import Direct
from .placement import PLAIN, Needs, Offer

_inv = t.invocations
_claim_order = (_inv.c.priority.desc(), _inv.c.submitted_at.asc(), _inv.c.invocation_id.asc())
# Claims of up to this many heads (queue, shape) merge each head's best rows (see claim_statement).
MERGED_QUEUES_MAX = 32
REFRESH_S = 1.0  # how stale the cached shapes and limits may be (another replica's new ones)
PLANS_MAX = 1024  # plans remembered (``Placer.plan``): one per poller's queues and offer


Head = tuple[str, str]  # (queue, shape)


def _queued(by_namespace: bool) -> Any:
    # Literals, not bind parameters, where the plan depends on them: a generic plan (PostgreSQL
    # prepares a statement run often, and may keep one plan for any values) can then prove the
    # partial index's predicate.
    due: Any = sa.and_(_inv.c.state == sa.literal_column("'queued'"), _inv.c.not_before.is_(None))
    if by_namespace:
        due = sa.and_(due, _inv.c.namespace == sa.bindparam("b_namespace"))
    return due


def _head(i: int) -> Any:
    return sa.and_(_inv.c.queue == sa.bindparam(f"q{i}"), _inv.c.shape == sa.bindparam(f"s{i}"))


def _picks(n_heads: int, by_namespace: bool, cols: Sequence[Any], limit: Any) -> Any:
    """The first ``limit`` rows of each head, merged in claim order, locked ``FOR UPDATE SKIP
    LOCKED`` on PostgreSQL. Several heads: ``cols`` then ``priority`` and ``submitted_at``; at
    most ``MERGED_QUEUES_MAX`` (a claim of more picks them in groups: :func:`head_groups`)."""
    if n_heads > MERGED_QUEUES_MAX:
        raise ValueError(f"a pick of {n_heads} heads: at most {MERGED_QUEUES_MAX} (head_groups)")
    queued = _queued(by_namespace)
    if n_heads == 1:  # its first ``limit`` rows: every row of one head has the same needs, so a
        # placed claim (Plan.choose) that skips one skips every later one too
        return (
            sa.select(*cols)
            .where(queued, _head(0))
            .order_by(*_claim_order)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    full = (*cols, _inv.c.priority, _inv.c.submitted_at)
    firsts = [
        sa.select(*full)
        .where(queued, _head(i))
        .order_by(*_claim_order)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .subquery(f"h{i}")
        for i in range(n_heads)
    ]
    merged = sa.union_all(*(sa.select(*sub.c) for sub in firsts))
    best = merged.selected_columns
    return merged.order_by(best.priority.desc(), best.submitted_at.asc(), best.invocation_id.asc())


def _claimed(where: Any) -> Any:
    B = sa.bindparam
    return (
        sa.update(_inv)
        .where(where)
        .values(
            state="running",
            worker_id=B("worker"),
            attempt=_inv.c.attempt + 1,
            started_at=B("now"),
            lease_expires_at=B("lease"),
        )
        .returning(*_inv.c)
    )


@functools.cache
def claim_statement(n_heads: int, by_namespace: bool = False) -> Any:
    """The plain claim of up to ``:limit`` queued invocations of ``n_heads`` heads, best first.

    Parameters: ``q0``/``s0`` .. ``q<n-1>``/``s<n-1>`` (each head's queue and shape), ``limit``,
    ``worker``, ``now``, ``lease``; past ``MERGED_QUEUES_MAX`` heads, ``heads`` (a list of
    pairs) instead; with ``by_namespace``, ``b_namespace``: only that namespace's invocations,
    read off ``ix_invocations_queued_ns`` (namespace, queue, shape, then the same order).

    One head is one index range read up to ``limit`` rows, no sort. Several take the first
    ``limit`` rows of each (each locked ``FOR UPDATE SKIP LOCKED`` on PostgreSQL) and keep the best
    ``limit`` of those, so the sort is over at most ``n_heads * limit`` rows whatever the backlog;
    the rows picked but not kept stay locked until the claim commits, and a concurrent claim skips
    them meanwhile. At most ``MERGED_QUEUES_MAX`` heads (SQLite caps a compound SELECT at 500
    terms): a claim of more picks its heads in groups and takes its choice by key
    (``InvocationStore._claim_in``, :func:`head_groups`), still ``n_heads * limit`` rows at most.

    The update finds the picked rows by primary key only: no ``state`` test there, which SQLite
    would plan as a scan of queued rows by a state index. None is needed: on SQLite the statement
    runs under the write lock, and on PostgreSQL every picked row is locked, re-checked as queued,
    until the transaction ends. ``limit`` is rendered into the SQL at execution (a generic plan
    then knows how many rows the claim takes): one statement text per limit in use.
    """
    limit = sa.bindparam("limit", type_=sa.Integer, literal_execute=True)
    pick = _picks(n_heads, by_namespace, (_inv.c.invocation_id,), limit)
    picked = (
        pick.limit(limit)
        .cte("picked")
        .prefix_with("MATERIALIZED")  # evaluated once: a bare IN (subquery) may run it per row
    )
    return Direct(_claimed(_inv.c.invocation_id.in_(sa.select(picked.c.invocation_id))))


@functools.cache
def claimed_insert_statement(n_heads: int, by_namespace: bool = False) -> Direct:
    """SQLite: a submit's row inserted as a plain claim of ``n_heads`` heads would leave it
    (state running, ``attempt``, ``worker_id``, ``started_at`` and ``lease_expires_at`` given),
    only when none of those heads holds a due queued row (each head probed off its index of queued
    rows, as the claim reads it); ``RETURNING`` the whole row, as the claim's update does. Nothing
    is inserted (no row returned) when one does, or on a conflict (``ON CONFLICT DO NOTHING``).
    Parameters: the insert's (``invocation_rows._SUBMIT_COLS``, and the three of the claim) and the
    heads' (``head_params``).

    Why it writes what the insert and the pass's claim would (``InvocationStore._claim_on_insert_in``
    runs it for a batch of one submit and the pass it was handed, nothing else): under SQLite's
    write lock nothing changes between the probe and the insert; with no due row in the heads but
    the new one, a plain claim (no limit, no GPU: ``Plan.placed`` false) of any ``limit`` takes that
    row alone and leaves it running, ``attempt`` + 1, its worker, ``started_at`` now and its lease,
    exactly the values inserted here; and the submit is a lone insert (no quota counting queued
    rows, no parent, nothing new to name), due now. One statement where there were two, and the
    two indexes of queued rows untouched (tests/contract/test_claim_on_insert.py compares both)."""
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    from .invocation_rows import _SUBMIT_COLS

    cols = (*_SUBMIT_COLS, "worker_id", "started_at", "lease_expires_at")
    row = sa.select(*(sa.bindparam(c, type_=_inv.c[c].type) for c in cols))
    none_due = [~sa.exists().where(_queued(by_namespace), _head(i)) for i in range(n_heads)]
    insert = sqlite_insert(_inv).from_select(cols, row.where(*none_due))  # (its WHERE: the upsert's parse)
    return Direct(insert.on_conflict_do_nothing().returning(*_inv.c), "sqlite")


@functools.cache
def pick_statement(n_heads: int, by_namespace: bool = False) -> Any:
    """A placed claim's pick: ``(invocation_id, queue, shape)`` of each head's first ``:limit``
    rows, in claim order, locked; parameters as :func:`claim_statement`'s (no worker, now, lease)."""
    limit = sa.bindparam("limit", type_=sa.Integer, literal_execute=True)
    return _picks(n_heads, by_namespace, (_inv.c.invocation_id, _inv.c.queue, _inv.c.shape), limit)


@functools.cache
def take_statement() -> Any:
    """A placed claim's update of the rows it chose (``ids``, picked and locked by its pick)."""
    return _claimed(_inv.c.invocation_id.in_(sa.bindparam("ids", expanding=True)))


def head_params(heads: Sequence[Head], namespace: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for i, (queue, shape) in enumerate(heads):
        params[f"q{i}"], params[f"s{i}"] = queue, shape
    if namespace is not None:
        params["b_namespace"] = namespace
    return params


def head_groups(heads: Sequence[Head]) -> list[Sequence[Head]]:
    """``heads`` (more than ``MERGED_QUEUES_MAX``) in groups of at most that many, as even as may
    be: each group at least two heads, so each pick returns the columns a merge sorts by."""
    n, count = -(-len(heads) // MERGED_QUEUES_MAX), len(heads)
    return [heads[i * count // n : (i + 1) * count // n] for i in range(n)]


def pick_rows(conn: Connection, heads: Sequence[Head], limit: int, namespace: str | None) -> list[Any]:
    """Each head's first ``limit`` rows, locked, in claim order (``invocation_id``, ``queue``,
    ``shape``, ...): one :func:`pick_statement`, or past ``MERGED_QUEUES_MAX`` heads one for each
    of :func:`head_groups`, merged (:func:`merged_picks`)."""
    groups = [heads] if len(heads) <= MERGED_QUEUES_MAX else head_groups(heads)
    picks = [
        conn.execute(
            pick_statement(len(group), namespace is not None),
            {"limit": int(limit), **head_params(group, namespace)},
        ).fetchall()
        for group in groups
    ]
    return list(picks[0]) if len(picks) == 1 else merged_picks(picks)


def merged_picks(groups: Sequence[Sequence[Any]]) -> list[Any]:
    """The rows of several groups' picks (``invocation_id``, ``queue``, ``shape``, ``priority``,
    ``submitted_at``) in claim order: priority desc, submitted_at, invocation_id."""
    rows = [row for group in groups for row in group]
    rows.sort(key=lambda r: (-r[3], r[4], r[0]))
    return rows


def claim_params(
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    now: float,
    lease_s: float,
    namespace: str | None = None,
    heads: Sequence[Head] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The plain claim statement for ``heads`` (default: the plain shape of each of ``queues``;
    of ``namespace`` when given; see :func:`claim_statement`) and its parameters."""
    if heads is None:
        heads = [(q, PLAIN) for q in sorted(set(queues))]  # a queue named twice must not be picked twice
    params = {"limit": int(limit), "worker": worker_id, "now": now, "lease": now + lease_s}
    params.update(head_params(heads, namespace))
    return claim_statement(len(heads), namespace is not None), params


QUEUE_PREFIX, KEY_PREFIX = "queue:", "key:"


def queue_limit(queue: str) -> str:
    """The ``limits`` row of a queue's ``--max-running``."""
    return QUEUE_PREFIX + queue


def key_limit(key: str) -> str:
    """The ``limits`` row of a concurrency key's ``max_concurrency``."""
    return KEY_PREFIX + key


@dataclass
class Plan:
    """What one claim reads and how it takes: its heads, and when placed, what bounds the take."""

    heads: list[Head]
    placed: bool = False
    needs: dict[Head, Needs] = field(default_factory=dict)
    room: dict[str, int] = field(default_factory=dict)  # limits row name -> calls it may take still

    def choose(self, rows: Sequence[Any], limit: int, offer: Offer) -> list[str]:
        """The picked rows' ids to claim: in claim order, each that fits what is left of the
        poller's free GPUs and of each limit's room, at most ``limit``."""
        gpus = offer.gpus
        room = dict(self.room)
        out: list[str] = []
        for row in rows:
            inv_id, queue, shape = row[0], row[1], row[2]
            needs = self.needs.get((queue, shape), Needs())
            if needs.gpus > gpus:
                continue
            names = [n for n in (queue_limit(queue), _key_name(needs)) if n is not None and n in room]
            if any(room[n] <= 0 for n in names):
                continue
            gpus -= needs.gpus
            for n in names:
                room[n] -= 1
            out.append(inv_id)
            if len(out) >= limit:
                break
        return out


def _key_name(needs: Needs) -> str | None:
    return key_limit(needs.concurrency_key) if needs.concurrency_key is not None else None


_ABSENT = object()  # a limit the cache did not hold (``Placer.tentative``'s undo)


class _Tentative:
    """``Placer.tentative``'s block (a class: it is around every write transaction)."""

    __slots__ = ("_placer", "_undo")

    def __init__(self, placer: Placer) -> None:
        self._placer = placer
        self._undo: list[tuple[str, str, Any]] = []

    def __enter__(self) -> None:
        self._placer._pending.undo = self._undo  # (one write transaction at a time in a thread)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._placer._pending.undo = None
        if exc_type is not None and self._undo:
            self._placer._undo(self._undo)


class Placer:
    """Which heads a claim reads, from the ``shapes`` and ``limits`` tables (cached for
    ``REFRESH_S``: both are small and change rarely; a shape this replica submitted is known at
    once, another replica's within ``REFRESH_S``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shapes: dict[str, dict[str, Needs]] = {}
        self._limits: dict[str, int] = {}
        self._read_at = -1e9
        # per thread, inside ``tentative``: how to undo what its transaction taught the cache
        self._pending = threading.local()
        # the plans that read nothing (no limit applies), by (queues, offer): made from the cache
        # as it stands, so replaced (emptied) whenever the cache changes
        self._plans: dict[tuple[tuple[str, ...], Offer], Plan] = {}

    def tentative(self) -> _Tentative:
        """Around a write transaction: the shapes and limits this thread teaches the cache inside
        (``learn``, ``set_limit``) are undone should the block raise. A submit names its shape in
        the cache before the commit (the claims of its own transaction plan with it); had its
        transaction rolled back, the shape would stay cached without its ``shapes`` row, and the
        retry, finding it known, would write none: once the cache was read again (``REFRESH_S``,
        another replica, a restart) no plan would have that head, and the call would stay queued."""
        return _Tentative(self)

    def _undo(self, undo: list[tuple[str, str, Any]]) -> None:
        with self._lock:
            self._plans = {}
            for kind, a, b in reversed(undo):
                if kind == "shape":
                    self._shapes.get(a, {}).pop(b, None)
                elif b is _ABSENT:
                    self._limits.pop(a, None)
                else:
                    self._limits[a] = b

    def _hold(self, kind: str, a: str, b: Any) -> None:
        undo = getattr(self._pending, "undo", None)
        if undo is not None:
            undo.append((kind, a, b))

    def learn(self, queue: str, shape: str, needs: Needs) -> bool:
        """Remember a shape submitted here; True when it was new to this cache."""
        if shape == PLAIN:
            return False
        with self._lock:
            known = self._shapes.setdefault(queue, {})
            if shape in known:
                return False
            known[shape] = needs
            self._plans = {}
        self._hold("shape", queue, shape)
        return True

    def knows_shape(self, queue: str, shape: str) -> bool:
        """Whether ``learn`` of this shape would find it known (a plain call's: always)."""
        if shape == PLAIN:
            return True
        with self._lock:
            return shape in self._shapes.get(queue, {})

    def knows_limit(self, name: str, value: int) -> bool:
        with self._lock:
            return self._limits.get(name) == value

    def set_limit(self, name: str, value: int | None) -> None:
        with self._lock:
            before = self._limits.get(name, _ABSENT)
            self._plans = {}
            if value is None:
                self._limits.pop(name, None)
            else:
                self._limits[name] = value
        self._hold("limit", name, before)

    def any_limits(self) -> bool:
        """Whether any limit is cached: when not, ``limited`` is False for every call (an ack of
        many skips reading its rows back for ``freed``). One read of a dict the lock replaces or
        changes whole: no lock needed."""
        return bool(self._limits)

    def limited(self, queue: str, shape: str) -> bool:
        """Whether a limit (as cached) covers calls of ``(queue, shape)``: one ending frees room."""
        with self._lock:
            if not self._limits:
                return False
            if queue_limit(queue) in self._limits:
                return True
            needs = self._shapes.get(queue, {}).get(shape)
            key = _key_name(needs) if needs is not None else None
            return key is not None and key in self._limits

    def shapes(self, queue: str) -> dict[str, Needs]:
        with self._lock:
            return dict(self._shapes.get(queue, {}))

    def refresh(self, conn: Connection, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._read_at < REFRESH_S:
            return
        shapes: dict[str, dict[str, Needs]] = {}
        for queue, shape, needs in conn.execute(
            sa.select(t.shapes.c.queue, t.shapes.c.shape, t.shapes.c.needs)
        ):
            shapes.setdefault(queue, {})[shape] = Needs.from_json(needs)
        limits = {n: int(m) for n, m in conn.execute(sa.select(t.limits.c.name, t.limits.c.max_running))}
        with self._lock:
            if shapes != self._shapes or limits != self._limits:
                self._plans = {}
            self._shapes = shapes  # a shape learnt by a submit that rolled back is forgotten here
            self._limits = limits
            self._read_at = now

    def plan(
        self, conn: Connection, queues: Sequence[str], offer: Offer, namespace: str | None, dialect: str
    ) -> Plan:
        """The heads of ``queues`` that ``offer`` fits, and (placed) the room of the limits that
        apply, counted now: on PostgreSQL under a lock of their ``limits`` rows (``FOR UPDATE``),
        so claims on other replicas count after this one commits. A plan that reads nothing (no
        limit applies) is made once for its queues and offer, until the cache changes (``_plans``;
        its callers only read it)."""
        self.refresh(conn)
        key = (tuple(queues), offer)
        plans = self._plans
        got = plans.get(key)
        if got is not None:
            return got
        heads: list[Head] = []
        needs: dict[Head, Needs] = {}
        placed = False
        with self._lock:
            plans = self._plans  # (the cache as this plan reads it)
            limits = dict(self._limits)
            for queue in sorted(set(queues)):
                heads.append((queue, PLAIN))
                for shape, n in sorted(self._shapes.get(queue, {}).items()):
                    if offer.fits(n):
                        heads.append((queue, shape))
                        needs[(queue, shape)] = n
                        placed = placed or n.gpus > 0
        names = {queue_limit(q) for q, _ in heads} | {k for n in needs.values() if (k := _key_name(n))}
        limited = sorted(n for n in names if n in limits)
        if not limited:
            plan = Plan(heads, placed, needs)
            with self._lock:
                if self._plans is plans and len(plans) < PLANS_MAX:  # the cache unchanged since
                    plans[key] = plan
            return plan
        lim = t.limits
        read = sa.select(lim.c.name, lim.c.max_running).where(lim.c.name.in_(limited)).order_by(lim.c.name)
        if dialect == "postgresql":
            read = read.with_for_update()
        room: dict[str, int] = {}
        for name, most in conn.execute(read):
            room[name] = int(most) - self._running(conn, name)
        kept = []
        for head in heads:
            names_of = [queue_limit(head[0]), _key_name(needs.get(head, Needs()))]
            if all(room.get(n, 1) > 0 for n in names_of if n is not None):
                kept.append(head)
        return Plan(kept, True, needs, room)

    def _running(self, conn: Connection, name: str) -> int:
        kind, _, value = name.partition(":")
        count = sa.select(sa.func.count()).select_from(_inv).where(_inv.c.state == "running")
        if kind == "queue":
            return int(conn.execute(count.where(_inv.c.queue == value)).scalar_one())
        # the shapes naming the key, read in this transaction (after the limit's row lock), not
        # from the cache: another replica's new shape of the key is up to REFRESH_S late there, and
        # its running calls were not counted (two replicas ran two calls under max_concurrency 1)
        sh = t.shapes
        pairs = [
            (q, s)
            for q, s, needs in conn.execute(sa.select(sh.c.queue, sh.c.shape, sh.c.needs))
            if Needs.from_json(needs).concurrency_key == value
        ]
        if not pairs:
            return 0
        return int(conn.execute(count.where(sa.tuple_(_inv.c.queue, _inv.c.shape).in_(pairs))).scalar_one())
