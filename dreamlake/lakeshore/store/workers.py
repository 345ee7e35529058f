"""Workers, their pending commands, namespaces (the pinned nymph version) and API tokens.

Workers: ``register_worker`` records a daemon's info (upsert); every poll and heartbeat touches its
``last_seen`` and takes its pending commands (``_take_commands_in``). Commands are the cancels the
producer side queues for the worker running an invocation (``queue_command``, called by
``cancel``); ``DELETE ... RETURNING`` hands each to exactly one caller.

Namespaces: ``pin_version`` / ``pinned_version`` hold the nymph version a namespace runs;
``pinned_version_for_worker`` reads it for the namespace the worker registered with (``default``
when none), in one statement; ``_pinned_in`` runs that read inside the poll's and heartbeat's own
transaction.

Workers are bound to the token that first named them: ``bind_worker`` records the token on a
worker id that has none (a conditional update, so two tokens racing for one id cannot both win)
and answers the token it is bound to; the control plane refuses any other token acting as it.

Tokens: ``create_token`` returns ``"lsk_" + secrets.token_urlsafe(32)`` once; only its sha256 is
stored, and ``verify_token`` looks the hash up (no secret ever compared byte by byte). A token
carries its kind, the namespace it is bound to (if any) and ``may_script``.

Server keys: ``server_key(name)`` returns a 32-byte secret every replica shares, from the key ring
of ``store/keys.py`` (a file next to the store, or a secret in the environment; never the
database). The task-token and blob-URL HMAC keys are two.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid

from . import schema as t
from .api import DEFAULT_NAMESPACE, TOKEN_KINDS, Command, Principal
from .base import StoreBase
from .direct import Direct
from .engine import Database, retry_on_disconnect
from .keys import KeyRing
from .libpq import Sent
from .notify import Notifier
from .values import json_safe

SESSION_PREFIX = "lss_"  # a dashboard session id (the cookie's value), never an API token
_RING_LOCK = threading.Lock()  # the key ring is opened once per store

TOKEN_PREFIX = "lsk_"


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class _Statements:
    """The statements of every poll and heartbeat, built once per dialect (see base.py)."""

    def __init__(self) -> None:
        B = sa.bindparam
        c = t.commands
        # a poll's and a heartbeat's own statements run through the driver (store/direct.py)
        self.touch_worker = Direct(
            sa.update(t.workers).where(t.workers.c.worker_id == B("worker")).values(last_seen=B("now"))
        )
        self.set_free_gpus = Direct(
            sa.update(t.workers).where(t.workers.c.worker_id == B("worker")).values(free_gpus=B("gpus"))
        )
        self.take_commands = Direct(
            sa.delete(c)
            .where(c.c.worker_id == B("worker"))
            .returning(c.c.command_id, c.c.kind, c.c.body, c.c.created_at)
        )
        w, n = t.workers, t.namespaces
        # The namespace a worker registered with ('' or none: default), read in the same statement.
        registered = (
            sa.select(sa.func.nullif(w.c.info["namespace"].as_string(), ""))
            .where(w.c.worker_id == B("worker"))
            .scalar_subquery()
        )
        self.pinned_of_worker = Direct(
            sa.select(n.c.nymph_version).where(n.c.name == sa.func.coalesce(registered, "default"))
        )
        self.pinned = Direct(sa.select(n.c.nymph_version).where(n.c.name == B("b_namespace")))
        # The same for the many daemons of one group commit: one statement each, whatever their
        # number (a fleet's heartbeats and poll renewals arrive dozens to a batch).
        many: Any = B("workers", expanding=True)
        self.touch_workers = sa.update(w).where(w.c.worker_id.in_(many)).values(last_seen=B("now"))
        self.take_commands_of = (
            sa.delete(c)
            .where(c.c.worker_id.in_(many))
            .returning(c.c.worker_id, c.c.command_id, c.c.kind, c.c.body, c.c.created_at)
        )
        self.registered_of = sa.select(
            w.c.worker_id, sa.func.coalesce(sa.func.nullif(w.c.info["namespace"].as_string(), ""), "default")
        ).where(w.c.worker_id.in_(many))
        self.pinned_of_names = sa.select(n.c.name, n.c.nymph_version).where(
            n.c.name.in_(B("names", expanding=True))
        )
        # PostgreSQL: the four in one statement, one round trip for one daemon or many, the lists
        # as arrays (data-modifying CTEs run whether or not the query reads them, all on the
        # query's snapshot, which is all the pins and namespaces need: neither changes what they
        # read). Its rows: each taken command (``worker_id`` and the command's columns), each
        # unbound worker's registered namespace (``worker_id`` and ``name``), each pinned version
        # asked for (``name`` and ``version``).
        some = postgresql.ARRAY(sa.String)
        workers, unbound, names = B("workers", type_=some), B("unbound", type_=some), B("names", type_=some)
        touched_all = (
            sa.update(w)
            .where(w.c.worker_id == sa.any_(workers))
            .values(last_seen=B("now"))
            .returning(w.c.worker_id)
        ).cte("touched")
        taken_all = (
            sa.delete(c)
            .where(c.c.worker_id == sa.any_(workers))
            .returning(c.c.worker_id, c.c.command_id, c.c.kind, c.c.body, c.c.created_at)
            .cte("taken")
        )
        reg = (
            sa.select(
                w.c.worker_id,
                sa.func.coalesce(sa.func.nullif(w.c.info["namespace"].as_string(), ""), "default").label(
                    "name"
                ),
            )
            .where(w.c.worker_id == sa.any_(unbound))
            .cte("reg")
        )
        text, null = sa.String(), sa.null()
        self.pg_duties = Direct(
            sa.union_all(
                sa.select(
                    taken_all.c.worker_id,
                    taken_all.c.command_id,
                    taken_all.c.kind,
                    taken_all.c.body,
                    taken_all.c.created_at,
                    sa.cast(null, text).label("name"),
                    sa.cast(null, text).label("version"),
                ),
                sa.select(reg.c.worker_id, null, null, null, null, reg.c.name, sa.cast(null, text)),
                sa.select(sa.cast(null, text), null, null, null, null, n.c.name, n.c.nymph_version).where(
                    sa.or_(n.c.name == sa.any_(names), n.c.name.in_(sa.select(reg.c.name)))
                ),
            ).add_cte(touched_all),
            "postgresql",
        )


def _commands(rows: Iterable[Any]) -> list[Command]:
    """Taken command rows as Commands, oldest first."""
    return [
        Command(id=r.command_id, kind=r.kind, body=r.body)
        for r in sorted(rows, key=lambda r: (r.created_at, r.command_id))
    ]


@functools.cache
def _statements() -> _Statements:
    return _Statements()


def queue_command(conn: Connection, worker_id: str, kind: str, body: dict[str, Any], now: float) -> None:
    """Queue a command for ``worker_id`` in the caller's transaction (notify ``worker:<id>`` after)."""
    conn.execute(
        sa.insert(t.commands).values(
            command_id=new_ulid(), worker_id=worker_id, kind=kind, body=body, created_at=now
        )
    )


