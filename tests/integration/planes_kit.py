"""The planes the seed's SDK tests run on (local, HTTP over SQLite, HTTP over PostgreSQL), and a worker thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch, Plane
from tests.integration.conftest import running_control_plane

# The local plane, and the HTTP plane over a real control plane on each store it supports.
PLANES = ["local", "http-sqlite", "http-postgresql"]


@contextlib.contextmanager
def open_plane(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Plane, list[str]]]:
    """A plane of ``kind``, with the arguments another process needs to open the same plane."""
    if kind == "local":
        path = str(tmp_path / "jobs.db")
        local = Dispatch(path)
        try:
            yield local, ["local", path]
        finally:
            local.close()
        return
    store = str(tmp_path / "lakeshore.db") if kind == "http-sqlite" else request.getfixturevalue("_pg_url")
    with running_control_plane(store) as cp:
        http = HttpDispatch(cp.url, cp.admin_token)
        try:
            yield http, ["http", cp.url, cp.admin_token]
        finally:
            http.close()


@contextlib.contextmanager
def worker_thread(q: dls.SyncQueue, **kw: Any) -> Iterator[None]:
    """run_worker looping in a background thread until the block ends."""
    stop = threading.Event()
    t = threading.Thread(
        target=dls.run_worker, args=(q,), kwargs={"stop": stop, "poll_timeout": 0.5, **kw}, daemon=True
    )
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=15)
        assert not t.is_alive(), "worker thread did not stop"
