"""``PUT`` / ``GET /v1/blobs/<key>``: the local blob directory's side of a presigned URL.

Only served when the app's payload store is a :class:`~.blobdir.BlobDir` (no bucket configured);
over S3 the URLs point at S3 and these routes answer 404. No bearer token: the URL's signature is
the credential (``BlobDir.verify``), as with S3. An upload streams to a private temp file, never
buffered whole in memory, and is renamed into place only once all of its signed size arrived and
was flushed (and hashed to the signed sha256, when the presign named one); anything else leaves no
blob behind, and a key once uploaded keeps its first bytes (409 for others).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from dreamlake.lakeshore.server.blobdir import BlobDir
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.server.payloads import PayloadError

log = logging.getLogger(__name__)


class _BlobResponse(FileResponse):
    """A blob's bytes, read in 1 MiB pieces (Starlette's 64 KiB cost a thread hop each)."""

    chunk_size = 1 << 20


def _blobs(ctx: Context) -> BlobDir:
    if not isinstance(ctx.payloads, BlobDir):
        raise HTTPError(
            404,
            "this control plane keeps payloads in its S3 bucket, not a local blob directory: "
            "use the URL POST /v1/namespaces/:ns/payloads/presign returns",
        )
    return ctx.payloads


def _verified(
    ctx: Context, request: Request, method: str
) -> tuple[BlobDir, str, int | None, str | None, str | None]:
    blobs = _blobs(ctx)
    key = str(request.path_params["key"])
    try:
        size, content_type, sha256 = blobs.verify(method, key, request.query_params)
    except PayloadError as exc:
        raise HTTPError(exc.status, exc.message) from None
    return blobs, key, size, content_type, sha256


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def put(ctx: Context, request: Request) -> Response:
    blobs, key, size, content_type, signed_sha = _verified(ctx, request, "PUT")
    if size is None:
        raise HTTPError(403, "blob URL was presigned for GET, not PUT: presign a put")
    declared = request.headers.get("content-length")
    if declared is None:
        raise HTTPError(411, f"send Content-Length: {size} (the presigned size) with the upload")
    if declared.strip() != str(size):
        raise HTTPError(
            403,
            f"Content-Length {declared[:20]} differs from the presigned size {size}: presign the real size",
        )
    if content_type is not None and request.headers.get("content-type") != content_type:
        raise HTTPError(403, f"send Content-Type: {content_type}, as presigned")
    fd, tmp = blobs.open_upload()
    done = False
    digest = hashlib.sha256()
    try:
        got = 0
        async for chunk in request.stream():
            got += len(chunk)
            if got > size:
                raise HTTPError(400, f"upload is longer than its presigned size of {size} bytes")
            digest.update(chunk)
            _write_all(fd, chunk)
        if got != size:
            raise HTTPError(400, f"upload ended after {got} of its {size} bytes: send it again")
        sha = digest.hexdigest()
        if signed_sha is not None and sha != signed_sha:
            raise HTTPError(
                403, f"upload's sha256 {sha} differs from the presigned {signed_sha}: presign these bytes"
            )
        try:
            await run_in_threadpool(blobs.commit, fd, tmp, key, sha)
        except PayloadError as exc:
            raise HTTPError(exc.status, exc.message) from None
        finally:
            done = True  # commit closed the fd and removed the temp file, whatever it answered
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
    log.info("stored blob %s (%d bytes)", key, size)
    return Response(status_code=200)


async def get(ctx: Context, request: Request) -> Response:
    blobs, key, _, _, _ = _verified(ctx, request, "GET")
    path = blobs.path(key)
    if not path.is_file():
        raise HTTPError(404, f"no blob at {key[:200]!r}: it was never uploaded, or has expired")
    return _BlobResponse(path, media_type="application/octet-stream")
