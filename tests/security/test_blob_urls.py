"""Attacks on the local blob directory (``PUT`` / ``GET /v1/blobs/<key>``), made against the README
stack: ``lakeshore server`` on SQLite with no bucket, which keeps payloads in ``blobs/`` next to
its store and serves them behind URLs it signs itself.

The blob routes take no token (the URL's signature is the credential, as with S3), so every test
here is the attacker without one, or with a URL minted for something else; each asserts the
status, that the answer says why, and that the victim's blob is unchanged.
"""

from __future__ import annotations

import hashlib
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import pytest

from dreamlake.lakeshore import blobs
from dreamlake.lakeshore.client import PlaneClient
from tests.integration.conftest import local_blobs, running_control_plane
from tests.security.conftest import Stack

NS = "team-a"
SECRET = b"the victim's payload " * 20_000  # ~400 KiB: over the inline threshold


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("blobs") / "data").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def victim(stack: Stack) -> Iterator[tuple[PlaneClient, dict[str, object]]]:
    client = PlaneClient(stack.url, stack.token("namespace", "victim", "--namespace", NS))
    ref = blobs.put(client, NS, SECRET, job_id="victim-job")
    yield client, ref
    client.close()


def _presign(client: PlaneClient, body: dict[str, object]) -> dict[str, str]:
    out = client.request("POST", blobs.presign_route(NS), body, as_json=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def _unchanged(stack: Stack, ref: dict[str, object]) -> None:
    path = stack.data_dir / "blobs" / str(ref["key"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"]


def test_the_embedded_stack_keeps_blobs_privately_beside_its_store(
    stack: Stack, victim: tuple[PlaneClient, dict[str, object]]
) -> None:
    client, ref = victim
    assert ref["bucket"] == "local"
    root = stack.data_dir / "blobs"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / str(ref["key"])).stat().st_mode) == 0o600
    got = blobs.get(client, NS, ref)  # type: ignore[arg-type]
    assert got is not None and bytes(got) == SECRET


def test_no_token_no_presign(stack: Stack) -> None:
    status, out = stack.json("POST", f"/v1/namespaces/{NS}/payloads/presign", {"op": "put", "size": 1}, None)
    assert status == 401 and out["error"]


def test_a_url_without_a_signature_or_with_a_forged_one_is_refused(
    stack: Stack, victim: tuple[PlaneClient, dict[str, object]]
) -> None:
    _, ref = victim
    bare = f"{stack.url}/v1/blobs/{ref['key']}"
    r = httpx.get(bare)
    assert r.status_code == 403 and "presign" in r.json()["error"]
    r = httpx.get(bare + "?" + urlencode({"expires": "99999999999", "sig": "0" * 64}))
    assert r.status_code == 403 and "signature" in r.json()["error"]
    r = httpx.put(
        bare + "?" + urlencode({"expires": "99999999999", "size": "3", "sig": "0" * 64}), content=b"bad"
    )
    assert r.status_code == 403
    _unchanged(stack, ref)


def test_a_signed_url_opens_only_the_key_and_method_it_was_signed_for(
    stack: Stack, victim: tuple[PlaneClient, dict[str, object]]
) -> None:
    client, ref = victim
    mine = _presign(client, {"op": "put", "size": 3, "jobId": "attacker"})
    parts = urlsplit(mine["url"])
    # the attacker's own PUT URL, aimed at the victim's key: the key is under the signature
    r = httpx.put(f"{stack.url}/v1/blobs/{ref['key']}?{parts.query}", content=b"bad")
    assert r.status_code == 403 and "signature" in r.json()["error"]
    # a GET URL of the victim's key does not upload
    get = _presign(client, {"op": "get", "key": str(ref["key"])})
    r = httpx.put(get["url"], content=b"bad")
    assert r.status_code == 403
    # nor does changing the signed size or the expiry
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    for field, value in (("size", "4"), ("expires", str(int(query["expires"]) + 3600))):
        forged = {**query, field: value}
        r = httpx.put(f"{stack.url}{parts.path}?{urlencode(forged)}", content=b"bad!"[: int(forged["size"])])
        assert r.status_code == 403, field
    _unchanged(stack, ref)


def test_an_upload_must_carry_exactly_the_signed_size(
    stack: Stack, victim: tuple[PlaneClient, dict[str, object]]
) -> None:
    client, _ = victim
    put = _presign(client, {"op": "put", "size": 10, "jobId": "sized"})
    r = httpx.put(put["url"], content=b"x" * 11)
    assert r.status_code == 403 and "presigned size 10" in r.json()["error"]
    r = httpx.put(put["url"], content=iter([b"x" * 10]))  # chunked: no Content-Length
    assert r.status_code == 411 and "Content-Length: 10" in r.json()["error"]
    blob = stack.data_dir / "blobs" / put["key"]
    assert not blob.exists()
    assert httpx.put(put["url"], content=b"x" * 10).status_code == 200 and blob.read_bytes() == b"x" * 10


def test_a_key_cannot_walk_out_of_the_payload_prefix(stack: Stack) -> None:
    for key in ["../lakeshore.db", "payloads/../../tokens.json", "exec/2026/01/01/x/out", "payloads/a//b"]:
        r = _raw_get(stack, f"/v1/blobs/{key}?expires=99999999999&sig=00")
        head, _, body = r.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), (key, r[:300])
        assert body.startswith(b'{"error":'), body[:200]  # an explanation, never a file
    status, out = stack.json(
        "POST",
        f"/v1/namespaces/{NS}/payloads/presign",
        {"op": "get", "key": "payloads/../tokens.json"},
        stack.token("namespace", "walker", "--namespace", NS),
    )
    assert status == 400 and "'..'" in out["error"]


def _raw_get(stack: Stack, target: str) -> bytes:
    """A GET with the target sent as written (httpx would normalise the dots away)."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_an_expired_url_is_refused(tmp_path: Path) -> None:
    # the blob goes in under the default TTL (a 1 s PUT URL can expire on a loaded machine before
    # the upload starts); the same store and blob directory then serve with a 1 s TTL
    with running_control_plane(str(tmp_path / "e.db"), payloads=local_blobs(tmp_path / "b")) as cp:
        client = PlaneClient(cp.url, cp.admin_token)
        ref = blobs.put(client, NS, b"short-lived")
        client.close()
    with running_control_plane(
        str(tmp_path / "e.db"), payloads=local_blobs(tmp_path / "b", presign_ttl_s=1)
    ) as cp:
        client = PlaneClient(cp.url, cp.admin_token)
        url = _presign(client, {"op": "get", "key": ref["key"]})["url"]
        deadline = time.monotonic() + 10
        while (r := httpx.get(url)).status_code == 200:
            assert time.monotonic() < deadline, "the URL outlived its TTL"
            time.sleep(0.2)
        assert r.status_code == 403 and "expired" in r.json()["error"]
        client.close()
