"""The store's Python API: the one contract behind the control plane and the local plane.

Both ``lakeshore server`` (over HTTP) and ``Dispatch(":memory:" | path)`` (in process) call exactly
these methods; there is no second implementation of claims, leases or the journal. All methods are
synchronous and thread-safe; the server calls them from a worker thread.

Times are float seconds since the epoch. Blobs are ``bytes``. ``error`` is an ErrorInfo dict
``{"type", "message", "traceback"?}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from dreamlake.lakeshore.errors import PlaneError

# Shared with the clients, which must not import the store: defined in ``states``, re-exported here.
from dreamlake.lakeshore.states import ACK_STATES as ACK_STATES
from dreamlake.lakeshore.states import TERMINAL_STATES as TERMINAL_STATES
from dreamlake.lakeshore.states import State as State

from .placement import NO_OFFER, Offer

if TYPE_CHECKING:
    from .activity import Activity, Sweep


@dataclass
class GcResult:
    """What one ``gc_batch`` deleted."""

    invocations: int = 0
    frames: int = 0
    attempts: int = 0
    exec_jobs: int = 0
    payload_keys: list[str] = field(default_factory=list)  # S3 keys the expired exec jobs referenced

    @property
    def rows(self) -> int:
        """The invocations and exec jobs deleted (what a full batch counts against its limit)."""
        return self.invocations + self.exec_jobs

    def add(self, other: GcResult) -> None:
        self.invocations += other.invocations
        self.frames += other.frames
        self.attempts += other.attempts
        self.exec_jobs += other.exec_jobs
        self.payload_keys += other.payload_keys


DEFAULT_LEASE_S = 30.0
DEFAULT_MAX_ATTEMPTS = 3


@dataclass
class SubmitRequest:
    """The seed's Submit body, already decoded and validated by the caller."""

    invocation_id: str
    queue: str
    function: dict[str, Any]
    args_blob: bytes
    run_config: dict[str, Any]
    code_context: dict[str, Any] = field(default_factory=dict)
    parent_invocation_id: str | None = None
    namespace: str = "default"
    args_ref: dict[str, Any] | None = None  # the Envelope in the payload store (args_blob then b"")


@dataclass
class SubmitResult:
    invocation_id: str
    queue: str
    duplicate: bool = False  # True when run_config.key matched an existing invocation


@dataclass
class Invocation:
    invocation_id: str
    queue: str
    state: str
    priority: int
    function: dict[str, Any]
    args_blob: bytes
    run_config: dict[str, Any]
    code_context: dict[str, Any]
    namespace: str
    attempt: int  # 0 before the first claim; the claim increments it
    max_attempts: int
    parent_invocation_id: str | None
    root_invocation_id: str | None
    idempotency_key: str | None
    worker_id: str | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    lease_expires_at: float | None
    result_blob: bytes | None
    error: dict[str, Any] | None
    cancel_requested: bool
    args_ref: dict[str, Any] | None = None  # seed 003 argsRef: the Envelope in the payload store
    result_ref: dict[str, Any] | None = None  # seed 003 resultRef: the result in the payload store

    not_before: float | None = None  # a retry waits queued until then (None: claimable)
    shape: str = ""  # its placement shape (store/placement.py); '' needs nothing
    preemptions: int = 0  # attempts that ended preempted: they spend no max_attempts
    checkpoint_ref: dict[str, Any] | None = None  # what the next attempt starts from (issue 30)

    def status(self) -> dict[str, Any]:
        """The producer's view of this row: the ``GET /v1/producer/invocations/:id`` body."""
        return {
            "retry_at": self.not_before,
            "invocation_id": self.invocation_id,
            "state": self.state,
            "queue": self.queue,
            "priority": self.priority,
            "attempt": self.attempt,
            "max_attempts": self.max_attempts,
            "preemptions": self.preemptions,
            "worker_id": self.worker_id,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "parent_invocation_id": self.parent_invocation_id,
            "root_invocation_id": self.root_invocation_id,
        }


# What a refusal (``ok=False``) of an ack or a frame answers over HTTP (``AckResult.status``).
UNKNOWN = 404  # no such invocation
ANOTHER_WORKER = 403  # the current lease is held by another worker
SUPERSEDED = 409  # a later attempt owns the invocation, its lease lapsed, or it is not running
OUT_OF_ORDER = 409  # a frame past the next expected seq, or after the final frame


