"""The payload store (seed 003): presigned S3 URLs for payloads too big to ride inline.

Bytes never pass through the control plane. It mints short-lived presigned URLs
(:class:`PayloadStore`, boto3, any S3-compatible endpoint) and clients move the bytes
themselves (:func:`upload`, :func:`download`, httpx).

Keys are minted by the server, never chosen by the caller, and carry the namespace the presign
was made in (seed 003's follow-up, per-namespace prefixing)::

    payloads/<namespace>/<YYYY>/<MM>/<DD>/<job_id or a new ULID>/<kind>

A presign ``get`` (and a ref a submit or exec names) must lie under its own namespace's prefix
(:func:`check_key_in`): a caller of namespace B can neither read nor point a job at A's payloads,
and the same ``jobId`` in two namespaces names two keys. Keys minted before the prefix
(``payloads/<YYYY>/...``, six segments) are read only by callers bound to no namespace (an admin,
an unbound nymph) so work queued before an upgrade still runs.

Configuration (:meth:`PayloadConfig.from_env`, given an explicit mapping, read once):

=========================== ====================================================== ===========
variable                    meaning                                                default
=========================== ====================================================== ===========
``LAKESHORE_BLOBS_BUCKET``  the bucket; unset -> no S3 tier, inline bytes only     unset
``LAKESHORE_S3_ENDPOINT``   S3-compatible endpoint URL (path-style addressing)     AWS
``LAKESHORE_S3_REGION``     signing region (else ``AWS_REGION`` /                  us-east-1
                            ``AWS_DEFAULT_REGION``)
``LAKESHORE_S3_ACCESS_KEY`` access key (else ``AWS_ACCESS_KEY_ID``; else boto3's   unset
                            own credential chain)
``LAKESHORE_S3_SECRET_KEY`` secret key (else ``AWS_SECRET_ACCESS_KEY``)            unset
``INLINE_THRESHOLD_BYTES``  payloads above this go to S3                           256 KiB
``MAX_PAYLOAD_BYTES``       presigning a larger PUT answers 413                    100 MiB
``PAYLOAD_PRESIGN_TTL_S``   lifetime of a presigned URL, seconds                   900
=========================== ====================================================== ===========

A presigned PUT signs ``Content-Length``: the upload must carry exactly the size that was
presigned, so S3 itself refuses an oversized (or undersized) body. When a ``content_type`` is
presigned, the upload must send that ``Content-Type`` too. A presign may name the bytes' ``sha256``
(hex) and ``md5`` (hex): they are signed into the URL (``x-amz-checksum-sha256`` and
``Content-MD5``, which the answer's ``headers`` lists for the upload to send), so the store refuses
a replay of the URL with other bytes (S3 checks both; MinIO-based gateways check ``Content-MD5``).
The SDK sends both whenever it can read its source twice.

``expires_at`` in a presign answer is an ISO-8601 UTC timestamp with second precision and a
``Z`` suffix (``2026-01-31T12:00:00Z``); the URL stops working at or slightly after it.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from dreamlake.lakeshore import envvars, ids
from dreamlake.lakeshore.errors import LakeshoreError
from dreamlake.lakeshore.store.exec_jobs import ARCHIVE_KEY_RE

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB

DEFAULT_INLINE_THRESHOLD_BYTES = envvars.DEFAULT_INLINE_THRESHOLD_BYTES  # seed 003: 256 KiB, one definition
DEFAULT_MAX_PAYLOAD_BYTES = envvars.DEFAULT_MAX_PAYLOAD_BYTES  # one definition (nymph knows it too)
DEFAULT_PRESIGN_TTL_S = 900
DEFAULT_REGION = "us-east-1"
DEFAULT_FETCH_TIMEOUT_S = 60.0

PREFIX = "payloads/"
#: A ``jobId`` a caller may choose (seed 003's staged flow uploads before the job row exists):
#: 1-128 characters of ``A-Za-z0-9._-``, starting with a letter or digit, so it is one safe key
#: segment (never ``.``, ``..`` or empty). ULIDs qualify; so do ids such as ``batch-7.part-3``.
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KIND_RE = re.compile(r"^[a-z0-9_-]{1,32}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_MD5_RE = re.compile(r"^[0-9a-f]{32}$")
_LEGACY_SEGMENTS = 6  # payloads/<YYYY>/<MM>/<DD>/<job_id>/<kind>: a key minted before namespaces
_MAX_KEY_LEN = 1024


class PayloadError(LakeshoreError):
    """A payload request that cannot be served; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PayloadCorrupt(PayloadError):
    """Downloaded bytes whose sha256 differs from the one the payloadRef promised."""

    def __init__(self, expected: str, got: str) -> None:
        super().__init__(422, f"payload corrupt: sha256 mismatch (expected {expected}, got {got})")
        self.expected = expected
        self.got = got


