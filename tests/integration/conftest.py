"""A real control plane over HTTP for integration tests: ``control_plane`` (SQLite and PostgreSQL).

The server is ``create_app`` under uvicorn in a background thread, on a free loopback port chosen
at runtime; tests talk to it with httpx like any daemon or producer would. The fixture object
also holds the store, so a test can check rows directly.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.conftest import store as store  # the store of this folder's store_url (re-used)
from tests.stack.producer import submit_body

__all__ = ["ControlPlane", "running_control_plane", "submit_body"]  # submit_body: shared with the suite

MSGPACK = "application/x-msgpack"


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when proto says TCP
        # (proto 0 leaves Nagle on, and every answer waits ~40 ms for a delayed ACK).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        from dreamlake.lakeshore.server.guard import uvicorn_config

        limits = getattr(getattr(app.state, "ctx", None), "config", None) or ServerConfig()
        config = uvicorn_config(app, limits, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("control plane did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@dataclass
class ControlPlane:
    url: str
    store: SqlStore
    admin_token: str
    daemon_token: str
    producer_token: str
    app: Any = None
    clients: list[httpx.Client] = field(default_factory=list)

    def client(self, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        c = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.clients.append(c)
        return c

    def call(
        self,
        path: str,
        body: Any,
        token: str | None,
        *,
        method: str = "POST",
        raw: bytes | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        """Send ``body`` as msgpack (or ``raw`` bytes); return (status, decoded msgpack answer)."""
        content = raw if raw is not None else msgpack.packb(body, use_bin_type=True)
        headers = {"Content-Type": MSGPACK}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        with httpx.Client(base_url=self.url, timeout=timeout) as c:
            resp = c.request(method, path, content=content if method != "GET" else None, headers=headers)
        return resp.status_code, msgpack.unpackb(resp.content, raw=False) if resp.content else None

    def json(
        self,
        method: str,
        path: str,
        body: Any,
        token: str | None,
        *,
        raw: bytes | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        """A JSON call (namespace routes); returns (status, decoded JSON answer)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with httpx.Client(base_url=self.url, timeout=timeout) as c:
            if raw is not None:
                resp = c.request(method, path, content=raw, headers=headers)
            elif method == "GET":
                resp = c.request(method, path, headers=headers)
            else:
                resp = c.request(method, path, json=body, headers=headers)
        return resp.status_code, resp.json() if resp.content else None

    def producer(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        return self.call(path, body, self.producer_token, **kw)

    def daemon(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        return self.call(path, body, self.daemon_token, **kw)

    def submit(
        self,
        queue: str = "default",
        *,
        run_config: dict[str, Any] | None = None,
        args_blob: bytes = b"\x90",
        **extra: Any,
    ) -> str:
        inv = new_ulid()
        body = submit_body(inv, queue, run_config=run_config, args_blob=args_blob, **extra)
        status, out = self.producer("/v1/producer/submit", body)
        assert status == 200, out
        return str(out["invocation_id"])

    def close(self) -> None:
        for c in self.clients:
            c.close()


@contextlib.contextmanager
def running_control_plane(
    store_url: str, *, config: ServerConfig | None = None, fanout: Any = None, payloads: Any = None
) -> Iterator[ControlPlane]:
    """Open the store at ``store_url``, serve it, mint one token of each kind, tear it all down.
    ``payloads`` is a payload store, or a callable making one of the opened store (a ``BlobDir``
    signs with a key the store keeps: see :func:`local_blobs`)."""
    from dreamlake.lakeshore.server.app import create_app

    store = open_store(store_url)
    if store.kind == "postgresql":
        from tests.contract.conftest import _truncate_all

        _truncate_all(store)
    if callable(payloads):
        payloads = payloads(store)
    app = create_app(store, fanout=fanout, payloads=payloads, config=config or ServerConfig())
    server = ServerThread(app)
    server.start()
    cp = ControlPlane(
        url=server.url,
        store=store,
        admin_token=store.create_token("admin", "test-admin"),
        daemon_token=store.create_token("daemon", "test-daemon"),
        # the tests' producer is trusted with scripts (tests/security checks one that is not)
        producer_token=store.create_token("producer", "test-producer", may_script=True),
        app=app,
    )
    try:
        yield cp
    finally:
        cp.close()
        server.stop()
        store.close()


def local_blobs(root: Path, **config: Any) -> Any:
    """A ``running_control_plane(payloads=...)`` factory: the blob directory ``root`` (no bucket),
    with ``PayloadConfig`` fields ``config`` (e.g. ``max_payload_bytes``, ``presign_ttl_s``)."""
    from dreamlake.lakeshore.server.blobdir import KEY_NAME, BlobDir
    from dreamlake.lakeshore.server.payloads import PayloadConfig

    return lambda store: BlobDir(root, PayloadConfig(**config), store.server_key(KEY_NAME))


@pytest.fixture(scope="session")
def _pg_url() -> Iterator[str]:
    from tests.contract.conftest import pg_database

    with pg_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "lakeshore.db")
    return str(request.getfixturevalue("_pg_url"))


@pytest.fixture
def control_plane(store_url: str) -> Iterator[ControlPlane]:
    """A control plane over HTTP; lease expiry checked every 0.2 s so lease tests stay short."""
    config = ServerConfig(expire_every_s=0.2, recheck_s=0.5)
    with running_control_plane(store_url, config=config) as cp:
        yield cp


@pytest.fixture
def sqlite_control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """SQLite only, for tests about the HTTP surface rather than the store."""
    with running_control_plane(str(tmp_path / "lakeshore.db")) as cp:
        yield cp