class Outcome(NamedTuple):
    """An invocation's outcome as it stands (``Store.outcomes``): what a reader of many results
    needs (its state; once terminal, its result or error) and the namespace its visibility is
    checked against; none of the row's other columns."""

    invocation_id: str
    namespace: str
    state: str
    result_blob: bytes | None
    result_ref: dict[str, Any] | None
    error: dict[str, Any] | None


@dataclass
class AckResult:
    ok: bool  # False: refused (superseded attempt, unknown id, not running); nothing changed
    duplicate: bool = False  # the same terminal outcome was already recorded
    state: str | None = None  # the row's state after the call
    reason: str | None = None  # why it was refused, for the error body
    status: int = SUPERSEDED  # the HTTP status of a refusal: UNKNOWN, ANOTHER_WORKER or SUPERSEDED
    requeued: str | None = field(default=None, compare=False)  # a retry's queue, claimable now
    requeued_namespace: str | None = field(default=None, compare=False)  # ... and its namespace
    requeued_shape: str = field(default="", compare=False)  # ... and its placement shape
    # (namespace, queue, shape) of a call whose end freed room under a fleet-wide limit
    freed: tuple[str, str, str] | None = field(default=None, compare=False)


@dataclass
class ChunkResult:
    ok: bool
    seq: int
    duplicate: bool = False
    reason: str | None = None
    status: int = SUPERSEDED  # of a refusal: UNKNOWN, ANOTHER_WORKER, SUPERSEDED or OUT_OF_ORDER
    expected_seq: int | None = None  # on OUT_OF_ORDER: the seq the journal takes next
    # Where it went, for the live fan-out (not part of the answer, nor of equality):
    pos: int | None = field(default=None, compare=False)  # its journal position (== seq on attempt 1)
    data: bytes | None = field(default=None, compare=False)  # the bytes journaled, if not those sent


@dataclass
class AckRequest:
    """An ack as a write of a group commit (``Store.write_batch``); fields as ``Store.ack``."""

    invocation_id: str
    state: str
    attempt: int | None = None
    worker_id: str | None = None
    result_blob: bytes | None = None
    error: dict[str, Any] | None = None
    result_ref: dict[str, Any] | None = None


@dataclass
class FrameRequest:
    """One journaled frame as a write of a group commit; fields as ``Store.append_frame``."""

    owner_id: str
    seq: int
    data: bytes
    final: bool
    attempt: int | None = None
    worker_id: str | None = None


@dataclass
class FramesRequest:
    """A batch of frames ``(seq, data, final)`` of one attempt as one write of a group commit;
    fields and answers as ``Store.append_frames`` (the route ``/v1/daemon/result-chunks``)."""

    invocation_id: str
    attempt: int
    frames: list[tuple[int, bytes, bool]]
    worker_id: str | None = None


@dataclass
class FramesResult:
    """What a ``FramesRequest`` answers: one ChunkResult per frame, in the order sent."""

    results: list[ChunkResult]


@dataclass
class HeartbeatRequest:
    """A heartbeat as a write of a group commit; fields as ``Store.heartbeat``. ``namespace`` (the
    daemon token's, when bound to one) picks the pinned version read in the same transaction."""

    worker_id: str
    running: list[tuple[str, int]]
    lease_s: float = DEFAULT_LEASE_S
    running_exec: list[tuple[str, int]] | None = None
    namespace: str | None = None


@dataclass
class HeartbeatResult:
    commands: list[Command]
    lost: list[str]
    pinned_version: str | None = None  # the nymph version pinned for the worker's namespace


@dataclass
class PollResult:
    """One daemon poll pass (``Store.poll_pass``): ``poll``'s three lists plus the pinned version."""

    commands: list[Command]
    invocations: list[Invocation]
    exec_jobs: list[dict[str, Any]]
    pinned_version: str | None = None