@dataclass(frozen=True)
class PayloadConfig:
    """Where payloads live and the limits on them. See the module docstring for the variables."""

    bucket: str | None = None
    endpoint: str | None = None
    region: str = DEFAULT_REGION
    access_key: str | None = None
    secret_key: str | None = None
    session_token: str | None = None
    inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    presign_ttl_s: int = DEFAULT_PRESIGN_TTL_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PayloadConfig:
        """Resolve the configuration from ``env`` (default ``os.environ``; envvars.py reads it)."""
        access = envvars.string("LAKESHORE_S3_ACCESS_KEY", env)  # else AWS_ACCESS_KEY_ID
        secret = envvars.string("LAKESHORE_S3_SECRET_KEY", env)  # else AWS_SECRET_ACCESS_KEY
        if (access is None) != (secret is None):
            raise ValueError(
                "S3 credentials are half set: give both LAKESHORE_S3_ACCESS_KEY and LAKESHORE_S3_SECRET_KEY "
                "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), or neither to use boto3's credential chain"
            )
        return cls(
            bucket=envvars.string("LAKESHORE_BLOBS_BUCKET", env),
            endpoint=envvars.string("LAKESHORE_S3_ENDPOINT", env),
            region=envvars.string("LAKESHORE_S3_REGION", env) or DEFAULT_REGION,  # else AWS_REGION, ...
            access_key=access,
            secret_key=secret,
            session_token=(
                None
                if envvars.source("LAKESHORE_S3_ACCESS_KEY", env) == "LAKESHORE_S3_ACCESS_KEY"
                else envvars.string("AWS_SESSION_TOKEN", env)
            ),
            inline_threshold_bytes=envvars.inline_threshold(env),
            max_payload_bytes=envvars.integer(
                "MAX_PAYLOAD_BYTES", env, default=DEFAULT_MAX_PAYLOAD_BYTES, minimum=1
            ),
            presign_ttl_s=envvars.integer(
                "PAYLOAD_PRESIGN_TTL_S", env, default=DEFAULT_PRESIGN_TTL_S, minimum=1
            ),
        )

    @property
    def bucket_configured(self) -> bool:
        """True when an S3 bucket is configured (seed 003's ``bucketConfigured()``)."""
        return bool(self.bucket)


def bucket_configured(env: Mapping[str, str] | None = None) -> bool:
    """Seed 003's ``bucketConfigured()``: is ``LAKESHORE_BLOBS_BUCKET`` set in ``env``?"""
    return envvars.is_set("LAKESHORE_BLOBS_BUCKET", env)


def _iso_utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_key(key: object) -> str:
    """Return ``key`` if it is a payload key a caller may reference, else raise PayloadError(400).

    The ``payloads/`` prefix is the ownership gate (seed 003); ``..``, empty segments, backslashes
    and control characters are refused so a key cannot walk out of the prefix.
    """
    if not isinstance(key, str) or not key:
        raise PayloadError(400, "payload key must be a non-empty string starting with 'payloads/'")
    shown = repr(key)[:80]
    if not key.startswith(PREFIX):
        raise PayloadError(
            400, f"payload key {shown} is outside 'payloads/': only payload keys can be fetched"
        )
    if len(key) > _MAX_KEY_LEN:
        raise PayloadError(400, f"payload key is {len(key)} characters long; the limit is {_MAX_KEY_LEN}")
    segments = key.split("/")
    if any(seg in ("", ".", "..") for seg in segments) or "\\" in key:
        raise PayloadError(
            400, f"payload key {shown} has an empty, '.' or '..' segment: use a key presign minted"
        )
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in key):
        raise PayloadError(400, f"payload key {shown} contains control characters: use a key presign minted")
    return key


def key_namespace(key: str) -> str | None:
    """The namespace a checked payload key was minted in; None for a key minted before keys
    carried one (six segments)."""
    segments = key.split("/")
    return None if len(segments) <= _LEGACY_SEGMENTS else segments[1]


