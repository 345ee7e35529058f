"""The security suite's stacks: the real ``lakeshore server`` as a subprocess, and the in-process one.

:class:`Stack` runs ``python -m dreamlake.lakeshore.cli server`` on a fresh data directory and a
free loopback port, exactly as an operator starts it (first start mints the admin and daemon tokens
into ``tokens.json``); further tokens are minted with ``lakeshore token create``. Attacks are
then made over HTTP with httpx, and each test asserts what the attacker sees.

The in-process control plane of ``tests/integration`` (``control_plane``, ``sqlite_control_plane``)
serves the auth-matrix and fuzz tests, which make hundreds of requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from tests.integration.conftest import (  # noqa: F401  (fixtures shared with tests/integration)
    _pg_url,
    control_plane,
    sqlite_control_plane,
    store_url,
)
from tests.stack.ports import free_port
from tests.stack.server import Server

MSGPACK = "application/x-msgpack"
ROOT = Path(__file__).resolve().parents[2]


def lakeshore(*args: str, env: dict[str, str] | None = None) -> str:
    """Run the ``lakeshore`` CLI of this checkout; its stdout (CalledProcessError on failure)."""
    out = subprocess.run(
        [sys.executable, "-m", "dreamlake.lakeshore.cli", *args],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    return out.stdout.strip()


class Stack(Server):
    """``lakeshore server`` (:class:`tests.stack.server.Server`) over ``data_dir``, configured through
    its environment as an operator's unit does (see the module docstring)."""

    def __init__(self, data_dir: Path, *, ca_file: str | None = None, **env: str) -> None:
        """``ca_file``: the server serves HTTPS (``LAKESHORE_TLS_CERT`` / ``_KEY`` in ``env``) with a
        certificate this CA signed; the stack's own requests trust it."""
        environ = {**os.environ, "LAKESHORE_DATA_DIR": str(data_dir), **env}
        environ.pop("LAKESHORE_DB", None)
        port = free_port()
        super().__init__(data_dir, env=environ, log=data_dir.parent / f"server-{port}.log", ca_file=ca_file)
        self.port = port
        self.url = f"{'https' if ca_file else 'http'}://127.0.0.1:{port}"
        self.admin = self.daemon = ""

    def command(self) -> list[str]:  # the data directory comes from LAKESHORE_DATA_DIR
        return [sys.executable, "-m", "dreamlake.lakeshore.cli", "server", "--port", str(self.port)]

    def start(self, limit_s: float = 60.0) -> Stack:
        super().start(limit_s)
        tokens = self.tokens()
        self.admin, self.daemon = tokens["admin"], tokens["daemon"]
        return self

    def token(self, kind: str, name: str, *flags: str) -> str:
        """Mint a token with ``lakeshore token create`` (the operator's way)."""
        return lakeshore("token", "create", "--kind", kind, "--name", name, *flags, env=self.env)

    def call(self, path: str, body: Any, token: str | None, *, method: str = "POST") -> tuple[int, Any]:
        """A msgpack request; (status, decoded answer)."""
        headers = {"Content-Type": MSGPACK, **({"Authorization": f"Bearer {token}"} if token else {})}
        content = None if method == "GET" else msgpack.packb(body, use_bin_type=True)
        r = httpx.request(
            method, self.url + path, content=content, headers=headers, timeout=30, verify=self.verify
        )
        return r.status_code, msgpack.unpackb(r.content, raw=False) if r.content else None

    def json(self, method: str, path: str, body: Any, token: str | None) -> tuple[int, Any]:
        """A JSON request; (status, decoded answer)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.request(method, self.url + path, json=body, headers=headers, timeout=30, verify=self.verify)
        return r.status_code, r.json() if r.content else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The README stack: ``lakeshore server`` on SQLite in a fresh data directory."""
    s = Stack(tmp_path_factory.mktemp("stack") / "data").start()
    try:
        yield s
    finally:
        s.stop()