@dataclass
class PollRequest:
    """A daemon poll pass as a write of a group commit; fields and answer as ``Store.poll_pass``
    (its claims are writes: committed with the submits and acks of the same batch)."""

    worker_id: str
    queues: list[str]
    limit: int = 1
    lease_s: float = DEFAULT_LEASE_S
    exec_jobs: bool = True
    namespace: str | None = None
    # False: the caller knows the daemon has no command waiting and its pinned version
    # (server/idle.py), so the pass only claims: no touch, no commands taken, no pin read (the
    # answer's commands are empty and its pinned version None)
    duties: bool = True
    # the submits of the same group commit this pass was handed (server/polls.py): it runs in their
    # transaction, right after them, and their run-queue notifications are not sent (its poll
    # holds their wake)
    handed: tuple[str, ...] = ()
    # what the poller has free now (store/placement.py): it claims only what this fits
    offer: Offer = NO_OFFER


# The writes ``Store.write_batch`` commits together, and what each answers (or the PlaneError it
# raised: that write's refusal, never the others').
WriteRequest = SubmitRequest | AckRequest | FrameRequest | FramesRequest | HeartbeatRequest | PollRequest
WriteResult = SubmitResult | AckResult | ChunkResult | FramesResult | HeartbeatResult | PollResult


@dataclass
class Frame:
    seq: int
    data: bytes  # the encoded frame, verbatim
    final: bool


@dataclass(frozen=True)
class Quota:
    """A namespace's limits (``lakeshore namespace quota``); None: no limit on that one."""

    max_queued: int | None = None  # queued (due) invocations
    max_topics: int | None = None  # topics its producers made
    max_payload_bytes: int | None = None  # bytes presigned for upload within the payload retention

    @property
    def empty(self) -> bool:
        return self.max_queued is None and self.max_topics is None and self.max_payload_bytes is None


@dataclass
class Command:
    """A command for a daemon: ``run`` (from claim), ``cancel`` (from heartbeat), ``exec``."""

    id: str
    kind: str
    body: dict[str, Any]


@dataclass
class Principal:
    token_id: str
    kind: str  # "admin" | "producer" | "daemon" | "namespace" | "metrics" | "task"
    namespace: str | None  # the namespace the token is bound to; None: unbound (a task: its own)
    name: str
    may_script: bool = False  # may submit run_config.script invocations (admins always may)
    invocation_id: str | None = None  # a task token: the invocation it was handed to ...
    attempt: int | None = None  # ... and that invocation's attempt (the token dies with its ack)


DEFAULT_NAMESPACE = "default"
#: Every kind of token, in the order the auth matrix (docs/security.md) shows them. ``task`` tokens
#: are minted by the control plane for each claimed invocation (server/tasks.py), never by an operator.
TOKEN_KINDS = ("admin", "producer", "daemon", "namespace", "metrics", "task")


def visible(namespace: str | None, inv: Invocation | Outcome) -> bool:
    """Whether a caller confined to ``namespace`` (None: not confined) may see ``inv``. The one
    rule behind the 404s of both planes: a producer sees its namespace's invocations only."""
    return namespace is None or inv.namespace == namespace


# -- listing (store/listing.py): what ``lakeshore queues|workers|ls|show`` and the dashboard read --

LIVE_WINDOW_S = 300.0  # a worker that polled or heartbeated this recently is live
LIST_LIMIT_MAX = 500  # the most rows one page of a listing holds


@dataclass
class QueueStats:
    """One queue: invocations by state, the oldest queued one's submit time, live workers."""

    name: str
    counts: dict[str, int]  # state -> invocations (every state present, 0 when none)
    oldest_queued_at: float | None  # submitted_at of the oldest queued invocation
    workers_live: int  # live workers whose registered queues include this one


@dataclass
class WorkerRow:
    worker_id: str
    info: dict[str, Any]  # the latest register: hostname, version, runner, queues, labels, slots, namespace
    registered_at: float
    last_seen: float  # the latest register, poll or heartbeat
    busy: int  # invocations and exec jobs it holds running
    stopped_at: float | None = None  # when it deregistered (a clean stop); a stopped worker is not live
    free_gpus: int | None = None  # the GPUs its latest poll offered free; None: not known


@dataclass
class WorkerPage:
    workers: list[WorkerRow]  # by worker id
    next_cursor: str | None  # pass as ``cursor`` for the next page; None on the last page