def check_key_in(key: object, namespace: str, *, legacy: bool = False) -> str:
    """``key`` checked (:func:`check_key`) and under ``payloads/<namespace>/``, else
    PayloadError(404, as for a key that does not exist: another namespace's keys are not
    disclosed). ``legacy``: a key minted before the prefix is accepted too (callers bound to no
    namespace)."""
    key = check_key(key)
    owner = key_namespace(key)
    if owner == namespace or (owner is None and legacy):
        return key
    raise PayloadError(
        404,
        f"no payload {key[:120]!r} in namespace '{namespace}': a namespace reads the payloads "
        f"presigned in it (keys under 'payloads/{namespace}/')",
    )


def check_digests(sha256: object, md5: object) -> tuple[str | None, str | None]:
    """A presign put's optional ``sha256`` and ``md5`` (lower-case hex), else PayloadError(400)."""
    if sha256 is not None and not (isinstance(sha256, str) and _SHA256_RE.match(sha256)):
        raise PayloadError(400, f"invalid sha256 {sha256!r:.80}: expected 64 lower-case hex characters")
    if md5 is not None and not (isinstance(md5, str) and _MD5_RE.match(md5)):
        raise PayloadError(400, f"invalid md5 {md5!r:.60}: expected 32 lower-case hex characters")
    return sha256, md5


class PayloadStore:
    """Mints presigned PUT/GET URLs for one bucket. Presigning is local: it makes no network call."""

    def __init__(self, config: PayloadConfig, client: Any | None = None) -> None:
        if not config.bucket:
            raise ValueError("PayloadStore needs a bucket: set LAKESHORE_BLOBS_BUCKET")
        self.config = config
        self.bucket: str = config.bucket
        self._client = client if client is not None else self._make_client(config)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PayloadStore | None:
        """The store ``env`` configures, or None when ``LAKESHORE_BLOBS_BUCKET`` is unset (inline only)."""
        config = PayloadConfig.from_env(env)
        if not config.bucket_configured:
            return None
        return cls(config)

    @staticmethod
    def _make_client(config: PayloadConfig) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "LAKESHORE_BLOBS_BUCKET is set but boto3 is not installed: pip install 'dreamlake-lakeshore[s3]'"
            ) from exc
        s3_opts = {"addressing_style": "path"} if config.endpoint else {}
        return boto3.client(
            "s3",
            endpoint_url=config.endpoint,
            region_name=config.region,
            aws_access_key_id=config.access_key,
            aws_secret_access_key=config.secret_key,
            aws_session_token=config.session_token,
            config=Config(signature_version="s3v4", s3=s3_opts),
        )

    @property
    def client(self) -> Any:
        """The boto3 S3 client (for operators and tests: bucket creation, listing)."""
        return self._client

    def mint_key(
        self, namespace: str, job_id: str | None = None, kind: str = "args", *, now: datetime | None = None
    ) -> str:
        """``payloads/<namespace>/<YYYY>/<MM>/<DD>/<job_id or a new ULID>/<kind>``, validated."""
        return mint_key(namespace, job_id, kind, now=now)

    def presign_put(
        self,
        namespace: str,
        size: int,
        content_type: str | None = None,
        job_id: str | None = None,
        kind: str = "args",
        *,
        base_url: str = "",
        sha256: str | None = None,
        md5: str | None = None,
    ) -> dict[str, Any]:
        """Presign an upload of exactly ``size`` bytes (and, when given, exactly the bytes of
        ``sha256`` / ``md5``) -> ``{"url", "bucket", "key", "expires_at"[, "headers"]}``.

        Raises PayloadError: 400 for a bad size, jobId, kind, contentType or digest; 413 over the
        limit. ``base_url`` is unused (see :meth:`presign_get`).
        """
        check_put(self.config, size, content_type)
        check_digests(sha256, md5)
        key = self.mint_key(namespace, job_id, kind)
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "ContentLength": size}
        if content_type is not None:
            params["ContentType"] = content_type
        headers: dict[str, str] = {}
        if sha256 is not None:
            params["ChecksumSHA256"] = headers["x-amz-checksum-sha256"] = _b64_hex(sha256)
        if md5 is not None:
            params["ContentMD5"] = headers["Content-MD5"] = _b64_hex(md5)
        answer: dict[str, Any] = dict(self._presign("put_object", params))
        if headers:
            answer["headers"] = headers
        log.info("presigned PUT ns=%s key=%s size=%d", namespace, key, size)
        return answer

    def delete(self, keys: list[str]) -> int:
        """Delete the objects at ``keys`` (the retention sweep's: keys the store knew), one
        ``DeleteObject`` each (S3-compatible servers differ on the checksums a batch delete needs);
        the number deleted. A key that is not a payload key, or that S3 refuses, is logged and
        skipped: a bucket lifecycle rule on ``payloads/`` is the backstop for those."""
        done = 0
        for key in keys:
            try:
                archived = isinstance(key, str) and ARCHIVE_KEY_RE.match(key)  # an exec job's output
                self.client.delete_object(Bucket=self.bucket, Key=key if archived else check_key(key))
                done += 1
            except PayloadError:
                log.warning("retention: not deleting %r, which is not a payload key", str(key)[:200])
            except Exception as exc:  # botocore's errors: one object's failure is that object's
                log.warning("retention: S3 refused to delete %s: %s", key, exc)
        return done

    def presign_get(self, key: str, *, base_url: str = "") -> dict[str, str]:
        """Presign a download of ``key`` (must be under ``payloads/``) -> ``{"url", "bucket", "key", "expires_at"}``.

        ``base_url`` (the control plane's address as the caller reached it) is unused here: an S3
        URL names its own host. The local blob directory (``server.blobdir``) needs it."""
        key = check_key(key)
        return self._presign("get_object", {"Bucket": self.bucket, "Key": key})

    def _presign(self, operation: str, params: dict[str, Any]) -> dict[str, str]:
        ttl = self.config.presign_ttl_s
        # Taken before signing and truncated to seconds, as the signature's X-Amz-Date is:
        # the URL expires at or after this moment, never before.
        signed_at = datetime.now(UTC).replace(microsecond=0)
        url = self._client.generate_presigned_url(operation, Params=params, ExpiresIn=ttl)
        return {
            "url": url,
            "bucket": self.bucket,
            "key": params["Key"],
            "expires_at": _iso_utc(signed_at + timedelta(seconds=ttl)),
        }


