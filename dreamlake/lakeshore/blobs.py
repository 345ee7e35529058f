"""Payload blobs by reference: upload and download through the presign route (seed 003, flows 2-4).

One client-side module for every party that moves big bytes: the SDK (``argsRef``, reading
``resultRef``), nymph (fetching ``argsRef`` into the workdir, uploading ``resultRef``) and code
archives. Both tiers of the payload store look the same from here: ``POST
/v1/namespaces/:ns/payloads/presign`` answers ``{url, bucket, key, expires_at}`` whether the URL
points at S3 or at the control plane's own blob directory (``/v1/blobs/...``, no bucket
configured), and the bytes then go straight to that URL, without the bearer token (the signature
is the credential)::

    ref = blobs.put(client, "default", big_bytes, kind="args")   # -> {"bucket", "key", "size", "sha256"}
    data = blobs.get(client, "default", ref)                     # sha256 checked
    blobs.get(client, "default", ref, into=path)                 # streamed to a file, checked, renamed

:func:`put` streams: a bytes-like value (a ``memoryview`` of a numpy buffer travels without a
copy), a path, an open binary file or an iterable of chunks (give ``size``) is read in
:data:`CHUNK` pieces, hashed on the way (sha256) and sent with the presigned ``Content-Length``.
:func:`get` hashes what arrives and raises :class:`~.errors.PayloadCorrupt` (seed 003's text,
``payload corrupt: sha256 mismatch (expected E, got G)``) when it differs from the ref's; a file
being written is removed then, so a corrupt blob never lands where a reader would take it.

Import-light on purpose: httpx and the control-plane client, no server or store code. It is in
the entry bundle (a task that submits tasks with big arguments uses it), so it runs on Python 3.9.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Union
from urllib.parse import urljoin

import httpx

from dreamlake.lakeshore.client import PlaneClient, error_for, retrying
from dreamlake.lakeshore.errors import BadRequest, PayloadCorrupt, Unavailable

__all__ = [
    "CHUNK",
    "PREFIX",
    "check_ref",
    "get",
    "is_ref",
    "presign_route",
    "private_job_id",
    "put",
    "verify_sha256",
]

PREFIX = "payloads/"
CHUNK = 1 << 20
TIMEOUT_S = 60.0  # seed 003: the daemon's fetch timeout (per read / write, not for the whole body)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# a list of bytes-like pieces is one payload, their concatenation (read in place, re-readable)
Source = Union[
    bytes, bytearray, memoryview, str, "os.PathLike[str]", IO[bytes], Iterable[bytes], "list[bytes]"
]


def private_job_id(invocation_id: str) -> str:
    """``<invocation_id>.<80 random bits>``: the ``jobId`` lakeshore names its own blobs with.

    A payload key is the credential a presign GET needs within its namespace (the key carries
    the namespace, and only that namespace's tokens presign it), and invocation ids are not
    secrets (they show in logs and URLs), so the key must not be derivable from one."""
    return f"{invocation_id}.{secrets.token_hex(10)}"


def presign_route(namespace: str) -> str:
    from dreamlake.lakeshore.protocol.routes import presign

    return presign(namespace)


def is_ref(value: object) -> bool:
    """Whether ``value`` has the shape of a payload ref (``{"key": "payloads/...", "size", ...}``)."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("key"), str)
        and value["key"].startswith(PREFIX)
        and isinstance(value.get("size"), int)
    )


def check_ref(value: object, what: str = "payload ref") -> dict[str, Any]:
    """``value`` if it is a well-formed ref ``{bucket, key, size, sha256?}``, else BadRequest."""
    if not is_ref(value):
        raise BadRequest(
            f"{what} must be {{'bucket', 'key': 'payloads/...', 'size', 'sha256'}}, got {value!r:.120}"
        )
    assert isinstance(value, dict)
    sha = value.get("sha256")
    if sha is not None and not (isinstance(sha, str) and _SHA256.match(sha)):
        raise BadRequest(f"{what}.sha256 must be 64 lower-case hex characters, got {sha!r:.80}")
    if value["size"] < 0:
        raise BadRequest(f"{what}.size must be >= 0, got {value['size']}")
    return value


def verify_sha256(got: str, expected: str | None) -> None:
    """Raise PayloadCorrupt when ``expected`` is given and differs from ``got`` (both hex)."""
    if expected and got != expected.lower():
        raise PayloadCorrupt(expected.lower(), got)


# -- upload ---------------------------------------------------------------------------------------


