"""Many idle pollers against one control plane: the poll and submit calls the fleet tests make, and their settings."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import MSGPACK, submit_body

NO_RECHECK = ServerConfig(recheck_s=600.0, poll_recheck_s=600.0)


POLL_S = 100.0


def headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": MSGPACK}


async def poll_once(
    client: httpx.AsyncClient, worker: str, queue: str, offer: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"worker_id": worker, "queues": [queue], "max": 1, "timeout_s": POLL_S}
    if offer is not None:  # what the daemon has free (placement): {"gpus": 1, "labels": {...}}
        body["offer"] = offer
    resp = await client.post("/v1/daemon/poll", content=msgpack.packb(body))
    assert resp.status_code == 200, resp.content
    out: dict[str, Any] = msgpack.unpackb(resp.content)
    return out


async def submit_one(client: httpx.AsyncClient, queue: str) -> str:
    inv = new_ulid()
    resp = await client.post("/v1/producer/submit", content=msgpack.packb(submit_body(inv, queue)))
    assert resp.status_code == 200, resp.content
    return inv
