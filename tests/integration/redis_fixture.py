"""Real redis-server instances for tests, on free loopback ports, persisting nothing.

``redis_url`` (session scope): ``LAKESHORE_TEST_REDIS_URL`` when CI set it, else a redis-server
this fixture starts. ``private_redis`` (per test): always a server of the test's own, which the
test may kill (:meth:`RedisServer.kill`) to prove that a Redis failure is survived.
Both skip when there is no redis-server binary (a failure in CI).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import require
from tests.stack.ports import free_port

_START_TIMEOUT_S = 10.0


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """A redis-server process this test session started."""

    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """Kill the server at once (SIGKILL) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@contextlib.contextmanager
def start_redis(binary: str) -> Iterator[RedisServer]:
    """Start redis-server on a free loopback port in a temp dir; stop it afterwards."""
    with tempfile.TemporaryDirectory(prefix="lakeshore-redis-") as tmp:
        for _attempt in range(3):
            port = free_port()
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", tmp, "--daemonize", "no", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            deadline = time.monotonic() + _START_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline and not _ping(port):
                time.sleep(0.05)
            if proc.poll() is None and _ping(port):
                server = RedisServer(proc, port)
                try:
                    yield server
                finally:
                    if proc.poll() is None:
                        proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        server.kill()
                return
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        raise RuntimeError("redis-server did not start on a free port after 3 tries")


def redis_binary() -> str | None:
    return shutil.which("redis-server")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis URL: CI's (LAKESHORE_TEST_REDIS_URL) or a redis-server started for this session."""
    url = os.environ.get("LAKESHORE_TEST_REDIS_URL")
    if url:
        yield url
        return
    binary = redis_binary()
    require(binary is not None, "no Redis: set LAKESHORE_TEST_REDIS_URL or apt-get install redis-server")
    assert binary is not None
    with start_redis(binary) as server:
        yield server.url


@pytest.fixture()
def private_redis() -> Iterator[RedisServer]:
    """A redis-server owned by one test, which it may kill."""
    binary = redis_binary()
    require(binary is not None, "no redis-server binary: apt-get install redis-server")
    assert binary is not None
    with start_redis(binary) as server:
        yield server