def _b64_hex(digest: str) -> str:
    return base64.b64encode(bytes.fromhex(digest)).decode()


def mint_key(
    namespace: str, job_id: str | None = None, kind: str = "args", *, now: datetime | None = None
) -> str:
    """``payloads/<namespace>/<YYYY>/<MM>/<DD>/<job_id or a new ULID>/<kind>`` (seed 003, with its
    per-namespace prefix), validating the parts: ``jobId`` by :data:`JOB_ID_RE`, ``kind`` 1-32
    characters of ``a-z0-9_-``; else PayloadError(400)."""
    if not isinstance(namespace, str) or not JOB_ID_RE.match(namespace):
        raise PayloadError(400, f"invalid namespace {namespace!r:.60} for a payload key")
    if job_id is None:
        job_id = ids.new_ulid()
    elif not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise PayloadError(
            400,
            f"invalid jobId {job_id!r:.60}: expected 1-128 characters of A-Z, a-z, 0-9, '.', '_' or '-', "
            "starting with a letter or digit (a ULID, or an id of your own such as 'batch-7')",
        )
    if not isinstance(kind, str) or not _KIND_RE.match(kind):
        raise PayloadError(
            400,
            f"invalid kind {kind!r:.60}: expected 1-32 characters of a-z, 0-9, '_' or '-' (e.g. 'args')",
        )
    day = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{PREFIX}{namespace}/{day:%Y}/{day:%m}/{day:%d}/{job_id}/{kind}"


