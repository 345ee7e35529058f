"""A namespace's ``max_queued`` holds under concurrent submits, over real HTTP, against ``lakeshore
server`` on SQLite and on PostgreSQL with two worker processes (``--workers 2``): a flood of
submits and submit-batches sent all at once, every one of them past the route's early check
before any has committed, never leaves more than the quota queued, and a batch is queued whole or
not at all. The store holds the quota in the submits' own transaction (store/invocations.py
``_hold_quotas_in``); on PostgreSQL the namespace's advisory lock keeps two processes' counts from
passing together (the window is narrow over HTTP: tests/contract/test_store_quotas.py races two
stores' threads on it directly)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.api import Quota
from tests.contract.conftest import pg_database
from tests.integration.load import server_process
from tests.stack.producer import submit_body

QUOTA = 5
SINGLES = 40
BATCHES = 10  # of two submits each


async def _flood(url: str, token: str) -> tuple[list[int], list[list[str]]]:
    """Every submit and submit-batch at once; the singles' statuses, and each batch's answer:
    the invocation ids it queued, or ``[]`` for a 429."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/x-msgpack"}
    limits = httpx.Limits(max_connections=SINGLES + BATCHES)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30, limits=limits) as client:

        async def single() -> int:
            body = submit_body(new_ulid(), "q-strict")
            r = await client.post("/v1/producer/submit", content=msgpack.packb(body, use_bin_type=True))
            if r.status_code == 429:
                assert "quota max_queued of 5" in msgpack.unpackb(r.content)["error"]
                assert int(r.headers["retry-after"]) > 0
            return r.status_code

        async def batch() -> list[str]:
            body = {"submits": [submit_body(new_ulid(), "q-strict") for _ in range(2)]}
            r = await client.post("/v1/producer/submit-batch", content=msgpack.packb(body, use_bin_type=True))
            if r.status_code == 429:
                return []
            assert r.status_code == 200, r.content
            results: list[dict[str, Any]] = msgpack.unpackb(r.content)["results"]
            assert all("error" not in item for item in results), results  # whole, or a 429
            return [item["invocation_id"] for item in results]

        got = await asyncio.gather(*(single() for _ in range(SINGLES)), *(batch() for _ in range(BATCHES)))
    return list(got[:SINGLES]), list(got[SINGLES:])  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql-2-workers"])
def test_concurrent_submits_never_leave_more_than_max_queued(backend: str, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        if backend == "sqlite":
            db, extra = str(tmp_path / "store.db"), ()
        else:
            db, extra = stack.enter_context(pg_database()), ("--workers", "2")
        store = stack.enter_context(contextlib.closing(open_store(db)))
        store.set_quota("default", Quota(max_queued=QUOTA))  # the admin token submits to "default"
        _proc, url, token = stack.enter_context(server_process(db, tmp_path, *extra))
        singles, batches = asyncio.run(_flood(url, token))
        assert set(singles) <= {200, 429} and 429 in singles
        queued = singles.count(200) + sum(len(ids) for ids in batches)
        assert queued == QUOTA, (singles, batches)  # full, and not one more
        assert store.count_queued("default", 100) == QUOTA
