"""``OpsClient``: the operator routes (``/v1/ops/*``, JSON) from Python, for the CLI and scripts.

It speaks through :class:`~dreamlake.lakeshore.client.PlaneClient`, so its errors and retries are
every client's: 401/403 :class:`AuthError`, 404 :class:`NotFound`, another 4xx
:class:`BadRequest`, connection failures and 5xx :class:`Unavailable` (retried, with jitter). Every
call is safe to retry: the reads are GETs, and cancelling twice is harmless.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.client import PlaneClient
from dreamlake.lakeshore.protocol import routes


class OpsClient:
    """The control plane at ``url`` with a bearer ``token`` (admin, producer or namespace kind)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        attempts: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"control plane url must start with http:// or https://, got {url!r}")
        self._client = PlaneClient(url, token, timeout_s=timeout_s, attempts=attempts, transport=transport)
        self.url = self._client.url

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> OpsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        body: dict[str, Any] | None = {} if method == "POST" else None
        out = self._client.request(method, path, body, as_json=True, params=query)
        return out if isinstance(out, dict) else {}

    # -- secrets (server/secrets.py): names and times only come back, never a value -------------

    def secret_set(self, namespace: str, name: str, value: str) -> None:
        self._client.request("PUT", routes.secret(namespace, name), {"value": value}, as_json=True)

    def secret_names(self, namespace: str) -> list[dict[str, Any]]:
        return list(self._request("GET", routes.secrets(namespace))["secrets"])

    def secret_remove(self, namespace: str, name: str) -> None:
        self._request("DELETE", routes.secret(namespace, name))

    def whoami(self) -> dict[str, Any]:
        return self._request("GET", routes.WHOAMI)

    def queues(self) -> list[dict[str, Any]]:
        return list(self.queue_listing()["queues"])

    def queue_listing(self) -> dict[str, Any]:
        """``{"queues": [...], "key_limits": [{key, max_concurrency, running}], ...}``."""
        return self._request("GET", routes.QUEUES)

    def workers(self, *, live: bool = False, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        params = {"live": "1" if live else None, "limit": limit, "cursor": cursor}
        return self._request("GET", routes.WORKERS, params)

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
        sweep: str | None = None,
    ) -> dict[str, Any]:
        """One page: ``{"invocations": [...], "next_cursor": id | None}``, newest first (only the
        calls of one ``map`` with ``sweep``)."""
        params = {
            "queue": queue,
            "state": ",".join(states) if states else None,
            "since": since,
            "limit": limit,
            "cursor": cursor,
            "sweep": sweep,
        }
        return self._request("GET", routes.INVOCATIONS, params)

    def invocation(self, invocation_id: str) -> dict[str, Any]:
        inv = ids.validate(invocation_id, "invocation id")
        return self._request("GET", routes.ops_invocation(inv))

    def cancel(self, invocation_id: str) -> str:
        inv = ids.validate(invocation_id, "invocation id")
        return str(self._request("POST", routes.ops_cancel(inv))["state"])

    def set_queue_limit(self, queue: str, max_running: int | None) -> dict[str, Any]:
        """Cap the calls of ``queue`` running at once across the fleet (None: clear); admin only."""
        path = routes.queue_limit(queue)
        if max_running is None:
            out = self._client.request("DELETE", path, as_json=True)
        else:
            out = self._client.request("PUT", path, {"max_running": max_running}, as_json=True)
        return out if isinstance(out, dict) else {}
