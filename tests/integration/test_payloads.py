"""The payload store (seed 003) against a real S3 server that checks signatures (juicefs gateway).

Each test proves something S3 itself enforces on our presigned URLs, or a refusal of ours that
the presign route turns into an HTTP status.
"""

from __future__ import annotations

import hashlib
import re
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.server.payloads import (
    PayloadConfig,
    PayloadCorrupt,
    PayloadError,
    PayloadStore,
    download,
    upload,
    verify_sha256,
)

if TYPE_CHECKING:
    from tests.integration.s3_fixture import S3Service

pytestmark = pytest.mark.s3


@pytest.fixture()
def store(s3_service: S3Service) -> PayloadStore:
    built = PayloadStore.from_env(s3_service.env())
    assert built is not None
    return built


def _put(store: PayloadStore, data: bytes, **kw: object) -> dict[str, str]:
    signed = store.presign_put("ns1", len(data), **kw)  # type: ignore[arg-type]
    upload(signed["url"], data)
    return signed


def test_put_then_get_round_trip_through_presigned_urls(store: PayloadStore, s3_service: S3Service) -> None:
    data = bytes(range(256)) * 1500  # 384000 bytes: above the inline threshold
    put = _put(store, data)
    assert put["bucket"] == s3_service.bucket
    get = store.presign_get(put["key"])
    assert get["key"] == put["key"] and get["bucket"] == s3_service.bucket
    fetched = download(get["url"])
    assert fetched == data
    verify_sha256(fetched, hashlib.sha256(data).hexdigest())


def test_put_with_content_type_requires_that_header(store: PayloadStore) -> None:
    data = b"\x93\x01\x02\x03"
    signed = store.presign_put("ns1", len(data), content_type="application/x-msgpack")
    with pytest.raises(PayloadError) as err:
        upload(signed["url"], data, content_type="text/plain")
    assert err.value.status == 403
    upload(signed["url"], data, content_type="application/x-msgpack")
    assert download(store.presign_get(signed["key"])["url"]) == data


def test_tampered_signature_is_rejected(store: PayloadStore) -> None:
    put = _put(store, b"secret bytes")
    url = store.presign_get(put["key"])["url"]
    sig = parse_qs(urlsplit(url).query)["X-Amz-Signature"][0]
    forged = url.replace(sig, ("0" if sig[0] != "0" else "1") + sig[1:])
    with pytest.raises(PayloadError) as err:
        download(forged)
    assert err.value.status == 403
    assert "SignatureDoesNotMatch" in str(err.value)


def test_tampered_key_is_rejected(store: PayloadStore) -> None:
    first = _put(store, b"one")
    other = _put(store, b"two")
    url = store.presign_get(first["key"])["url"]
    with pytest.raises(PayloadError) as err:
        download(url.replace(first["key"], other["key"]))
    assert err.value.status == 403


def test_expired_url_is_rejected(store: PayloadStore, s3_service: S3Service) -> None:
    put = _put(store, b"short-lived")
    short = PayloadStore.from_env(s3_service.env(PAYLOAD_PRESIGN_TTL_S="1"))
    assert short is not None
    url = short.presign_get(put["key"])["url"]
    assert parse_qs(urlsplit(url).query)["X-Amz-Expires"] == ["1"]
    time.sleep(2.2)
    with pytest.raises(PayloadError) as err:
        download(url)
    assert err.value.status == 403
    assert "expired" in str(err.value).lower()


def test_upload_larger_or_smaller_than_signed_content_length_is_rejected(store: PayloadStore) -> None:
    signed = store.presign_put("ns1", 10)
    assert "content-length" in parse_qs(urlsplit(signed["url"]).query)["X-Amz-SignedHeaders"][0]
    for wrong in (b"x" * 11, b"x" * 10_000, b"x" * 9):
        with pytest.raises(PayloadError) as err:
            upload(signed["url"], wrong)
        assert err.value.status == 403
    with pytest.raises(PayloadError) as err:
        download(store.presign_get(signed["key"])["url"])
    assert err.value.status == 404  # nothing was stored by the refused uploads
    upload(signed["url"], b"x" * 10)


def test_url_signed_with_a_wrong_secret_is_rejected(s3_service: S3Service) -> None:
    forged = PayloadStore(
        PayloadConfig.from_env(s3_service.env(LAKESHORE_S3_SECRET_KEY="not-the-secret"))
    ).presign_put("ns1", 3)
    with pytest.raises(PayloadError) as err:
        upload(forged["url"], b"abc")
    assert err.value.status == 403


def test_key_scheme_and_expires_at(store: PayloadStore) -> None:
    job = ids.new_ulid()
    before = datetime.now(UTC).replace(microsecond=0)
    signed = store.presign_put("ns1", 5, job_id=job, kind="result")
    today = datetime.now(UTC)
    assert signed["key"] == f"payloads/ns1/{today:%Y}/{today:%m}/{today:%d}/{job}/result"
    expires = datetime.strptime(signed["expires_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert before + timedelta(seconds=900) <= expires <= before + timedelta(seconds=902)

    minted = store.presign_put("ns1", 5)["key"]
    match = re.fullmatch(r"payloads/ns1/\d{4}/\d{2}/\d{2}/([0-9A-Z]{26})/args", minted)
    assert match is not None and ids.is_ulid(match.group(1))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"job_id": "../../etc"}, "jobId"), ({"job_id": "x" * 129}, "jobId"), ({"job_id": "-x"}, "jobId"),
     ({"job_id": "a b"}, "jobId"), ({"job_id": ""}, "jobId"), ({"kind": "Args"}, "kind"),
     ({"kind": "a/b"}, "kind"), ({"kind": ""}, "kind"), ({"kind": "a" * 33}, "kind")],
)  # fmt: skip
def test_bad_job_id_or_kind_is_400(store: PayloadStore, kw: dict[str, str], needle: str) -> None:
    with pytest.raises(PayloadError) as err:
        store.presign_put("ns1", 5, **kw)
    assert err.value.status == 400
    assert needle in str(err.value)