class WorkerStore(StoreBase):
    """Workers and their commands, namespaces and tokens."""

    def __init__(self, db: Database, notifier: Notifier) -> None:
        super().__init__(db, notifier)
        self._worker_st = _statements()
        self._offered: dict[str, int] = {}  # worker -> the free GPUs this store last wrote for it

    # -- workers and their commands --------------------------------------------------------------

    def register_worker(self, worker_id: str, info: dict[str, Any]) -> None:
        self._offered.pop(worker_id, None)  # its next poll writes what it offers
        now = time.time()
        info = json_safe(info, "worker info")
        w = t.workers
        with self.db.tx(write=True) as conn:
            conn.execute(
                self._insert(w)
                .values(worker_id=worker_id, info=info, registered_at=now, last_seen=now)
                .on_conflict_do_update(
                    index_elements=[w.c.worker_id], set_={"info": info, "last_seen": now, "stopped_at": None}
                )
            )

    def deregister_worker(self, worker_id: str) -> None:
        """Mark the worker stopped now (a clean stop): not live from this moment; its next
        register clears the mark. Its token binding stays (the id stays its token's)."""
        w = t.workers
        with self.db.tx(write=True) as conn:
            conn.execute(sa.update(w).where(w.c.worker_id == worker_id).values(stopped_at=time.time()))

    def bind_worker(self, worker_id: str, token_id: str) -> str:
        now = time.time()
        w = t.workers
        with self.db.tx(write=True) as conn:
            conn.execute(
                self._insert(w)
                .values(worker_id=worker_id, info={}, registered_at=now, last_seen=now, token_id=token_id)
                .on_conflict_do_nothing()
            )
            conn.execute(
                sa.update(w)
                .where(w.c.worker_id == worker_id, w.c.token_id.is_(None))
                .values(token_id=token_id)
            )
            bound = conn.execute(sa.select(w.c.token_id).where(w.c.worker_id == worker_id)).scalar_one()
        return str(bound)

    def worker_info(self, worker_id: str) -> dict[str, Any] | None:
        w = t.workers
        with self.db.tx(write=False) as conn:
            info = conn.execute(sa.select(w.c.info).where(w.c.worker_id == worker_id)).scalar_one_or_none()
        return dict(info) if isinstance(info, dict) else None

    def _offered_in(self, conn: Connection, worker_id: str, gpus: int) -> None:
        """Keep the free GPUs a poll offered on its worker's row (``lakeshore workers``), written
        only when they differ from what this store last wrote for it: an idle fleet writes none."""
        sent = self._offered_send(conn, worker_id, gpus)
        if sent is not None:
            sent.result()

    def _offered_forget(self, workers: Iterable[str]) -> None:
        """Forget what was written for ``workers`` (a transaction that wrote it rolled back)."""
        for worker in workers:
            self._offered.pop(worker, None)

    def _offered_send(self, conn: Connection, worker_id: str, gpus: int) -> Sent | None:
        """``_offered_in``'s write, its answer left to read (a pipeline's); None when none is due."""
        if self._offered.get(worker_id) == gpus:
            return None
        sent = self._worker_st.set_free_gpus.send(conn, {"worker": worker_id, "gpus": gpus})
        if len(self._offered) >= 100_000:
            self._offered.clear()
        self._offered[worker_id] = gpus
        return sent

    def _take_commands_in(self, conn: Connection, worker_id: str, now: float) -> list[Command]:
        """Touch the worker's ``last_seen`` and take its pending commands, oldest first."""
        st = self._worker_st
        conn.execute(st.touch_worker, {"worker": worker_id, "now": now})
        # DELETE ... RETURNING: each pending command goes to exactly one caller.
        return _commands(conn.execute(st.take_commands, {"worker": worker_id}))

    def _duties_in(
        self, conn: Connection, asks: Sequence[tuple[str, str | None]], now: float
    ) -> list[tuple[list[Command], str | None]]:
        """``_take_commands_in`` and ``_pinned_in`` for many ``(worker_id, namespace)`` at once
        (the polls and heartbeats of one group commit), in four statements whatever their number
        (PostgreSQL: one, ``pg_duties``, for one daemon too; a SQLite statement is a call, not a
        round trip).
        A worker's pending commands go to its first entry; the others of that worker get none."""
        if self.db.dialect == "postgresql":
            return self._pg_duties_in(conn, asks, now)
        if len(asks) == 1:  # one daemon: the plain statements (an expanding IN renders per call)
            worker, namespace = asks[0]
            commands = self._take_commands_in(conn, worker, now)
            return [(commands, self._pinned_in(conn, worker, namespace))]
        st = self._worker_st
        workers = sorted({w for w, _ in asks})
        conn.execute(st.touch_workers, {"workers": workers, "now": now})
        pending: dict[str, list[Any]] = {}
        for r in conn.execute(st.take_commands_of, {"workers": workers}):
            pending.setdefault(r.worker_id, []).append(r)
        unbound = sorted({w for w, ns in asks if ns is None})
        registered: dict[str, str] = (
            {w: ns for w, ns in conn.execute(st.registered_of, {"workers": unbound})} if unbound else {}
        )
        names = [ns if ns is not None else registered.get(w, DEFAULT_NAMESPACE) for w, ns in asks]
        versions = dict(conn.execute(st.pinned_of_names, {"names": sorted(set(names))}).all())
        out: list[tuple[list[Command], str | None]] = []
        for (worker, _), name in zip(asks, names, strict=True):
            out.append((_commands(pending.pop(worker, ())), versions.get(name)))
        return out

    def _pg_duties_in(
        self, conn: Connection, asks: Sequence[tuple[str, str | None]], now: float
    ) -> list[tuple[list[Command], str | None]]:
        """``_duties_in`` on PostgreSQL: one statement (``pg_duties``) for one daemon or many."""
        return self._pg_duties_read(asks, self._pg_duties_send(conn, asks, now).result())

    def _pg_duties_send(self, conn: Connection, asks: Sequence[tuple[str, str | None]], now: float) -> Sent:
        """``_pg_duties_in``'s statement, its answer left to ``_pg_duties_read`` (a pipeline's)."""
        unbound = sorted({w for w, ns in asks if ns is None})
        names = sorted({ns for _, ns in asks if ns is not None} | ({DEFAULT_NAMESPACE} if unbound else set()))
        params = {"workers": sorted({w for w, _ in asks}), "unbound": unbound, "names": names, "now": now}
        return self._worker_st.pg_duties.send(conn, params)

    @staticmethod
    def _pg_duties_read(
        asks: Sequence[tuple[str, str | None]], rows: Iterable[Any]
    ) -> list[tuple[list[Command], str | None]]:
        pending: dict[str, list[Any]] = {}
        registered: dict[str, str] = {}
        versions: dict[str, str | None] = {}
        for r in rows:
            if r.command_id is not None:
                pending.setdefault(r.worker_id, []).append(r)
            elif r.worker_id is not None:
                registered[r.worker_id] = r.name
            else:
                versions[r.name] = r.version
        out: list[tuple[list[Command], str | None]] = []
        for worker, ns in asks:
            name = ns if ns is not None else registered.get(worker, DEFAULT_NAMESPACE)
            out.append((_commands(pending.pop(worker, ())), versions.get(name)))
        return out

    # -- namespaces ------------------------------------------------------------------------------

    @retry_on_disconnect
    def pinned_version_for_worker(self, worker_id: str, namespace: str | None = None) -> str | None:
        with self.db.tx(write=False) as conn:
            return self._pinned_in(conn, worker_id, namespace)

    def _pinned_in(self, conn: Connection, worker_id: str, namespace: str | None) -> str | None:
        """The version pinned for ``namespace``, else for the namespace ``worker_id`` registered
        with, else for ``default``: one statement, in the caller's transaction."""
        st = self._worker_st
        if namespace is not None:
            return conn.execute(st.pinned, {"b_namespace": namespace}).scalar_one_or_none()
        return conn.execute(st.pinned_of_worker, {"worker": worker_id}).scalar_one_or_none()

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

    def create_token(
        self, kind: str, name: str, namespace: str | None = None, *, may_script: bool = False
    ) -> str:
        mintable = [k for k in TOKEN_KINDS if k != "task"]
        if kind == "task":
            raise PlaneError(
                "task tokens are minted by the control plane for each claimed invocation (nymph hands "
                f"it to the task); mint one of {', '.join(mintable)}",
                status=400,
            )
        if kind not in TOKEN_KINDS:
            raise PlaneError(f"unknown token kind {kind!r}: use one of {', '.join(mintable)}", status=400)
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
                    may_script=bool(may_script),
                )
            )
        return secret

    @retry_on_disconnect
    def verify_token(self, secret: str) -> Principal | None:
        if not isinstance(secret, str) or not secret.startswith(TOKEN_PREFIX):
            return None
        digest = _sha256(secret)
        tk = t.tokens
        with self.db.tx(write=False) as conn:
            r = conn.execute(sa.select(tk).where(tk.c.secret_sha256 == digest)).first()
        if r is None or not hmac.compare_digest(r.secret_sha256, digest):
            return None
        return Principal(
            token_id=r.token_id,
            kind=r.kind,
            namespace=r.namespace,
            name=r.name,
            may_script=bool(r.may_script),
        )

    # -- dashboard sessions ----------------------------------------------------------------------

    def create_session(self, token_id: str, ttl_s: float) -> str:
        """A new dashboard session of the API token ``token_id`` for ``ttl_s``: its id (``lss_`` +
        32 random bytes), returned once; only its sha256 is stored. Expired ones are swept here."""
        secret = SESSION_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        s = t.ui_sessions
        with self.db.tx(write=True) as conn:
            conn.execute(sa.delete(s).where(s.c.expires_at < now))
            conn.execute(
                sa.insert(s).values(
                    session_sha256=_sha256(secret), token_id=token_id, created_at=now, expires_at=now + ttl_s
                )
            )
        return secret

    def session_principal(self, secret: str) -> Principal | None:
        """The principal of the token a live session signed in with; None for an unknown,
        expired or malformed id, or a token since deleted."""
        if not isinstance(secret, str) or not secret.startswith(SESSION_PREFIX) or len(secret) > 128:
            return None
        s, tk = t.ui_sessions, t.tokens
        with self.db.tx(write=False) as conn:
            r = conn.execute(
                sa.select(tk)
                .join(s, s.c.token_id == tk.c.token_id)
                .where(s.c.session_sha256 == _sha256(secret), s.c.expires_at > time.time())
            ).first()
        if r is None:
            return None
        return Principal(
            token_id=r.token_id,
            kind=r.kind,
            namespace=r.namespace,
            name=r.name,
            may_script=bool(r.may_script),
        )

    def end_session(self, secret: str) -> None:
        """Forget a session (sign out): its id opens nothing from now on, on every replica."""
        if isinstance(secret, str):
            with self.db.tx(write=True) as conn:
                conn.execute(
                    sa.delete(t.ui_sessions).where(t.ui_sessions.c.session_sha256 == _sha256(secret))
                )

    # -- server keys -----------------------------------------------------------------------------

    def server_key(self, name: str) -> bytes:
        """The key ``name`` from the key ring (``store/keys.py``: a file next to the store or a
        secret in the environment, never the database). The first call moves keys an older
        version kept in the ``server_keys`` table out of it."""
        ring = self._keyring
        if ring is None:
            with _RING_LOCK:
                ring = self._keyring
                if ring is None:
                    ring = self._open_keyring()
                    self._keyring = ring
        return ring.key(name)

    _keyring: KeyRing | None = None

    def _open_keyring(self) -> KeyRing:
        db_file = None
        if self.db.dialect == "sqlite" and not self.db.memory:
            db_file = Path(self.db.url[len("sqlite:///") :])
        ring = KeyRing.resolve(dialect=self.db.dialect, db_file=db_file)
        k = t.server_keys
        with self.db.tx(write=False) as conn:
            legacy = {str(n): bytes(v) for n, v in conn.execute(sa.select(k.c.name, k.c.secret))}
        if legacy:
            ring.adopt(legacy)
            with self.db.tx(write=True) as conn:
                if self.db.dialect == "sqlite":  # overwrite the freed pages, not only unlink them
                    conn.exec_driver_sql("PRAGMA secure_delete = ON")
                conn.execute(sa.delete(k).where(k.c.name.in_(list(legacy))))
            if db_file is not None:  # and the write-ahead log's old copies of those pages
                import sqlite3

                with contextlib.closing(sqlite3.connect(db_file, timeout=5)) as raw:
                    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return ring

    def count_tokens(self) -> int:
        with self.db.tx(write=False) as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t.tokens)).scalar_one())
