"""The typed control-plane client nymph speaks: the ``/v1/daemon/*`` routes over msgpack.

This module is the one place that decides what is retryable. Every httpx failure is translated
here, with ``raise ... from``, into the small hierarchy below::

    ClientError
     +-- TransientError      connection errors, timeouts, 5xx, 429: retry with backoff + jitter
     +-- FatalError          the request will never succeed as sent
          +-- AuthRejected   401 / 403: the token is wrong or lacks the daemon kind (stop the agent)
          +-- Superseded     409: another attempt owns the invocation (final: drop the message)
          +-- NotFound       404: the control plane does not know the id (final)
          +-- BadRequest     other 4xx (final; a bug on one side)

Callers retry only :class:`TransientError` (see :func:`is_retryable`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import httpx
import msgpack

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"


class ClientError(Exception):
    """A control-plane call failed. ``status`` is the HTTP status when there was an answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after: float | None = None  # seconds, from a 503's or 429's Retry-After header


class TransientError(ClientError):
    """Worth retrying: the control plane was unreachable, overloaded or failed internally."""


class FatalError(ClientError):
    """Not worth retrying as is."""


class AuthRejected(FatalError):
    """401 / 403: fix the token (``nymph doctor`` says how)."""


class Superseded(FatalError):
    """409: the attempt was superseded or the invocation is no longer running."""


class NotFound(FatalError):
    """404: unknown id."""


class BadRequest(FatalError):
    """Another 4xx: the request is malformed."""


def is_retryable(exc: BaseException) -> bool:
    """The retry rule: transient errors (connection, timeout, 5xx, 429) only."""
    return isinstance(exc, TransientError)


def _classify(route: str, status: int, message: str) -> ClientError:
    text = f"{route}: HTTP {status}: {message}"
    if status in (401, 403):
        return AuthRejected(text, status)
    if status == 409:
        return Superseded(text, status)
    if status == 404:
        return NotFound(text, status)
    if status == 429 or status >= 500:
        return TransientError(text, status)
    return BadRequest(text, status)


class ControlPlaneClient:
    """Sync httpx client for the daemon routes; thread-safe (httpx.Client is)."""

    def __init__(
        self,
        server: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self._http = httpx.Client(
            base_url=self.server,
            headers={"Authorization": f"Bearer {token}", "Accept": MSGPACK},
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def call(self, route: str, body: dict[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` as msgpack to ``route``; the decoded answer, or a :class:`ClientError`."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s, connect=5.0)
        payload = msgpack.packb(body, use_bin_type=True)
        answer, status = self._post(
            route, content=payload, headers={"Content-Type": MSGPACK}, timeout=timeout
        )
        if not isinstance(answer, dict):
            raise TransientError(f"{route}: unexpected answer {answer!r:.80}", status)
        return answer

    def call_json(self, route: str, body: dict[str, Any], *, timeout_s: float = 30.0) -> dict[str, Any]:
        """POST ``body`` as JSON (the ``/v1/namespaces/*`` routes speak JSON); same errors as call."""
        answer, _ = self._post(
            route,
            json=body,
            headers={"Accept": "application/json"},
            timeout=httpx.Timeout(timeout_s, connect=5.0),
        )
        return answer if isinstance(answer, dict) else {}

    def _post(self, route: str, **request: Any) -> tuple[Any, int]:
        """One POST with httpx errors and 4xx/5xx answers translated to :class:`ClientError`."""
        try:
            resp = self._http.post(route, **request)
        except httpx.TransportError as exc:
            raise TransientError(f"{route}: cannot reach {self.server}: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise TransientError(f"{route}: {type(exc).__name__}: {exc}") from exc
        except httpx.InvalidURL as exc:  # e.g. a route built from a bad name: never retried
            raise BadRequest(f"{route}: invalid URL: {exc}") from exc
        answer = _decode(resp)
        if resp.status_code >= 400:
            message = answer.get("error") if isinstance(answer, dict) else None
            error = _classify(route, resp.status_code, str(message or resp.reason_phrase))
            with contextlib.suppress(ValueError):  # absent, or an HTTP date: back off as usual
                error.retry_after = min(300.0, max(0.0, float(resp.headers.get("Retry-After", ""))))
            raise error
        return answer, resp.status_code

    def fetch(self, url: str, *, timeout_s: float = 60.0, limit: int = 100 * 2**20) -> bytes:
        """GET a presigned URL (no bearer token: the signature is the credential)."""
        try:
            with httpx.stream("GET", url, timeout=timeout_s) as resp:
                if resp.status_code != 200:
                    raise _classify(f"GET {url.split('?')[0]}", resp.status_code, resp.reason_phrase)
                data = bytearray()
                for part in resp.iter_bytes():
                    data += part
                    if len(data) > limit:
                        raise BadRequest(f"GET {url.split('?')[0]}: payload over {limit} bytes")
                return bytes(data)
        except httpx.TransportError as exc:
            raise TransientError(f"GET {url.split('?')[0]}: {type(exc).__name__}: {exc}") from exc

    def healthz(self) -> dict[str, Any]:
        try:
            resp = self._http.get("/healthz", timeout=5.0)
        except httpx.HTTPError as exc:
            raise TransientError(f"/healthz: cannot reach {self.server}: {exc}") from exc
        if resp.status_code != 200:
            raise _classify("/healthz", resp.status_code, resp.text[:200])
        try:
            out = resp.json()
        except ValueError:
            out = {}
        return out if isinstance(out, dict) else {}

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


def _decode(resp: httpx.Response) -> Any:
    if not resp.content:
        return {}
    ctype = resp.headers.get("content-type", "")
    try:
        if "msgpack" in ctype:
            return msgpack.unpackb(resp.content, raw=False)
        if "json" in ctype:
            return resp.json()
    except (ValueError, msgpack.UnpackException):
        pass
    return {"error": resp.text[:300]}
