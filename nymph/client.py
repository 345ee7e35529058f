"""The typed control-plane client nymph speaks: the ``/v1/daemon/*`` routes over msgpack.

Routes, bodies and timeouts are the protocol package's
(:class:`~dreamlake.lakeshore.protocol.daemon.DaemonClient`); transport, token, retry rule and
error tree the one control-plane client's (:mod:`dreamlake.lakeshore.client`). This module adds
the link (below) and raises the lakeshore errors under their own names (:mod:`dreamlake.lakeshore.errors`, one name per
error)::

    PlaneError      any control-plane failure (.status: the HTTP status or None)
    Unavailable     connection errors, timeouts, 5xx, 429: retry with backoff + jitter
    Refused         the request will never succeed as sent
    AuthError       401 / 403: the token is wrong or lacks the daemon kind (stop)
    Conflict        409: another attempt owns the invocation (drop the message)
    NotFound        404: the control plane does not know the id
    BadRequest      another 4xx (a bug on one side)

Callers retry only what :func:`is_retryable` accepts (``Unavailable``).

Every call goes through one :class:`PlaneLink`: the poll, the heartbeat and the outbox all meet an
outage at once, and the operator reads one ``control plane went away`` line when the first of them
fails transiently and one ``reconnected`` line when a call succeeds again, not a line (or a
traceback) per poll; the callers log their own retries at DEBUG while the link is down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore.client import MSGPACK, is_retryable
from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.protocol.daemon import DaemonClient
from dreamlake.lakeshore.protocol.limits import ServerLimits

if TYPE_CHECKING:
    from collections.abc import Callable

    import httpx

__all__ = [
    "MSGPACK",
    "ControlPlaneClient",
    "PlaneLink",
    "is_retryable",
]

log = logging.getLogger("nymph.client")


STORE_OUTAGE_TEXTS = ("store unavailable: ", "store full: ")  # the control plane's 503 when its store is down


def store_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is the control plane's answer that its store is down (an outage to wait out)."""
    text = str(exc)
    return any(t in text for t in STORE_OUTAGE_TEXTS)


class PlaneLink:
    """Whether the control plane answers, as seen by every call: one line when it stops, one when
    it answers again."""

    def __init__(self, server: str) -> None:
        self._server = server
        self._lock = threading.Lock()
        self.up = True
        self.down_since: float | None = None

    def failed(self, route: str, exc: BaseException) -> None:
        """A call failed transiently (connection refused, timeout, 5xx, 429)."""
        with self._lock:
            if not self.up:
                return
            self.up = False
            self.down_since = time.monotonic()
        log.warning(
            "control plane went away (%s: %s); running work carries on, acks and frames wait in the "
            "outbox, claims stop until it answers again (retrying with backoff)",
            route,
            exc,
        )

    def answered(self, sent_at: float) -> None:
        """A call sent at ``sent_at`` (monotonic) got an answer (2xx or 4xx: one given on purpose).

        An answer to a request sent before the outage began (a long poll a stopping server
        answered empty) says nothing about now, so only a later request brings the link back up.
        """
        with self._lock:
            if self.up or (self.down_since is not None and sent_at < self.down_since):
                return
            self.up = True
            since, self.down_since = self.down_since, None
        gone = time.monotonic() - since if since is not None else 0.0
        log.warning("reconnected to the control plane at %s after %.1fs", self._server, gone)


class ControlPlaneClient(DaemonClient):
    """nymph's :class:`~dreamlake.lakeshore.protocol.daemon.DaemonClient`: the daemon routes, each
    tried once (the agent and the outbox retry, with loops that end when nymph stops), every call
    telling :attr:`link` whether the control plane answered. Thread-safe."""

    def __init__(
        self,
        server: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(server, token, timeout_s=timeout_s, transport=transport)
        self.link = PlaneLink(self.url)
        # what the control plane allows, as its register answer says (set by the agent); until then
        # what one that says nothing is taken to allow
        self.limits = ServerLimits()

    @property
    def server(self) -> str:
        return self.url

    def call(self, route: str, body: Any, *, timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` as msgpack to ``route``; the decoded answer, or a :class:`PlaneError`."""
        answer: dict[str, Any] = self._linked(
            route, lambda: super(ControlPlaneClient, self).call(route, body, timeout_s=timeout_s)
        )
        return answer

    def call_json(self, route: str, body: dict[str, Any], *, timeout_s: float = 30.0) -> dict[str, Any]:
        """POST ``body`` as JSON (the ``/v1/namespaces/*`` routes speak JSON); same errors as call."""
        answer: dict[str, Any] = self._linked(
            route, lambda: super(ControlPlaneClient, self).call_json(route, body, timeout_s=timeout_s)
        )
        return answer

    def _linked(self, route: str, send: Callable[[], Any]) -> Any:
        """``send()``, telling :attr:`link` whether the control plane answered."""
        sent_at = time.monotonic()
        try:
            answer = send()
        except PlaneError as exc:
            # gone: no connection, a timeout, a 5xx; a 429 / 503 with Retry-After is a server that
            # is there and asks for patience (poll admission control), not an outage, unless it
            # says its store is down ("store unavailable: ...", "store full: ...")
            asked_to_wait = exc.status == 429 or (
                exc.status == 503 and getattr(exc, "retry_after", None) and not store_outage(exc)
            )
            if is_retryable(exc) and not asked_to_wait:
                self.link.failed(route, exc)
            else:
                self.link.answered(sent_at)
            raise
        self.link.answered(sent_at)
        return answer

    def fetch(self, url: str, *, timeout_s: float = 60.0, limit: int = 100 * 2**20) -> bytes:
        """GET a presigned URL (no bearer token: the signature is the credential)."""
        return self.download(url, timeout_s=timeout_s, limit=limit)