class _Body:
    """A source as (size, a way to iterate its chunks, whether it can be iterated again)."""

    def __init__(self, source: Source, size: int | None) -> None:
        self._file: IO[bytes] | None = None
        self._view: memoryview | None = None
        self._iterable: Iterable[bytes] | None = None
        self._path: Path | None = None
        self._start = 0
        self._parts: list[memoryview] | None = None
        if isinstance(source, list) and all(isinstance(p, (bytes, bytearray, memoryview)) for p in source):
            self._parts = [memoryview(p).cast("B") for p in source]  # pieces of one payload, in place
            self.size = sum(p.nbytes for p in self._parts)
        elif isinstance(source, (bytes, bytearray, memoryview)):
            self._view = memoryview(source).cast("B") if not isinstance(source, bytes) else memoryview(source)
            self.size = self._view.nbytes
        elif isinstance(source, (str, os.PathLike)):
            self._path = Path(source)
            self.size = self._path.stat().st_size
        elif hasattr(source, "read"):
            self._file = source  # type: ignore[assignment]
            assert self._file is not None
            if size is not None:
                self.size = size
            else:
                try:
                    self._start = self._file.tell()
                    self.size = os.fstat(self._file.fileno()).st_size - self._start
                except (OSError, AttributeError, ValueError):
                    self._file.seek(0, os.SEEK_END)
                    end = self._file.tell()
                    self._file.seek(self._start)
                    self.size = end - self._start
        else:
            if size is None:
                raise ValueError(
                    "blobs.put of an iterable of chunks needs size=: the URL is presigned for it"
                )
            self._iterable = source
            self.size = size
        if size is not None and size != self.size:
            raise ValueError(f"size={size} but the source holds {self.size} bytes")
        self.digest = hashlib.sha256()
        self.sent = 0

    @property
    def replayable(self) -> bool:
        if self._file is not None:
            return bool(getattr(self._file, "seekable", lambda: False)())
        return self._iterable is None

    def digests(self) -> tuple[str, str]:
        """(sha256, md5) of the bytes, hex, read once ahead of the upload (a replayable source)."""
        sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
        for chunk in self._raw():
            sha.update(chunk)
            md5.update(chunk)
        return sha.hexdigest(), md5.hexdigest()

    def chunks(self) -> Iterator[bytes]:
        """The bytes, hashed on the way; a second call starts again from the beginning."""
        self.digest = hashlib.sha256()
        self.sent = 0
        for chunk in self._raw():
            if not chunk:
                continue
            self.digest.update(chunk)
            self.sent += len(chunk)
            if self.sent > self.size:
                raise ValueError(f"the source gave more than its {self.size} bytes")
            yield chunk
        if self.sent != self.size:
            raise ValueError(f"the source ended after {self.sent} of its {self.size} bytes")

    def _raw(self) -> Iterator[bytes]:
        if self._parts is not None or self._view is not None:
            for view in self._parts if self._parts is not None else [self._view]:
                assert view is not None
                for start in range(0, view.nbytes, CHUNK):
                    yield view[start : start + CHUNK]  # type: ignore[misc]  # in place: h11 joins it once
        elif self._path is not None:
            with open(self._path, "rb") as f:
                yield from iter(lambda: f.read(CHUNK), b"")
        elif self._file is not None:
            if self.replayable:
                self._file.seek(self._start)
            remaining = self.size
            while remaining > 0:
                chunk = self._file.read(min(CHUNK, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
                yield chunk
        else:
            assert self._iterable is not None
            yield from self._iterable


def _absolute(client: PlaneClient, url: str) -> str:
    """A presigned URL as given, or one relative to the control plane made absolute."""
    return url if url.startswith(("http://", "https://")) else urljoin(client.url + "/", url)


def _reason(resp: httpx.Response) -> str:
    text = resp.text
    code = re.search(r"<Code>([^<]{1,100})</Code>", text)
    message = re.search(r"<Message>([^<]{1,300})</Message>", text)
    if code or message:  # S3's XML error
        return ": ".join(m.group(1) for m in (code, message) if m)
    with contextlib.suppress(ValueError):
        detail = resp.json()
        if isinstance(detail, dict) and "error" in detail:
            return str(detail["error"])
    return text[:200] or resp.reason_phrase


def _timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, connect=5.0)


def put(
    client: PlaneClient,
    namespace: str,
    source: Source,
    *,
    size: int | None = None,
    job_id: str | None = None,
    kind: str = "args",
    content_type: str | None = None,
    timeout_s: float = TIMEOUT_S,
) -> dict[str, Any]:
    """Upload ``source`` through the presign route -> the ref ``{"bucket", "key", "size", "sha256"}``.

    ``job_id`` and ``kind`` name the key (``payloads/<namespace>/<date>/<job_id>/<kind>``: see the presign rules
    in docs/protocol.md). A failure to reach the store is retried (``client.attempts`` times) when
    the source can be read again (bytes, a path, a seekable file). Raises the client's errors: a
    413 (``BadRequest``) when the control plane's ``MAX_PAYLOAD_BYTES`` is smaller than the payload.
    """
    body = _Body(source, size)
    ask: dict[str, Any] = {"op": "put", "size": body.size, "kind": kind}
    if job_id is not None:
        ask["jobId"] = job_id
    if content_type is not None:
        ask["contentType"] = content_type
    if body.replayable:  # the URL is bound to these bytes: a replay of it with others is refused
        ask["sha256"], ask["md5"] = body.digests()
    answer = client.request("POST", presign_route(namespace), ask, as_json=True)
    url = _absolute(client, str(answer.get("url") or ""))
    headers = {"Content-Length": str(body.size)}
    if content_type is not None:
        headers["Content-Type"] = content_type
    signed = answer.get("headers")
    if isinstance(signed, dict):  # the digests the store checks (S3: x-amz-checksum-sha256, Content-MD5)
        headers.update({str(k): str(v) for k, v in signed.items()})
    what = f"PUT {url.split('?')[0]}"

    def once() -> None:
        try:
            resp = client.bare().put(url, content=body.chunks(), headers=headers, timeout=_timeout(timeout_s))
        except httpx.TransportError as exc:
            raise Unavailable(f"{what}: the payload store could not be reached: {exc}") from exc
        if resp.status_code >= 300:
            raise error_for(resp.status_code, f"{what} failed with HTTP {resp.status_code}: {_reason(resp)}")

    (client.policy() if body.replayable else retrying(attempts=1))(once)  # the client's attempts / window
    return {
        "bucket": answer.get("bucket"),
        "key": answer["key"],
        "size": body.size,
        "sha256": body.digest.hexdigest(),
    }


# -- download -------------------------------------------------------------------------------------


def _wrong_size(ref: dict[str, Any], what: str) -> PayloadCorrupt:
    return PayloadCorrupt(
        str(ref.get("sha256") or ""), "", f"payload corrupt: {ref['key']!r} holds {what} (the ref's size)"
    )


def _open_private(path: Path) -> IO[bytes]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o600), "wb")


