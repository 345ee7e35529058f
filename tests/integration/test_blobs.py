"""The blob layer on the real stack: ``dreamlake.lakeshore.blobs`` through the presign route, onto
both tiers of the payload store (a signature-checking S3, the juicefs gateway; and the control
plane's own blob directory when no bucket is configured), over real HTTP."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dreamlake.lakeshore import blobs
from dreamlake.lakeshore.client import PlaneClient
from dreamlake.lakeshore.errors import BadRequest, NotFound, PayloadCorrupt
from dreamlake.lakeshore.server.blobdir import BlobDir
from dreamlake.lakeshore.server.payloads import PayloadConfig, PayloadStore
from dreamlake.lakeshore.server.serve import ServeSpec, build_app
from tests.integration.conftest import ControlPlane, local_blobs, running_control_plane
from tests.integration.s3_fixture import S3Service
from tests.stack.wait import until

NS = "team-a"
KiB, MiB = 1024, 1024 * 1024


class Tier:
    """A running control plane over one tier, with a namespace token's client and a way to tamper."""

    def __init__(self, name: str, cp: ControlPlane, tamper: Any) -> None:
        self.name = name
        self.cp = cp
        self.client = PlaneClient(cp.url, cp.store.create_token("namespace", "ns", NS), attempts=3)
        self.tamper = tamper  # (key, new bytes) -> None: rewrite the stored object behind the plane's back

    def close(self) -> None:
        self.client.close()


