"""The store's records: what its calls take and answer (requests, results, invocations, outcomes,
frames, commands, principals, quotas) and the status codes of a refusal. Plain data, no behaviour
beyond a property or two; the calls themselves are the ``Store`` protocol (api.py), which
re-exports every name here.

Times are float seconds since the epoch. Blobs are ``bytes``. ``error`` is an ErrorInfo dict
``{"type", "message", "traceback"?}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .placement import NO_OFFER, Offer


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
    # The namespace's ``max_queued`` quota, checked in the submit's own transaction (store/quotas.py):
    # past it the submit answers QuotaExceeded (429) and nothing of it stays. None: no check.
    max_queued: int | None = None
    # Submits sharing a ``quota_group`` (one submit-batch) are checked together: all or none.
    quota_group: int | None = None


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
    handbacks: int = 0  # attempts handed back before they started: they spend nothing
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
            "handbacks": self.handbacks,
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