def get(
    client: PlaneClient,
    namespace: str,
    ref: dict[str, Any],
    *,
    into: str | os.PathLike[str] | IO[bytes] | None = None,
    limit: int | None = None,
    timeout_s: float = TIMEOUT_S,
    sync: bool = False,
) -> bytearray | None:
    """Download the blob ``ref`` names, checking its size and sha256 (when the ref has one).

    Without ``into`` -> the bytes (one buffer of the ref's size, filled in place). With a path ->
    written to ``<path>.part`` (0600, links not followed) and renamed to ``path`` once verified;
    with an open binary file -> written there (the caller discards it on an error). ``limit``
    refuses (BadRequest) a ref larger than that before anything is fetched; ``sync`` flushes a path
    to disk before the rename (off: a workdir need only outlive its process, not the host). Raises PayloadCorrupt
    on a sha256 or size mismatch, the client's errors otherwise.
    """
    ref = check_ref(ref)
    size = int(ref["size"])
    if limit is not None and size > limit:
        raise BadRequest(f"payload {ref['key']!r} is {size} bytes, over this reader's limit of {limit}")
    answer = client.request("POST", presign_route(namespace), {"op": "get", "key": ref["key"]}, as_json=True)
    url = _absolute(client, str(answer.get("url") or ""))
    what = f"GET {url.split('?')[0]}"
    buffer = bytearray(size) if into is None else None
    target: IO[bytes] | None = None
    part: Path | None = None
    final: Path | None = None
    if isinstance(into, (str, os.PathLike)):
        final = Path(into)
        part = final.with_name(final.name + ".part")
        target = _open_private(part)
    elif into is not None:
        target = into
    digest = hashlib.sha256()
    got = 0
    ok = False
    try:
        try:
            with client.bare().stream("GET", url, timeout=_timeout(timeout_s)) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise error_for(
                        resp.status_code, f"{what} failed with HTTP {resp.status_code}: {_reason(resp)}"
                    )
                for chunk in resp.iter_bytes():  # as it arrives: no re-chunking copy
                    if got + len(chunk) > size:
                        raise _wrong_size(ref, f"more than its {size} bytes")
                    digest.update(chunk)
                    if buffer is not None:
                        buffer[got : got + len(chunk)] = chunk
                    else:
                        assert target is not None
                        target.write(chunk)
                    got += len(chunk)
        except httpx.TransportError as exc:
            raise Unavailable(f"{what}: the payload store could not be reached: {exc}") from exc
        verify_sha256(digest.hexdigest(), ref.get("sha256"))
        if got != size:
            raise _wrong_size(ref, f"{got} of its {size} bytes")
        if part is not None and target is not None and final is not None:
            target.flush()
            if sync:
                os.fsync(target.fileno())
            target.close()
            os.replace(part, final)
        ok = True
    finally:
        if part is not None and target is not None and not ok:
            target.close()
            with contextlib.suppress(OSError):
                part.unlink()
    return buffer
