"""The typed control-plane client nymph speaks: the ``/v1/daemon/*`` routes over msgpack.

Transport, token, retry rule and error tree are the one control-plane client's
(:mod:`dreamlake.lakeshore.client`); this module adds the daemon routes with their timeouts and
keeps nymph's names for the lakeshore errors it raises::

    ClientError     = PlaneError     any control-plane failure (.status: the HTTP status or None)
    TransientError  = Unavailable    connection errors, timeouts, 5xx, 429: retry with backoff + jitter
    FatalError      = Refused        the request will never succeed as sent
    AuthRejected    = AuthError      401 / 403: the token is wrong or lacks the daemon kind (stop)
    Superseded      = Conflict       409: another attempt owns the invocation (drop the message)
    NotFound        = NotFound       404: the control plane does not know the id
    BadRequest      = BadRequest     another 4xx (a bug on one side)

Callers retry only what :func:`is_retryable` accepts (``TransientError``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore.client import MSGPACK, PlaneClient, is_retryable
from dreamlake.lakeshore.errors import AuthError as AuthRejected
from dreamlake.lakeshore.errors import BadRequest, NotFound
from dreamlake.lakeshore.errors import Conflict as Superseded
from dreamlake.lakeshore.errors import PlaneError as ClientError
from dreamlake.lakeshore.errors import Refused as FatalError
from dreamlake.lakeshore.errors import Unavailable as TransientError

if TYPE_CHECKING:
    import httpx

__all__ = [
    "MSGPACK",
    "AuthRejected",
    "BadRequest",
    "ClientError",
    "ControlPlaneClient",
    "FatalError",
    "NotFound",
    "Superseded",
    "TransientError",
    "is_retryable",
]


class ControlPlaneClient(PlaneClient):
    """The daemon routes over one :class:`PlaneClient`; each call is tried once (the agent and the
    outbox retry, with loops that end when nymph stops). Thread-safe."""

    def __init__(
        self,
        server: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(server, token, timeout_s=timeout_s, transport=transport)

    @property
    def server(self) -> str:
        return self.url

    def call(self, route: str, body: dict[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` as msgpack to ``route``; the decoded answer, or a :class:`ClientError`."""
        answer = self.request("POST", route, body, timeout_s=timeout_s)
        if not isinstance(answer, dict):
            raise TransientError(f"POST {route}: unexpected answer {answer!r:.80}")
        return answer

    def call_json(self, route: str, body: dict[str, Any], *, timeout_s: float = 30.0) -> dict[str, Any]:
        """POST ``body`` as JSON (the ``/v1/namespaces/*`` routes speak JSON); same errors as call."""
        answer = self.request("POST", route, body, as_json=True, timeout_s=timeout_s)
        return answer if isinstance(answer, dict) else {}

    def fetch(self, url: str, *, timeout_s: float = 60.0, limit: int = 100 * 2**20) -> bytes:
        """GET a presigned URL (no bearer token: the signature is the credential)."""
        return self.download(url, timeout_s=timeout_s, limit=limit)

    # --- routes --------------------------------------------------------------------------------

    def register(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call("/v1/daemon/register", body)

    def poll(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        return self.call("/v1/daemon/poll", body, timeout_s=timeout_s + 10.0)

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call("/v1/daemon/heartbeat", body, timeout_s=15.0)

    def ack(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call("/v1/daemon/ack", body, timeout_s=30.0)

    def result_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call("/v1/daemon/result-chunk", body, timeout_s=30.0)
