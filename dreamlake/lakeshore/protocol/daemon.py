"""``DaemonClient``: the ``/v1/daemon/*`` routes of a worker, with their timeouts.

A route takes its body as the typed shape (:mod:`~dreamlake.lakeshore.protocol.shapes`) or a plain
dict of the same fields, and answers the decoded dict its docstring names the shape of.

Both workers speak through it: nymph (``nymph.client.ControlPlaneClient`` is a ``DaemonClient``
that also tells its link whether the control plane answers) and ``lakeshore worker`` /
``run_worker`` over HTTP (``HttpDispatch``'s worker plane). Transport, token, retry rule and
error tree are the one control-plane client's (:class:`~dreamlake.lakeshore.client.PlaneClient`);
every call goes through :meth:`DaemonClient.call`, the one place a subclass hooks.

A route that waits on the server (the poll, sends) is given the server-side wait and reads for
that long plus :data:`SLACK_S`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore.client import PlaneClient
from dreamlake.lakeshore.errors import Unavailable
from dreamlake.lakeshore.protocol import routes
from dreamlake.lakeshore.protocol.limits import ServerLimits

if TYPE_CHECKING:
    from dreamlake.lakeshore.protocol.shapes import (
        AckBody,
        HeartbeatBody,
        PollBody,
        RegisterBody,
        ResultChunksBody,
        SendsBody,
    )

__all__ = ["SLACK_S", "DaemonClient"]

SLACK_S = 10.0  # read-timeout margin over a server-side wait (a long poll, a sends wait)
HEARTBEAT_TIMEOUT_S = 15.0
DEREGISTER_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 30.0  # acks, chunks, checkpoints, secrets


class DaemonClient(PlaneClient):
    """The daemon routes over one :class:`PlaneClient` (thread-safe, as it is)."""

    def call(self, route: str, body: Any, *, timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` as msgpack to ``route``; the decoded answer, or a :class:`PlaneError`."""
        answer = self.request("POST", route, body, timeout_s=timeout_s)
        if not isinstance(answer, dict):
            raise Unavailable(f"POST {route}: unexpected answer {answer!r:.80}")
        return answer

    def call_json(self, route: str, body: dict[str, Any], *, timeout_s: float = 30.0) -> dict[str, Any]:
        """POST ``body`` as JSON (the ``/v1/namespaces/*`` and ``/v1/ops/*`` routes speak JSON)."""
        answer = self.request("POST", route, body, as_json=True, timeout_s=timeout_s)
        return answer if isinstance(answer, dict) else {}

    # -- routes -------------------------------------------------------------------------------------

    def register(self, body: RegisterBody | dict[str, Any]) -> dict[str, Any]:
        """Register a worker; the answer (:class:`RegisterAnswer`) carries its lease, heartbeat and
        the control plane's limits (:meth:`limits_of`)."""
        return self.call(routes.REGISTER, body)

    @staticmethod
    def limits_of(answer: Any) -> ServerLimits:
        """The control plane's limits, as a register answer says them."""
        return ServerLimits.from_answer(answer)

    def poll(self, body: PollBody | dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """One poll; ``timeout_s`` is how long the server may wait for work (``body["timeout_s"]``
        says the same to the server). The answer is a :class:`PollAnswer`."""
        return self.call(routes.POLL, body, timeout_s=timeout_s + SLACK_S)

    def heartbeat(self, body: HeartbeatBody | dict[str, Any]) -> dict[str, Any]:
        """Renew the leases of what runs; the answer (:class:`HeartbeatAnswer`) names cancels."""
        return self.call(routes.HEARTBEAT, body, timeout_s=HEARTBEAT_TIMEOUT_S)

    def deregister(self, worker_id: str) -> dict[str, Any]:
        return self.call(routes.DEREGISTER, {"worker_id": worker_id}, timeout_s=DEREGISTER_TIMEOUT_S)

    def ack(self, body: AckBody | dict[str, Any]) -> dict[str, Any]:
        return self.call(routes.ACK, body, timeout_s=WRITE_TIMEOUT_S)

    def secrets(self, body: dict[str, Any]) -> dict[str, str]:
        """The values of the secrets a claimed invocation names (``{invocation_id, attempt,
        worker_id}``): for its task's environment, never to be logged."""
        answer = self.call(routes.SECRETS, body, timeout_s=WRITE_TIMEOUT_S).get("secrets") or {}
        return {str(k): str(v) for k, v in answer.items()}

    def sends(self, body: SendsBody | dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """The sends into a two-way invocation this worker holds (a long poll: ``timeout_s`` is
        the whole read timeout, the server's ``wait_s`` and a margin): a :class:`SendsAnswer`."""
        return self.call(routes.SENDS, body, timeout_s=timeout_s)

    def result_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(routes.RESULT_CHUNK, body, timeout_s=WRITE_TIMEOUT_S)

    def result_chunks(self, body: ResultChunksBody | dict[str, Any]) -> dict[str, Any]:
        """A batch of an invocation's frames, in seq order (one request)."""
        return self.call(routes.RESULT_CHUNKS, body, timeout_s=WRITE_TIMEOUT_S)

    def checkpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(routes.CHECKPOINT, body, timeout_s=WRITE_TIMEOUT_S)
