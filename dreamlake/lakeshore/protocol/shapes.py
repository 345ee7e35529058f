"""The bodies and answers of the client side's routes, typed (docs/protocol.md is the prose).

``TypedDict`` s, so a body is still the plain dict msgpack sends and a type checker reads its
fields; ``total=False`` marks a shape whose fields are each optional on the wire. Bytes fields are
msgpack ``bin``.
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = [
    "AckAnswer",
    "AckBody",
    "AwaitAnswer",
    "Command",
    "HeartbeatAnswer",
    "HeartbeatBody",
    "InfoAnswer",
    "PollAnswer",
    "PollBody",
    "RegisterAnswer",
    "RegisterBody",
    "ResultChunksBody",
    "SendsAnswer",
    "SendsBody",
    "SubmitAnswer",
    "SubmitBatchAnswer",
    "SubmitBody",
]


# -- daemon -----------------------------------------------------------------------------------------


class RegisterBody(TypedDict, total=False):
    worker_id: str
    hostname: str
    version: str
    runner: str
    queues: list[str]
    labels: dict[str, str]
    slots: int
    namespace: str
    capacity: dict[str, Any]
    allow_pickled: bool


class RegisterAnswer(TypedDict, total=False):
    worker_id: str
    lease_s: float
    heartbeat_s: float
    inline_threshold_bytes: int  # absent: the control plane has no payload store
    limits: dict[str, Any]  # ServerLimits


class AckBody(TypedDict, total=False):
    invocation_id: str
    state: str
    attempt: int
    worker_id: str  # absent from an ack carried by a poll (the poll names the worker)
    result_blob: bytes
    result_ref: dict[str, Any]
    error: dict[str, Any] | None


class AckAnswer(TypedDict, total=False):
    """One ack's answer (alone, or one of a poll's ``acked``, in the order sent)."""

    invocation_id: str
    ok: bool
    status: int
    error: str
    duplicate: bool


class PollBody(TypedDict, total=False):
    worker_id: str
    queues: list[str]
    max: int
    kinds: list[str]  # "run", "exec"
    timeout_s: float
    version: str
    acks: list[AckBody]  # at most ServerLimits.acks_per_poll


class Command(TypedDict):
    kind: str  # "run", "exec", "cancel", ...
    body: dict[str, Any]


class PollAnswer(TypedDict, total=False):
    commands: list[Command]
    acked: list[AckAnswer]


class HeartbeatBody(TypedDict, total=False):
    worker_id: str
    running: list[dict[str, Any]]  # {invocation_id, attempt}
    free_slots: int


class HeartbeatAnswer(TypedDict, total=False):
    commands: list[Command]


class ResultChunksBody(TypedDict):
    invocation_id: str
    attempt: int
    worker_id: str
    frames: list[bytes]  # encoded frames, in seq order


class SendsBody(TypedDict):
    invocation_id: str
    attempt: int
    worker_id: str
    since: int
    wait_s: float


class SendsAnswer(TypedDict, total=False):
    frames: list[bytes]


# -- producer ---------------------------------------------------------------------------------------


class SubmitBody(TypedDict, total=False):
    invocation_id: str
    queue: str
    function: dict[str, str]
    run_config: dict[str, Any]
    code_context: dict[str, Any]
    args_blob: bytes  # inline, or:
    args_ref: dict[str, Any]  # by reference (limits.by_reference)
    parent_invocation_id: str
    wait_s: float  # submit and await in one request


class SubmitAnswer(TypedDict, total=False):
    invocation_id: str
    warning: str
    outcome: dict[str, Any]  # with wait_s


class SubmitBatchAnswer(TypedDict, total=False):
    results: list[dict[str, Any]]  # {invocation_id} or {error, status}, in order
    warnings: dict[str, str]  # queue -> warning


class AwaitAnswer(TypedDict, total=False):
    state: str
    result_blob: bytes
    result_ref: dict[str, Any]
    error: dict[str, Any] | None


class InfoAnswer(TypedDict, total=False):
    version: str
    limits: dict[str, Any]  # ServerLimits
