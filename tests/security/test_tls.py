"""TLS end to end: ``lakeshore server --tls-cert/--tls-key`` with a self-signed certificate made
here, nymph and the SDK trusting it through ``--ca-file`` / ``LAKESHORE_CA_FILE``, one call run
from submit to result; a client without the CA refuses the server with a message that says what to
pass; a server listening beyond loopback without TLS warns at start."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dreamlake.lakeshore.client import PlaneClient
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.errors import BadRequest
from tests import nymph_fns
from tests.security.conftest import ROOT, Stack
from tests.security.nymph_stack import RootNymph, nymph_args, readable_runtime, require_root, task_user  # noqa: F401


def _self_signed(where: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lakeshore-test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = where / "server.crt", where / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    os.chmod(key_path, 0o600)
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    base = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(base)
    os.chmod(base, 0o755)  # the task user's nymph-spawned entry never reads it; nymph (root) does
    s = Stack(base / "data", ca_file=cert, LAKESHORE_TLS_CERT=cert, LAKESHORE_TLS_KEY=key)
    s.start()
    try:
        yield s, cert
    finally:
        s.stop()


def test_a_call_runs_end_to_end_over_tls_with_the_ca_file(
    tls_stack: tuple[Stack, str],
    task_user: pwd.struct_passwd,  # noqa: F811
    readable_runtime: tuple[str, list[str]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stack, cert = tls_stack
    assert stack.url.startswith("https://")
    client = PlaneClient(stack.url, stack.admin, ca_file=cert)  # the SDK's client, keep-alive path
    try:
        assert client.request("GET", "/v1/ops/whoami")["kind"] == "admin"
        assert client.request("GET", "/v1/ops/whoami")["kind"] == "admin"  # the connection reused
    finally:
        client.close()

    producer = stack.token("producer", "tls-producer", "--namespace", "default")
    base = Path(tempfile.mkdtemp(prefix="nymph-tls-"))  # under /tmp: the task users reach its workdir
    os.chmod(base, 0o711)

    class _Plane:
        url, daemon_token = stack.url, stack.daemon

    env = {k: v for k, v in os.environ.items() if not k.startswith("NYMPH_") and k != "LAKESHORE_CA_FILE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "runners")])
    nymph = RootNymph(base, nymph_args(_Plane, base, readable_runtime, "--queue", "nymph", "--ca-file", cert))  # type: ignore[arg-type]
    nymph.start(env)
    try:
        monkeypatch.setenv("LAKESHORE_CA_FILE", cert)  # the SDK's way to the CA
        plane = HttpDispatch(stack.url, producer)
        inv = nymph_fns.add.submit(2, 3, _dispatch=plane)
        assert inv.result(timeout=60) == 5, nymph.output()[-3000:]
    finally:
        nymph.stop()
        log = nymph.output()
        shutil.rmtree(base, ignore_errors=True)
    assert "CERTIFICATE_VERIFY_FAILED" not in log


def _http_client_packages(into: Path) -> str:
    """A directory the task user reads holding the SDK's HTTP client packages (pure Python, copied
    from this interpreter's): a task that submits needs them, the entry bundle does not carry them."""
    import importlib.util

    into.mkdir(mode=0o755)
    names = (
        "httpx",
        "httpcore",
        "h11",
        "anyio",
        "sniffio",
        "idna",
        "certifi",
        "tenacity",
        "typing_extensions",
    )
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        if origin.name == "__init__.py":
            shutil.copytree(origin.parent, into / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(origin, into / origin.name)
    for path in [into, *into.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return str(into)


def test_a_task_trusts_the_control_planes_ca_without_being_told(
    tls_stack: tuple[Stack, str],
    task_user: pwd.struct_passwd,  # noqa: F811
    readable_runtime: tuple[str, list[str]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nymph got ``--ca-file`` at a path only root reads; a task running as a pool user submits a
    nested call over HTTPS with nothing but what nymph handed it: the CA copied into its workdir,
    0400 and its own (nymph/tasktls.py), named by LAKESHORE_CA_FILE."""
    stack, cert = tls_stack
    producer = stack.token("producer", "tls-nested", "--namespace", "default")
    base = Path(tempfile.mkdtemp(prefix="nymph-tls-task-"))
    os.chmod(base, 0o711)
    private = base / "pki"
    private.mkdir(mode=0o700)  # root's: no task user reads nymph's own copy
    ca = private / "ca.pem"
    shutil.copyfile(cert, ca)
    os.chmod(ca, 0o600)

    python, pythonpath = readable_runtime
    runtime = (python, [*pythonpath, _http_client_packages(base / "site")])

    class _Plane:
        url, daemon_token = stack.url, stack.daemon

    env = {k: v for k, v in os.environ.items() if not k.startswith("NYMPH_") and k != "LAKESHORE_CA_FILE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "runners")])
    extra = ("--queue", "nymph", "--concurrency", "2", "--ca-file", str(ca))
    args = nymph_args(_Plane, base, runtime, *extra)  # type: ignore[arg-type]
    nymph = RootNymph(base, args)
    nymph.start(env)
    try:
        monkeypatch.setenv("LAKESHORE_CA_FILE", cert)  # the producer's own trust, outside the task
        plane = HttpDispatch(stack.url, producer)
        out = nymph_fns.add_nested.submit(2, 3, _dispatch=plane).result(timeout=90)
        assert out["sum"] == 5, nymph.output()[-3000:]
        assert out["ca_file"].endswith("/tls-ca.pem") and out["ca_file"] != str(ca)
        assert out["ca_mode"] == 0o400
    finally:
        nymph.stop()
        log = nymph.output()
        shutil.rmtree(base, ignore_errors=True)
    assert "CERTIFICATE_VERIFY_FAILED" not in log


def test_without_the_ca_file_a_client_refuses_the_server_and_says_what_to_do(
    tls_stack: tuple[Stack, str],
) -> None:
    stack, _ = tls_stack
    env = {k: v for k, v in os.environ.items() if k != "LAKESHORE_CA_FILE"}
    assert "LAKESHORE_CA_FILE" not in os.environ
    client = PlaneClient(stack.url, stack.admin)
    try:
        with pytest.raises(BadRequest) as err:
            client.request("GET", "/v1/ops/whoami")
    finally:
        client.close()
    assert "--ca-file" in str(err.value) and "LAKESHORE_CA_FILE" in str(err.value)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dreamlake.lakeshore.cli",
            "queues",
            "--url",
            stack.url,
            "--token",
            stack.admin,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode != 0 and "--ca-file" in out.stderr, out.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "dreamlake.lakeshore.cli", "queues", "--url", stack.url, "--token", stack.admin,
         "--ca-file", str(stack.ca_file)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr


def test_plain_http_beyond_loopback_warns_at_start(tmp_path: Path) -> None:
    s = Stack(tmp_path / "data", LAKESHORE_HOST="0.0.0.0")
    s.start()
    try:
        deadline = time.monotonic() + 10
        while "without TLS" not in s.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "listening on 0.0.0.0 without TLS" in s.log.read_text()
    finally:
        s.stop()
    quiet = Stack(tmp_path / "quiet")
    quiet.start()
    quiet.stop()
    assert "without TLS" not in quiet.log.read_text()