@dataclass
class InvocationPage:
    invocations: list[Invocation]  # newest first; args_blob and result_blob left empty
    next_cursor: str | None  # pass as ``cursor`` for the next page; None on the last page


@dataclass
class FrameStats:
    count: int
    last_seq: int | None
    first_at: float | None  # created_at of the first and the latest journaled frame
    last_at: float | None


class Listing(Protocol):
    """Read-only views for operators. ``namespace`` None: every namespace (an admin's view)."""

    def queue_stats(
        self, namespace: str | None = None, *, live_within: float = LIVE_WINDOW_S
    ) -> list[QueueStats]:
        """Every queue with invocations in ``namespace`` or a live worker serving it (``namespace``
        None: also every queue ever submitted to), by name."""
        ...

    def list_workers(
        self,
        namespace: str | None = None,
        *,
        live_within: float | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> WorkerPage:
        """Workers by id (after ``cursor``): all, or those bound to ``namespace`` or to none; only
        the ones seen within ``live_within`` seconds when given. ``limit`` clamped to
        1..LIST_LIMIT_MAX."""
        ...

    def live_queues(self, live_within: float = LIVE_WINDOW_S) -> dict[str, int]:
        """Queue name -> number of workers serving it that were seen within ``live_within`` s."""
        ...

    def live_workers_of(self, queue: str, live_within: float = LIVE_WINDOW_S) -> list[dict[str, Any]]:
        """The registered infos (labels, capacity) of the live workers serving ``queue``."""
        ...

    def count_workers(self, live_within: float | None = LIVE_WINDOW_S) -> int:
        """Workers seen within ``live_within`` seconds (None: every worker ever registered)."""
        ...

    def list_invocations(
        self,
        namespace: str | None = None,
        *,
        queue: str | None = None,
        states: list[str] | None = None,
        since: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
        sweep: str | None = None,
    ) -> InvocationPage:
        """Invocations newest first (by id, a ULID), submitted at or after ``since``, with ids
        before ``cursor``; at most ``limit`` (clamped to 1..LIST_LIMIT_MAX); only the calls of one
        ``map`` when ``sweep`` names it (``run_config.sweep``)."""
        ...

    def frame_stats(self, owner_id: str) -> FrameStats: ...

    def activity(self, namespace: str | None, since: float) -> list[Activity]:
        """Submit, start and finish times of what waited, ran or finished since ``since`` (the
        dashboard's charts; store/activity.py)."""
        ...

    def sweeps(self, namespace: str | None, since: float, limit: int = 20) -> list[Sweep]:
        """The ``map`` sweeps submitted since ``since``, newest first, with counts by state."""
        ...

    def limits(self) -> dict[str, dict[str, int]]:
        """Every fleet-wide limit: ``{"queues": {name: max_running}, "keys": {key: max}}``."""
        ...

    def limit_use(self, queue: str, concurrency_key: str | None) -> list[tuple[str, int, int]]:
        """``(name, max_running, running now)`` of each limit covering a call of ``queue`` (and of
        ``concurrency_key``)."""
        ...

    def key_limit_use(self) -> list[tuple[str, int, int]]:
        """``(concurrency_key, max_concurrency, running now)`` of every key limit, by key."""
        ...


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

    def write_batch(
        self,
        requests: Sequence[WriteRequest],
        on_commit: Callable[[list[tuple[int, WriteResult | PlaneError]]], None] | None = None,
    ) -> list[WriteResult | PlaneError]:
        """Apply many writes (submits, acks, frames, frame batches, heartbeats, poll passes)
        together: the group commit. Each answers as its single call would (``submit``, ``ack``,
        ``append_frame``, ``append_frames``, ``heartbeat`` and ``poll_pass``, the last two with
        the pinned version), or with the PlaneError that call would raise; one write's error never
        fails another. Submits apply first, in order, in a transaction of their own (committed,
        their waiters woken, before the rest) with the poll passes handed them (``PollRequest.handed``:
        right after them), then the acks, frames and other poll passes in order in a second, then
        the heartbeats in a third. ``on_commit`` receives each transaction's
        ``(index, answer)`` pairs once it committed, but the last one's (nothing is answered
        before it is durable); the return is every answer, in order, once all have committed."""
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
