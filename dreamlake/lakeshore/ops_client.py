"""``OpsClient``: the operator routes (``/v1/ops/*``, JSON) from Python, for the CLI and scripts.

Errors follow ``HttpDispatch``: 401/403 :class:`AuthError`, 404 :class:`NotFound`, anything else
:class:`PlaneError`, each with the server's ``error`` text; a connection failure is a PlaneError
that names the URL. Reads are retried on connection errors and 5xx (idempotent GETs); cancel is
retried too (cancelling twice is harmless).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import AuthError, NotFound, PlaneError


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, PlaneError) and exc.status is not None and exc.status >= 500


class OpsClient:
    """The control plane at ``url`` with a bearer ``token`` (admin, producer or namespace kind)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"control plane url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.retries = max(1, retries)
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=httpx.Timeout(timeout, connect=5.0),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OpsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        what = f"{method} {path}"
        query = {k: v for k, v in (params or {}).items() if v is not None}

        def once() -> dict[str, Any]:
            resp = self._http.request(method, path, params=query, json={} if method == "POST" else None)
            try:
                body = resp.json()
            except ValueError:
                body = {"error": resp.text[:300]}
            if resp.status_code >= 400:
                message = body.get("error", body) if isinstance(body, dict) else body
                if resp.status_code in (401, 403):
                    raise AuthError(f"{what}: {message}", resp.status_code)
                if resp.status_code == 404:
                    raise NotFound(f"{message}", resp.status_code)
                raise PlaneError(f"{what} failed with HTTP {resp.status_code}: {message}", resp.status_code)
            return body if isinstance(body, dict) else {}

        try:
            for attempt in Retrying(
                retry=retry_if_exception(_transient),
                stop=stop_after_attempt(self.retries),
                wait=wait_exponential_jitter(multiplier=0.1, max=2.0, jitter=0.2),
                reraise=True,
            ):
                with attempt:
                    return once()
        except httpx.TransportError as exc:
            raise PlaneError(
                f"cannot reach the control plane at {self.url} ({what}): {type(exc).__name__}: {exc}. "
                "Is `lakeshore server` running there?"
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def whoami(self) -> dict[str, Any]:
        return self._request("GET", "/v1/ops/whoami")

    def queues(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/v1/ops/queues")["queues"])

    def workers(self, *, live: bool = False, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        params = {"live": "1" if live else None, "limit": limit, "cursor": cursor}
        return self._request("GET", "/v1/ops/workers", params)

    def all_workers(self, *, live: bool = False) -> Iterator[dict[str, Any]]:
        cursor: str | None = None
        while True:
            page = self.workers(live=live, limit=500, cursor=cursor)
            yield from page["workers"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def invocations(
        self,
        *,
        queue: str | None = None,
        states: list[str] | None = None,
        since: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """One page: ``{"invocations": [...], "next_cursor": id | None}``, newest first."""
        params = {
            "queue": queue,
            "state": ",".join(states) if states else None,
            "since": since,
            "limit": limit,
            "cursor": cursor,
        }
        return self._request("GET", "/v1/ops/invocations", params)

    def invocation(self, invocation_id: str) -> dict[str, Any]:
        inv = ids.validate(invocation_id, "invocation id")
        return self._request("GET", f"/v1/ops/invocations/{inv}")

    def cancel(self, invocation_id: str) -> str:
        inv = ids.validate(invocation_id, "invocation id")
        return str(self._request("POST", f"/v1/ops/invocations/{inv}/cancel")["state"])
