"""The store's Python API: the one contract behind the control plane and the local plane.

Both ``lakeshore server`` (over HTTP) and ``Dispatch(":memory:" | path)`` (in process) call exactly
these methods; there is no second implementation of claims, leases or the journal. All methods are
synchronous and thread-safe; the server calls them from a worker thread.

Times are float seconds since the epoch. Blobs are ``bytes``. ``error`` is an ErrorInfo dict
``{"type", "message", "traceback"?}``.

The records the calls take and answer are in records.py, the operators' read-only views
(``Listing``) in listing_api.py; both are re-exported here, so ``from .api import X`` keeps working.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dreamlake.lakeshore.errors import PlaneError

# Shared with the clients, which must not import the store: defined in ``states``, re-exported here.
from dreamlake.lakeshore.states import ACK_STATES as ACK_STATES
from dreamlake.lakeshore.states import TERMINAL_STATES as TERMINAL_STATES
from dreamlake.lakeshore.states import State as State

from .listing_api import (
    LIST_LIMIT_MAX as LIST_LIMIT_MAX,
)
from .listing_api import (
    LIVE_WINDOW_S as LIVE_WINDOW_S,
)
from .listing_api import (
    FrameStats as FrameStats,
)
from .listing_api import (
    InvocationPage as InvocationPage,
)
from .listing_api import (
    Listing as Listing,
)
from .listing_api import (
    QueueStats as QueueStats,
)
from .listing_api import (
    WorkerPage as WorkerPage,
)
from .listing_api import (
    WorkerRow as WorkerRow,
)
from .placement import NO_OFFER, Offer
from .records import (
    ANOTHER_WORKER as ANOTHER_WORKER,
)
from .records import (
    DEFAULT_LEASE_S as DEFAULT_LEASE_S,
)
from .records import (
    DEFAULT_MAX_ATTEMPTS as DEFAULT_MAX_ATTEMPTS,
)
from .records import (
    DEFAULT_NAMESPACE as DEFAULT_NAMESPACE,
)
from .records import (
    OUT_OF_ORDER as OUT_OF_ORDER,
)
from .records import (
    SUPERSEDED as SUPERSEDED,
)
from .records import (
    TOKEN_KINDS as TOKEN_KINDS,
)
from .records import (
    UNKNOWN as UNKNOWN,
)
from .records import (
    AckRequest as AckRequest,
)
from .records import (
    AckResult as AckResult,
)
from .records import (
    ChunkResult as ChunkResult,
)
from .records import (
    Command as Command,
)
from .records import (
    Frame as Frame,
)
from .records import (
    FrameRequest as FrameRequest,
)
from .records import (
    FramesRequest as FramesRequest,
)
from .records import (
    FramesResult as FramesResult,
)
from .records import (
    GcResult as GcResult,
)
from .records import (
    HeartbeatRequest as HeartbeatRequest,
)
from .records import (
    HeartbeatResult as HeartbeatResult,
)
from .records import (
    Invocation as Invocation,
)
from .records import (
    Outcome as Outcome,
)
from .records import (
    PollRequest as PollRequest,
)
from .records import (
    PollResult as PollResult,
)
from .records import (
    Principal as Principal,
)
from .records import (
    Quota as Quota,
)
from .records import (
    SubmitRequest as SubmitRequest,
)
from .records import (
    SubmitResult as SubmitResult,
)
from .records import (
    WriteRequest as WriteRequest,
)
from .records import (
    WriteResult as WriteResult,
)
from .records import (
    visible as visible,
)

if TYPE_CHECKING:
    pass


class Store(Listing, Protocol):
    # -- producer side ------------------------------------------------------------------------
    def submit(self, req: SubmitRequest) -> SubmitResult: ...
    def get(self, invocation_id: str) -> Invocation | None: ...
    def get_many(self, invocation_ids: Sequence[str]) -> list[Invocation]:
        """The invocations of ``invocation_ids`` that exist, in one read (any order)."""
        ...

    def outcomes(self, invocation_ids: Sequence[str]) -> list[Outcome]:
        """The outcomes of the invocations of ``invocation_ids`` that exist, in one narrow read
        (state, result, error, namespace; any order): the batch await of a sweep's reader."""
        ...

    def lineage(self, invocation_id: str, limit: int = 64) -> list[str]:
        """``invocation_id`` and its ancestors by ``parent_invocation_id``, nearest first."""
        ...

    def descendants(self, invocation_id: str) -> list[tuple[str, str | None, str]]:
        """``(invocation_id, parent_invocation_id, state)`` of every descendant, breadth first."""
        ...

    def attempts(self, invocation_id: str) -> list[dict[str, Any]]:
        """Each attempt's outcome, oldest first: ``{attempt, state, worker_id, started_at,
        finished_at, error, retry_at}``, the earlier ones (retried, or lost with their lease) from
        the store's history, the current one from the invocation row (absent while a retry waits:
        the status's ``retry_at`` says when it becomes claimable). Empty for an unknown invocation."""
        ...

    def cancel(self, invocation_id: str) -> str | None:
        """Queued -> cancelled at once; running -> cancel_requested (a cancel command is queued for
        its worker); terminal -> unchanged. Returns the state after the call, None if unknown."""
        ...

    def set_queue_limit(self, queue: str, max_running: int | None) -> None:
        """Cap the calls of ``queue`` running at once across the fleet (None: clear the cap);
        PlaneError(400) for a value that is not a whole number from 0 (store/limits.py)."""
        ...

    # -- daemon side --------------------------------------------------------------------------
    def register_worker(self, worker_id: str, info: dict[str, Any]) -> None: ...
    def deregister_worker(self, worker_id: str) -> None:
        """Mark the worker stopped (a clean stop): not live from now until it registers again."""
        ...

    def worker_info(self, worker_id: str) -> dict[str, Any] | None:
        """The info of the worker's latest register; None for a worker that never registered."""
        ...

    def pinned_version_for_worker(self, worker_id: str, namespace: str | None = None) -> str | None:
        """The nymph version pinned for a daemon's namespace: ``namespace`` (its token's) when
        given, else the one it registered with, else ``default``. One read, from the store: every
        replica answers alike."""
        ...

    def claim(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        namespace: str | None = None,
        offer: Offer = NO_OFFER,
    ) -> list[Invocation]:
        """Atomically flip up to ``limit`` queued invocations whose queue is in ``queues`` (and, when
        given, whose namespace is ``namespace``) to running, best first (priority desc,
        submitted_at asc, invocation_id asc). Sets started_at, worker_id, attempt += 1,
        lease_expires_at. Never hands one invocation to two callers."""
        ...

    def bind_worker(self, worker_id: str, token_id: str) -> str:
        """Bind ``worker_id`` to ``token_id`` unless it is bound already; the token it is bound to."""
        ...

    def ack(
        self,
        invocation_id: str,
        state: str,
        *,
        attempt: int | None,
        worker_id: str | None,
        result_blob: bytes | None,
        error: dict[str, Any] | None,
        result_ref: dict[str, Any] | None = None,
    ) -> AckResult:
        """Record the outcome (``result_ref``: the result in the payload store, instead of bytes). Refused (ok=False, ``status`` saying why) when the row is not
        running under that attempt (when attempt is given) / that worker (when given).
        finished_at = now unconditionally on success. A repeat of an already-recorded identical
        outcome answers duplicate=True."""
        ...

    def set_checkpoint(
        self, invocation_id: str, attempt: int, worker_id: str, ref: dict[str, Any]
    ) -> tuple[int, str] | None:
        """Record ``ref`` as the checkpoint the next attempt starts from, when ``worker_id`` holds
        ``attempt`` of the running invocation; else ``(status, reason)`` (a stale attempt's
        checkpoint never overwrites the current one's)."""
        ...

    def append_frame(
        self,
        owner_id: str,
        seq: int,
        data: bytes,
        final: bool,
        *,
        attempt: int | None = None,
        worker_id: str | None = None,
    ) -> ChunkResult:
        """Journal a frame of an invocation, in order: ``seq`` must be the next one (a seq already
        journaled answers duplicate=True and changes nothing); a gap, or a frame after the final
        one, is refused with ``expected_seq``. With ``attempt`` / ``worker_id`` given, refused
        unless that attempt is the current one / that worker holds it."""
        ...

    def append_frames(
        self,
        invocation_id: str,
        attempt: int,
        frames: Sequence[tuple[int, bytes, bool]],
        *,
        worker_id: str | None = None,
    ) -> list[ChunkResult]:
        """Journal a batch ``(seq, data, final)`` of one attempt in one transaction, in order: one
        result per frame (stored, or ``duplicate`` for a seq already journaled). A gap or a frame
        after the final one is refused with the rest of the batch (``ok=False`` and the reason; the
        frames before it are kept); a superseded attempt or another worker refuse the whole batch."""
        ...

    def read_frames(self, owner_id: str, since: int = -1, limit: int = 1000) -> list[Frame]: ...
    def send_append(self, invocation_id: str, index: int, data: bytes, final: bool) -> ChunkResult:
        """Journal a consumer's send into yield ``index`` of a two-way body (store/frames.py)."""
        ...

    def heartbeat(
        self,
        worker_id: str,
        running: list[tuple[str, int]],
        lease_s: float = DEFAULT_LEASE_S,
        *,
        running_exec: list[tuple[str, int]] | None = None,
    ) -> tuple[list[Command], list[str]]:
        """Renew the leases of (invocation_id, attempt) and of exec jobs (exec_id, attempt) still
        claimed by this worker; return the pending commands for it (cancels: each queued one
        returned once, by this or a poll, and a cancel again for every invocation of ``running``
        whose cancel was requested, until its ack) and the ids (invocations and exec jobs) it no
        longer owns. ``running_exec=None`` (a daemon
        that does not report its exec jobs) renews every exec job the worker holds."""
        ...

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
        """One daemon poll pass in one transaction: take the worker's pending commands (cancels,
        each queued one returned once, by this or a heartbeat), then ``claim`` up to ``limit`` invocations,
        then (``exec_jobs``) ``claim_exec`` exec jobs for the slots left, both of ``namespace``
        (None: any). Returns (commands, invocations, exec command bodies)."""
        ...

    def poll_pass(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        exec_jobs: bool = True,
        namespace: str | None = None,
        offer: Offer = NO_OFFER,
    ) -> PollResult:
        """``poll`` plus, in the same transaction, the version pinned for the worker's namespace
        (as ``pinned_version_for_worker``): the control plane's poll route in one store call."""
        ...

    def inline_write_lock(self) -> threading.RLock | None:
        """The lock under which a group commit may run on the caller's own thread (the event
        loop): SQLite's in-process write lock, as a local write there is a few hundred
        microseconds of CPU that a hop to the writer's thread and back costs as much again. The
        group writer takes it without waiting, and hands the batch to its thread when it is held
        (a sweep or a checkpoint writing). None where writes wait on the network or a disk flush
        (PostgreSQL): those never run on the loop."""
        ...

    def write_batch(
        self,
        requests: Sequence[WriteRequest],
        on_commit: Callable[[list[tuple[int, WriteResult | PlaneError]]], None] | None = None,
        *,
        wait: bool = True,
    ) -> list[WriteResult | PlaneError]:
        """Apply many writes (submits, acks, frames, frame batches, heartbeats, poll passes)
        together: the group commit. Each answers as its single call would (``submit``, ``ack``,
        ``append_frame``, ``append_frames``, ``heartbeat`` and ``poll_pass``, the last two with
        the pinned version), or with the PlaneError that call would raise; one write's error never
        fails another. Submits apply first, in order, in a transaction of their own (committed,
        their waiters woken, before the rest) with the poll passes handed them (``PollRequest.handed``:
        right after them), then the acks, frames and other poll passes in order in a second, then
        the heartbeats in a third. A submit carrying ``max_queued`` past which its namespace's
        queued invocations would go answers QuotaExceeded (429) and leaves nothing (a
        ``quota_group``'s submits all or none), decided in the submits' transaction.
        ``on_commit`` receives each transaction's
        ``(index, answer)`` pairs once it committed, but the last one's (nothing is answered
        before it is durable); the return is every answer, in order, once all have committed.
        ``wait=False``, under ``inline_write_lock`` on the event loop: a transaction that would
        wait for another process's lock on a SQLite file raises
        :class:`~dreamlake.lakeshore.store.outage.WriteLockBusy` with the writes not applied."""
        ...

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Requeue (attempt < max_attempts) or fail ({type: "LeaseExpired"}) running invocations
        whose lease lapsed; requeue running exec jobs whose lease lapsed, or, on their last allowed
        attempt, finish them (``done``, exit code -1, a note on stderr). Returns the affected ids."""
        ...

    # -- topics -------------------------------------------------------------------------------
    def topic_post(self, name: str, body: bytes, final: bool = False) -> int:
        """Append a VALUE (or END when final) frame to topic ``name``; returns its seq."""
        ...

    def topic_append(
        self, name: str, body: bytes, final: bool = False, *, namespace: str | None = None
    ) -> Frame:
        """``topic_post`` that returns the journaled frame (seq and encoded bytes), for live fan-out.
        A post that makes the topic records ``namespace`` as the topic's (for its quota)."""
        ...

    # -- namespaces, tokens, exec jobs --------------------------------------------------------
    def pin_version(self, namespace: str, version: str | None) -> None: ...
    def pinned_version(self, namespace: str) -> str | None: ...
    def create_token(
        self, kind: str, name: str, namespace: str | None = None, *, may_script: bool = False
    ) -> str: ...
    def verify_token(self, secret: str) -> Principal | None: ...
    def server_key(self, name: str) -> bytes:
        """A 32-byte secret shared by every replica, made on first use (the task-token HMAC key)."""
        ...

    # -- quotas (store/quotas.py) ----------------------------------------------------------
    def set_quota(self, namespace: str, quota: Quota | None) -> None: ...
    def quotas(self) -> dict[str, Quota]: ...
    def count_queued(self, namespace: str, up_to: int) -> int: ...
    def count_topics(self, namespace: str, up_to: int) -> int: ...
    def topic_exists(self, name: str) -> bool: ...
    def record_payload(self, namespace: str, key: str, size: int, *, keep_s: float) -> None: ...
    def payload_bytes(self, namespace: str, since: float) -> int: ...
    def create_session(self, token_id: str, ttl_s: float) -> str:
        """A dashboard session id of the token ``token_id`` (only its sha256 is stored)."""
        ...

    def session_principal(self, secret: str) -> Principal | None: ...
    def end_session(self, secret: str) -> None: ...
    def count_tokens(self) -> int: ...

    # -- secrets (sealed bytes only: server/secrets.py seals and opens them) ------------------
    def put_secret(self, namespace: str, name: str, sealed: bytes) -> None: ...
    def secret_names(self, namespace: str) -> list[tuple[str, float]]: ...
    def sealed_secrets(self, namespace: str, names: Iterable[str]) -> dict[str, bytes]: ...
    def delete_secret(self, namespace: str, name: str) -> bool: ...
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
    ) -> str: ...
    def claim_exec(
        self,
        worker_id: str,
        queues: list[str],
        limit: int = 1,
        *,
        namespace: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> list[dict[str, Any]]: ...
    def publish_exec_result(
        self,
        namespace: str,
        exec_id: str,
        result: dict[str, Any],
        *,
        worker_id: str | None = None,
        attempt: int | None = None,
    ) -> AckResult:
        """Record ``result`` and mark the job done. ``worker_id`` None (an admin) publishes
        unchecked; otherwise refused (ok=False, state set) unless that worker holds the latest
        claim (and, when given, under ``attempt``). A repeat answers duplicate=True and keeps the
        first result. Unknown job in that namespace: ok=False, state None."""
        ...

    def get_exec(self, namespace: str, exec_id: str) -> dict[str, Any] | None: ...

    # -- retention (store/retention.py) --------------------------------------------------------
    def gc_batch(
        self,
        now: float,
        default_s: float | None,
        per_queue: Mapping[str, float | None] | None = None,
        *,
        limit: int = 200,
    ) -> GcResult:
        """Delete at most ``limit`` finished invocations (with their frames and attempts) and
        ``limit`` done exec jobs that finished more than their queue's retention ago
        (``per_queue[queue]``, else ``default_s``; None or 0: kept), in one transaction."""
        ...

    def gc(
        self,
        now: float,
        default_s: float | None,
        per_queue: Mapping[str, float | None] | None = None,
        *,
        limit: int = 200,
        max_batches: int = 1_000_000,
    ) -> GcResult:
        """``gc_batch`` until a batch comes back short; the totals."""
        ...

    def close(self) -> None: ...