@pytest.mark.parametrize("job_id", ["x" * 26, "batch-7.part_3", "A" * 128, "0"])
def test_caller_chosen_job_ids_are_accepted(store: PayloadStore, job_id: str) -> None:
    """Seed 003's staged flow uploads before the job row exists, under an id the caller chose."""
    assert store.presign_put("ns1", 5, job_id=job_id)["key"].endswith(f"/{job_id}/args")


def test_size_over_limit_is_413_naming_the_limit(s3_service: S3Service) -> None:
    small = PayloadStore.from_env(s3_service.env(MAX_PAYLOAD_BYTES="1000"))
    assert small is not None
    small.presign_put("ns1", 1000)
    with pytest.raises(PayloadError) as err:
        small.presign_put("ns1", 1001)
    assert err.value.status == 413
    assert "MAX_PAYLOAD_BYTES" in str(err.value) and "1000" in str(err.value)


def test_default_limit_is_100_mib(store: PayloadStore) -> None:
    store.presign_put("ns1", 100 * 1024 * 1024)
    with pytest.raises(PayloadError) as err:
        store.presign_put("ns1", 100 * 1024 * 1024 + 1)
    assert err.value.status == 413


@pytest.mark.parametrize("size", [-1, 1.5, "10", None, True])
def test_bad_size_is_400(store: PayloadStore, size: object) -> None:
    with pytest.raises(PayloadError) as err:
        store.presign_put("ns1", size)  # type: ignore[arg-type]
    assert err.value.status == 400


@pytest.mark.parametrize(
    "key",
    ["exec/2026/01/01/X/out", "payload/x", "/payloads/x", "payloads/../exec/x", "payloads/a//b", "payloads/",
     "payloads/a/./b", "", "payloads/a\\..\\b", "payloads/a\nb"],
)  # fmt: skip
def test_get_outside_payloads_is_refused(store: PayloadStore, key: str) -> None:
    with pytest.raises(PayloadError) as err:
        store.presign_get(key)
    assert err.value.status == 400


def test_sha256_mismatch_message_is_exact() -> None:
    data = b"payload bytes"
    good = hashlib.sha256(data).hexdigest()
    verify_sha256(data, good)
    verify_sha256(data, "sha256:" + good.upper())
    wrong = "0" * 64
    with pytest.raises(PayloadCorrupt) as err:
        verify_sha256(data, wrong)
    assert str(err.value) == f"payload corrupt: sha256 mismatch (expected {wrong}, got {good})"
    with pytest.raises(PayloadError) as bad:
        verify_sha256(data, "not-a-digest")
    assert bad.value.status == 400


def test_unset_bucket_means_inline_only() -> None:
    assert PayloadStore.from_env({}) is None
    assert PayloadStore.from_env({"LAKESHORE_BLOBS_BUCKET": ""}) is None
    assert not PayloadConfig.from_env({}).bucket_configured


def test_config_defaults_and_bad_values() -> None:
    cfg = PayloadConfig.from_env(
        {"LAKESHORE_BLOBS_BUCKET": "b", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    )
    assert (cfg.inline_threshold_bytes, cfg.max_payload_bytes, cfg.presign_ttl_s) == (
        256 * 1024,
        100 * 1024**2,
        900,
    )
    assert (cfg.access_key, cfg.secret_key, cfg.region) == ("a", "s", "us-east-1")
    with pytest.raises(ValueError, match="MAX_PAYLOAD_BYTES"):
        PayloadConfig.from_env({"MAX_PAYLOAD_BYTES": "lots"})
    with pytest.raises(ValueError, match="PAYLOAD_PRESIGN_TTL_S"):
        PayloadConfig.from_env({"PAYLOAD_PRESIGN_TTL_S": "0"})
    with pytest.raises(ValueError, match="half set"):
        PayloadConfig.from_env({"LAKESHORE_S3_ACCESS_KEY": "a"})


def test_a_url_bound_to_its_bytes_refuses_a_replay_with_others(store: PayloadStore) -> None:
    """A presign that names the bytes' digests signs them (x-amz-checksum-sha256, Content-MD5):
    the upload succeeds with those bytes, and a replay of the URL with other bytes of the same
    size is refused by S3 itself; the key keeps the first bytes."""
    data, other = b"a" * 64, b"b" * 64
    signed = store.presign_put(
        "ns1", len(data), sha256=hashlib.sha256(data).hexdigest(), md5=hashlib.md5(data).hexdigest()
    )
    headers = dict(signed["headers"])
    assert set(headers) == {"x-amz-checksum-sha256", "Content-MD5"}
    assert httpx.put(signed["url"], content=data, headers=headers).status_code == 200
    assert httpx.put(signed["url"], content=other, headers=headers).status_code in (400, 403)
    assert httpx.put(signed["url"], content=other).status_code in (400, 403)  # headers are signed
    assert download(store.presign_get(signed["key"])["url"]) == data
