"""Every control-plane route the client side calls, by name: the one place a path is spelled.

The server's side of the same paths is its one auth table (``server/authz.py``); this module is
the clients' (``HttpDispatch``, ``lakeshore worker``, nymph and its outbox, the operators' CLI
client ``ops_client``, ``Execs``). A path with an object
in it is a function of that object. The strings are part of the wire: nymph's outbox writes a
message's route to disk and replays it after an upgrade, so a path here changes only together
with the server's.
"""

from __future__ import annotations

__all__ = [
    "ACK",
    "AWAIT",
    "AWAIT_BATCH",
    "CHECKPOINT",
    "DAEMON_ROUTES",
    "DEREGISTER",
    "HEARTBEAT",
    "INFO",
    "INVOCATIONS",
    "NAMESPACE_ROUTES",
    "POLL",
    "QUEUES",
    "REGISTER",
    "RESULT_CHUNK",
    "RESULT_CHUNKS",
    "SECRETS",
    "SENDS",
    "SUBMIT",
    "SUBMIT_BATCH",
    "WHOAMI",
    "WORKERS",
    "cancel",
    "exec_",
    "invocation",
    "job_output",
    "job_result",
    "ops_cancel",
    "ops_invocation",
    "presign",
    "queue_limit",
    "result_stream",
    "secret",
    "secrets",
    "send",
    "topic_post",
    "topic_stream",
]

# -- daemon: a worker (nymph, ``lakeshore worker``) on the work it claims --------------------------
REGISTER = "/v1/daemon/register"
POLL = "/v1/daemon/poll"
HEARTBEAT = "/v1/daemon/heartbeat"
DEREGISTER = "/v1/daemon/deregister"
ACK = "/v1/daemon/ack"
RESULT_CHUNK = "/v1/daemon/result-chunk"
RESULT_CHUNKS = "/v1/daemon/result-chunks"
SENDS = "/v1/daemon/sends"
SECRETS = "/v1/daemon/secrets"
CHECKPOINT = "/v1/daemon/checkpoint"
DAEMON_ROUTES = (
    REGISTER,
    POLL,
    HEARTBEAT,
    DEREGISTER,
    ACK,
    RESULT_CHUNK,
    RESULT_CHUNKS,
    SENDS,
    SECRETS,
    CHECKPOINT,
)

# -- producer: submitting calls and reading their outcomes -----------------------------------------
SUBMIT = "/v1/producer/submit"
SUBMIT_BATCH = "/v1/producer/submit-batch"
AWAIT = "/v1/producer/await"
AWAIT_BATCH = "/v1/producer/await-batch"


def invocation(invocation_id: str) -> str:
    """``GET``: an invocation's status record."""
    return f"/v1/producer/invocations/{invocation_id}"


def cancel(invocation_id: str) -> str:
    return f"{invocation(invocation_id)}/cancel"


def send(invocation_id: str) -> str:
    """A value (or throw, or close) into a running two-way generator."""
    return f"{invocation(invocation_id)}/send"


def result_stream(invocation_id: str) -> str:
    return f"{invocation(invocation_id)}/result/stream"


def topic_post(name: str) -> str:
    return f"/v1/producer/topics/{name}/post"


def topic_stream(name: str) -> str:
    return f"/v1/producer/topics/{name}/stream"


# -- namespaces (JSON): payloads by reference, exec jobs --------------------------------------------
NAMESPACE_ROUTES = "/v1/namespaces/"  # the prefix of the routes that speak JSON, not msgpack


def presign(namespace: str) -> str:
    """Presigned URLs of the namespace's payload store (``{"op": "put" | "get", ...}``)."""
    return f"{NAMESPACE_ROUTES}{namespace}/payloads/presign"


def job_result(namespace: str, exec_id: str) -> str:
    """An exec job's outcome: nymph posts it, the namespace reads it."""
    return f"{NAMESPACE_ROUTES}{namespace}/jobs/{exec_id}/result"


def exec_(namespace: str) -> str:
    """Queue an exec job (a shell command) in the namespace."""
    return f"{NAMESPACE_ROUTES}{namespace}/exec"


def secrets(namespace: str) -> str:
    """The namespace's secrets (names and times only come back)."""
    return f"{NAMESPACE_ROUTES}{namespace}/secrets"


def secret(namespace: str, name: str) -> str:
    return f"{secrets(namespace)}/{name}"


# -- operators (JSON) -------------------------------------------------------------------------------
WHOAMI = "/v1/ops/whoami"
WORKERS = "/v1/ops/workers"
QUEUES = "/v1/ops/queues"
INVOCATIONS = "/v1/ops/invocations"
INFO = "/v1/ops/info"  # the limits the control plane decides (ServerLimits), for every token kind


def ops_invocation(invocation_id: str) -> str:
    return f"{INVOCATIONS}/{invocation_id}"


def ops_cancel(invocation_id: str) -> str:
    return f"{ops_invocation(invocation_id)}/cancel"


def queue_limit(queue: str) -> str:
    """A queue's fleet-wide limit of running calls (admins)."""
    return f"{QUEUES}/{queue}/limit"


def job_output(namespace: str, exec_id: str, stream: str) -> str:
    """An exec job's output archive of ``stream`` (stdout, stderr)."""
    return f"{NAMESPACE_ROUTES}{namespace}/jobs/{exec_id}/output/{stream}"
