"""The security suite's stacks: the real ``lakeshore server`` as a subprocess, and the in-process one.

:class:`Stack` runs ``python -m dreamlake.lakeshore.cli server`` on a fresh data directory and a
free loopback port, exactly as an operator starts it (first start mints the admin and daemon tokens
into ``tokens.json``); further tokens are minted with ``lakeshore token create``. Attacks are
then made over HTTP with httpx, and each test asserts what the attacker sees.

The in-process control plane of ``tests/integration`` (``control_plane``, ``sqlite_control_plane``)
serves the auth-matrix and fuzz tests, which make hundreds of requests.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
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

MSGPACK = "application/x-msgpack"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class Stack:
    """``lakeshore server`` in a subprocess over ``data_dir`` (see the module docstring)."""

    def __init__(self, data_dir: Path, *, ca_file: str | None = None, **env: str) -> None:
        """``ca_file``: the server serves HTTPS (``LAKESHORE_TLS_CERT`` / ``_KEY`` in ``env``) with a
        certificate this CA signed; the stack's own requests trust it."""
        self.data_dir = data_dir
        self.port = _free_port()
        self.url = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        self.ca_file = ca_file
        self.verify: Any = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.env = {**os.environ, "LAKESHORE_DATA_DIR": str(data_dir), **env}
        self.env.pop("LAKESHORE_DB", None)
        self.log = data_dir.parent / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin = self.daemon = ""

    def start(self) -> Stack:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dreamlake.lakeshore.cli", "server", "--port", str(self.port)],
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=2, verify=self.verify).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lakeshore server did not start:\n{self.log.read_text()}")
            time.sleep(0.1)
        tokens = json.loads((self.data_dir / "tokens.json").read_text())
        self.admin, self.daemon = tokens["admin"], tokens["daemon"]
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

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