@pytest.fixture(params=["local", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "local":
        root = tmp_path / "blobs"
        with running_control_plane(str(tmp_path / "l.db"), payloads=local_blobs(root)) as cp:

            def tamper(key: str, data: bytes) -> None:
                (root / key).write_bytes(data)

            t = Tier("local", cp, tamper)
            yield t
            t.close()
        return
    s3: S3Service = request.getfixturevalue("s3_service")
    store = PayloadStore(PayloadConfig.from_env(s3.env()))
    with running_control_plane(str(tmp_path / "s.db"), payloads=store) as cp:

        def tamper_s3(key: str, data: bytes) -> None:
            s3.client().put_object(Bucket=s3.bucket, Key=key, Body=data)

        t = Tier("s3", cp, tamper_s3)
        yield t
        t.close()


@pytest.mark.parametrize("size", [1 * KiB, 300 * KiB, 20 * MiB])
def test_put_then_get_round_trips_with_its_sha256(tier: Tier, size: int) -> None:
    data = os.urandom(size)
    ref = blobs.put(tier.client, NS, data, kind="args")
    assert set(ref) == {"bucket", "key", "size", "sha256"}
    assert ref["size"] == size and ref["sha256"] == hashlib.sha256(data).hexdigest()
    assert ref["key"].startswith("payloads/") and ref["key"].endswith("/args")
    assert ref["bucket"] == ("local" if tier.name == "local" else "lakeshore-test")
    got = blobs.get(tier.client, NS, ref)
    assert got is not None and bytes(got) == data


def test_every_source_shape_streams(tier: Tier, tmp_path: Path) -> None:
    data = os.urandom(3 * MiB + 17)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    with path.open("rb") as f:
        from_file = blobs.put(tier.client, NS, f)
    chunks = [data[i : i + 100_000] for i in range(0, len(data), 100_000)]
    refs = [
        blobs.put(tier.client, NS, path),
        from_file,
        blobs.put(tier.client, NS, io.BytesIO(data)),
        blobs.put(tier.client, NS, iter(chunks), size=len(data)),
        blobs.put(tier.client, NS, memoryview(bytearray(data))),
    ]
    assert {r["sha256"] for r in refs} == {hashlib.sha256(data).hexdigest()}
    for ref in refs:
        out = tmp_path / "out.bin"
        assert blobs.get(tier.client, NS, ref, into=out) is None
        assert out.read_bytes() == data
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="size="):
        blobs.put(tier.client, NS, iter(chunks))
    with pytest.raises(ValueError, match="ended after"):
        blobs.put(tier.client, NS, iter(chunks[:-1]), size=len(data))


def test_a_tampered_blob_is_refused_with_the_seed_message(tier: Tier, tmp_path: Path) -> None:
    data = b"honest bytes " * 30_000
    ref = blobs.put(tier.client, NS, data)
    forged = b"forged bytes " * 30_000
    tier.tamper(ref["key"], forged)
    want = f"payload corrupt: sha256 mismatch (expected {ref['sha256']}, got {hashlib.sha256(forged).hexdigest()})"
    with pytest.raises(PayloadCorrupt) as err:
        blobs.get(tier.client, NS, ref)
    assert str(err.value) == want
    out = tmp_path / "args.msgpack"
    with pytest.raises(PayloadCorrupt):
        blobs.get(tier.client, NS, ref, into=out)
    assert not out.exists() and not (tmp_path / "args.msgpack.part").exists()  # nothing half-trusted left
    tier.tamper(ref["key"], data[:-1])  # a short object is refused too, even without a sha256
    with pytest.raises(PayloadCorrupt, match="of its"):
        blobs.get(tier.client, NS, {k: v for k, v in ref.items() if k != "sha256"})


def test_caller_chosen_job_ids_name_the_key(tier: Tier) -> None:
    ref = blobs.put(tier.client, NS, b"x" * 10, job_id="batch-7.part_3", kind="result")
    assert ref["key"].endswith("/batch-7.part_3/result")
    for bad in ["../../etc", "a/b", "-lead", "x" * 129, "a b", ""]:
        with pytest.raises(BadRequest, match="jobId"):
            blobs.put(tier.client, NS, b"x", job_id=bad)
    with pytest.raises(BadRequest, match="kind"):
        blobs.put(tier.client, NS, b"x", kind="Args")


def test_a_missing_blob_is_not_found(tier: Tier) -> None:
    ref = {"bucket": "b", "key": "payloads/2026/01/01/nothing/args", "size": 3, "sha256": "0" * 64}
    with pytest.raises(NotFound):
        blobs.get(tier.client, NS, ref)


def test_the_size_cap_holds_at_presign(tmp_path: Path) -> None:
    with running_control_plane(
        str(tmp_path / "c.db"), payloads=local_blobs(tmp_path / "b", max_payload_bytes=1000)
    ) as cp:
        client = PlaneClient(cp.url, cp.admin_token)
        with pytest.raises(BadRequest) as err:
            blobs.put(client, NS, b"x" * 1001)
        assert err.value.status == 413 and "MAX_PAYLOAD_BYTES (1000 bytes)" in str(err.value)
        with pytest.raises(BadRequest, match="over this reader's limit"):
            blobs.get(client, NS, {"bucket": "local", "key": "payloads/a/b", "size": 10}, limit=5)
        client.close()


def test_the_blob_directory_is_private_and_atomic(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    with running_control_plane(str(tmp_path / "c.db"), payloads=local_blobs(root)) as cp:
        client = PlaneClient(cp.url, cp.admin_token)
        ref = blobs.put(client, NS, os.urandom(400 * KiB))
        path = root / ref["key"]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for parent in [root, *[p for p in path.parents if root in p.parents]]:
            assert stat.S_IMODE(parent.stat().st_mode) == 0o700, parent
        # an upload cut short leaves nothing behind: no blob, no temp file
        answer = client.request(
            "POST", blobs.presign_route(NS), {"op": "put", "size": 1000, "jobId": "cut"}, as_json=True
        )
        url = httpx.URL(answer["url"])
        with socket.create_connection((url.host, url.port)) as sock:
            target = url.raw_path.decode()
            sock.sendall(f"PUT {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n".encode())
            sock.sendall(b"x" * 400)
            until(lambda: any((root / ".tmp").iterdir()), "the upload's temp file", 20.0)  # under way
        until(lambda: not any((root / ".tmp").iterdir()), "the temp file to go", 20.0)  # once the client left
        assert not (root / answer["key"]).exists()
        client.close()


def test_prune_drops_blobs_past_their_retention(tmp_path: Path) -> None:
    blob_dir = BlobDir(tmp_path / "b", PayloadConfig(), b"k" * 32, retention_s=60)
    old, new = blob_dir.path("payloads/2026/01/01/a/args"), blob_dir.path("payloads/2026/01/02/b/args")
    for p in (old, new):
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x")
    os.utime(old, (1.0, 1.0))
    assert blob_dir.prune() == 1
    assert not old.exists() and not old.parent.exists() and new.exists()


def test_the_embedded_server_keeps_blobs_next_to_its_sqlite_file(tmp_path: Path) -> None:
    """``lakeshore server`` without a bucket: build_app picks the blob directory beside the store."""
    from dreamlake.lakeshore.store import open_store

    env_keep = {k: os.environ.pop(k) for k in list(os.environ) if k == "LAKESHORE_BLOBS_BUCKET"}
    store = open_store(str(tmp_path / "lakeshore.db"))
    try:
        app = build_app(ServeSpec(db=str(tmp_path / "lakeshore.db")), store)
        payloads = app.state.ctx.payloads
        assert isinstance(payloads, BlobDir) and payloads.root == tmp_path / "blobs"
        assert stat.S_IMODE((tmp_path / "blobs").stat().st_mode) == 0o700
        memory = open_store(":memory:")
        assert build_app(ServeSpec(db=":memory:"), memory).state.ctx.payloads is None
        memory.close()
    finally:
        store.close()
        os.environ.update(env_keep)


def test_an_s3_plane_serves_no_blob_route(tmp_path: Path, s3_service: S3Service) -> None:
    store = PayloadStore(PayloadConfig.from_env(s3_service.env()))
    with running_control_plane(str(tmp_path / "s.db"), payloads=store) as cp:
        r = httpx.get(f"{cp.url}/v1/blobs/payloads/2026/01/01/x/args?expires=9999999999&sig=00")
        assert r.status_code == 404 and "S3 bucket" in r.json()["error"]


def test_a_presigned_get_works_without_the_token_and_only_as_signed(tier: Tier) -> None:
    ref = blobs.put(tier.client, NS, b"abc" * 1000)
    answer = tier.client.request(
        "POST", blobs.presign_route(NS), {"op": "get", "key": ref["key"]}, as_json=True
    )
    assert httpx.get(answer["url"]).content == b"abc" * 1000
    broken = answer["url"].replace("sig=", "sig=0").replace("Signature=", "Signature=0")
    assert httpx.get(broken).status_code == 403
