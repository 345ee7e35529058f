"""A fake control plane for nymph's outbox and its wake-ups: records what it was sent, fails on demand."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import msgpack

from nymph.client import ControlPlaneClient


class FakePlane:
    """A control plane at the transport seam: answers from a script of status codes, then 200."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.down = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down.is_set():
            raise httpx.ConnectError("connection refused", request=request)
        with self.lock:
            status = self.statuses.pop(0) if self.statuses else 200
            if status == 200:
                self.received.append((request.url.path, msgpack.unpackb(request.content)))
        body = {"ok": status == 200} if status == 200 else {"error": f"status {status}"}
        return httpx.Response(
            status, content=msgpack.packb(body), headers={"content-type": "application/x-msgpack"}
        )

    def client(self) -> ControlPlaneClient:
        return ControlPlaneClient("http://cp", "tok", transport=httpx.MockTransport(self))