def check_put(config: PayloadConfig, size: object, content_type: object) -> None:
    """The checks every presigned PUT passes, whichever tier: PayloadError 400 for a bad ``size`` or
    ``contentType``, 413 over ``MAX_PAYLOAD_BYTES``."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise PayloadError(400, f"size must be an integer number of bytes, got {size!r:.40}")
    if size < 0:
        raise PayloadError(400, f"size must be >= 0 bytes, got {size}")
    limit = config.max_payload_bytes
    if size > limit:
        raise PayloadError(
            413,
            f"payload of {size} bytes is over MAX_PAYLOAD_BYTES ({limit} bytes): "
            "send a smaller payload or raise MAX_PAYLOAD_BYTES on the control plane",
        )
    if content_type is not None and (
        not isinstance(content_type, str)
        or not content_type
        or len(content_type) > 255
        or any(ord(ch) < 0x20 or ord(ch) > 0x7E for ch in content_type)
    ):
        raise PayloadError(400, f"invalid contentType {content_type!r:.60}: expected a printable MIME type")


def check_ref(value: object, what: str) -> dict[str, Any]:
    """A payload ref ``{bucket, key, size, sha256}`` a caller sent (``args_ref``, ``result_ref``, a
    frame's ref) as a plain dict, else PayloadError(400): the key must be a payload key
    (:func:`check_key`) and the sha256 is required, so the reader can check what it fetched."""
    if not isinstance(value, dict):
        raise PayloadError(400, f"field '{what}' must be a map {{bucket, key, size, sha256}}")
    try:
        check_key(value.get("key"))
    except PayloadError as exc:
        raise PayloadError(400, f"{what}.key: {exc.message}") from None
    size = value.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise PayloadError(400, f"{what}.size must be a number of bytes >= 0")
    sha = value.get("sha256")
    if not isinstance(sha, str) or not _SHA256_RE.match(sha):
        raise PayloadError(400, f"{what}.sha256 must be the blob's sha256, 64 lower-case hex characters")
    bucket = value.get("bucket")
    if bucket is not None and not isinstance(bucket, str):
        raise PayloadError(400, f"{what}.bucket must be a string")
    return {"bucket": bucket, "key": value["key"], "size": size, "sha256": sha}


def over_threshold(what: str, size: int, threshold: int, namespace: str, use: str) -> PayloadError:
    """The 413 of an inline body over ``INLINE_THRESHOLD_BYTES``: names the threshold, the presign
    route and the ref field to send instead (``use``)."""
    return PayloadError(
        413,
        f"{what} of {size} bytes is over the inline threshold of {threshold} bytes "
        f"(INLINE_THRESHOLD_BYTES): upload it through POST /v1/namespaces/{namespace}/payloads/presign "
        f"and send {use} {{bucket, key, size, sha256}} instead",
    )


def sha256_hex(data: bytes) -> str:
    """Lower-case hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def verify_sha256(data: bytes, expected: str) -> None:
    """Raise PayloadCorrupt unless ``data`` hashes to ``expected`` (hex, optional ``sha256:`` prefix).

    The message is exactly ``payload corrupt: sha256 mismatch (expected <e>, got <g>)`` with both
    digests as lower-case hex.
    """
    if not isinstance(expected, str):
        raise PayloadError(400, f"sha256 must be a hex string, got {type(expected).__name__}")
    norm = expected.strip().lower()
    if norm.startswith("sha256:"):
        norm = norm[len("sha256:") :]
    if not _SHA256_RE.match(norm):
        raise PayloadError(400, f"invalid sha256 {expected!r:.80}: expected 64 hex characters")
    got = sha256_hex(data)
    if got != norm:
        raise PayloadCorrupt(norm, got)


def _s3_error(resp: httpx.Response) -> str:
    code = re.search(r"<Code>([^<]{1,100})</Code>", resp.text)
    message = re.search(r"<Message>([^<]{1,300})</Message>", resp.text)
    parts = [p.group(1) for p in (code, message) if p]
    return ": ".join(parts) if parts else resp.text[:200]


def upload(
    url: str, data: bytes, *, content_type: str | None = None, timeout: float = DEFAULT_FETCH_TIMEOUT_S
) -> None:
    """PUT ``data`` to a presigned URL. Send ``content_type`` when the URL was presigned with one.

    Raises PayloadError carrying S3's status (403 for a bad, expired or size-mismatched URL) or
    502 when the store cannot be reached.
    """
    headers = {"Content-Type": content_type} if content_type else {}
    try:
        resp = httpx.put(url, content=bytes(data), headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise PayloadError(502, f"payload upload failed: {exc!s}: check the S3 endpoint and retry") from exc
    if resp.status_code >= 300:
        raise PayloadError(
            resp.status_code, f"payload upload refused by the store ({resp.status_code} {_s3_error(resp)})"
        )


def download(url: str, timeout: float = DEFAULT_FETCH_TIMEOUT_S, *, max_bytes: int | None = None) -> bytes:
    """GET the bytes behind a presigned URL (the daemon's fetch timeout is 60 s).

    ``max_bytes`` bounds the body (413 when exceeded). Raises PayloadError carrying S3's status
    (403 bad/expired URL, 404 no such key) or 502 when the store cannot be reached.
    """
    try:
        with httpx.stream("GET", url, timeout=timeout) as resp:
            if resp.status_code >= 300:
                resp.read()
                raise PayloadError(
                    resp.status_code,
                    f"payload download refused by the store ({resp.status_code} {_s3_error(resp)})",
                )
            chunks: list[bytes] = []
            total = 0
            for chunk in resp.iter_bytes():
                total += len(chunk)
                if max_bytes is not None and total > max_bytes:
                    raise PayloadError(
                        413, f"payload is larger than the {max_bytes}-byte limit of this download"
                    )
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise PayloadError(502, f"payload download failed: {exc!s}: check the S3 endpoint and retry") from exc
