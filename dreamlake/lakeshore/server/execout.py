"""The exec output archive (seed 003): an exec job's full stdout and stderr, kept under
``exec/<YYYY>/<MM>/<DD>/<exec_id>/out/<stdout|stderr>`` (the UTC day the job was created) in the
payload store: the S3 bucket, or the control plane's blob directory.

The result route keeps the last 1 MiB of each stream inline as before; the archive holds all of it
(up to the payload store's ``MAX_PAYLOAD_BYTES``; nymph sends the end of a longer one, with a line
saying what was cut). Nobody presigns into ``exec/`` (presign mints ``payloads/`` keys only), so
the archive is written only here:

- ``PUT /v1/namespaces/:ns/jobs/:id/output/:stream?worker_id=W&attempt=N`` (a daemon, for the
  exec job its worker holds: the claimer of the latest attempt, while it runs), the raw bytes with
  their ``Content-Length``, streamed to a private temp file and moved into place (or put to S3)
  whole; 200 ``{ok, key, size}``;
- ``GET /v1/namespaces/:ns/jobs/:id/output/:stream`` (the namespace, or an admin): the bytes, or 404
  when the job is unknown in that namespace or left no such output.

Retention: with a bucket, the objects go with their exec job (``lakeshore gc`` and the sweep, by
the job's queue's retention); a blob directory prunes them by age like its payloads
(``LAKESHORE_BLOBS_RETENTION_S``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse

from dreamlake.lakeshore.server import http
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.blobdir import TMP_DIR, BlobDir
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.store.exec_jobs import OUTPUT_STREAMS as STREAMS
from dreamlake.lakeshore.store.exec_jobs import archive_key

log = logging.getLogger(__name__)

CHUNK = 1 << 20


def _stream(request: Request) -> str:
    stream = str(request.path_params["stream"])
    if stream not in STREAMS:
        raise HTTPError(404, f"no output stream {stream[:20]!r}: ask for one of {', '.join(STREAMS)}")
    return stream


def _store(ctx: Context) -> Any:
    if ctx.payloads is None:
        raise HTTPError(
            501,
            "this control plane has no payload store to archive exec output in (set "
            "LAKESHORE_BLOBS_BUCKET, or LAKESHORE_BLOBS_DIR): the result's inline tails are all there is",
        )
    return ctx.payloads


def _blob_path(blobs: BlobDir, key: str) -> Path:
    # the key is made here from a ULID and fixed words: nothing of it comes from the caller as is
    return blobs.root.joinpath(*key.split("/"))


async def put(ctx: Context, caller: Caller, namespace: str, exec_id: str, request: Request) -> dict[str, Any]:
    """Archive one stream of the exec job a daemon holds (see the module docstring)."""
    stream = _stream(request)
    store = _store(ctx)
    worker_id = http.ulid(request.query_params.get("worker_id"), "worker_id")
    await ctx.workers.check(caller, worker_id)
    attempt = http.query_int(request, "attempt", 0)
    job = await ctx.call(ctx.store.get_exec, namespace, exec_id)
    if job is None:
        raise HTTPError(404, f"unknown exec job '{exec_id}' in namespace '{namespace}'")
    if job["state"] != "running" or job["worker_id"] != worker_id or (attempt and attempt != job["attempt"]):
        raise HTTPError(
            409, f"exec job {exec_id} is not held by worker {worker_id} (attempt {attempt}) now", ok=False
        )
    declared = request.headers.get("content-length")
    limit = int(store.config.max_payload_bytes)
    if declared is None or not declared.strip().isdigit():
        raise HTTPError(411, "send the output with its Content-Length")
    size = int(declared)
    if size > limit:
        raise HTTPError(413, f"an archived output is at most {limit} bytes (MAX_PAYLOAD_BYTES); send its end")
    key = archive_key(exec_id, float(job["created_at"]), stream)
    spool = await _spool(request, size, store)
    try:
        await run_in_threadpool(_commit, store, spool, key)
    finally:
        with contextlib.suppress(OSError):
            spool.unlink()
    log.info("archived %s of exec %s (%d bytes) at %s", stream, exec_id, size, key)
    return {"ok": True, "key": key, "size": size}


async def _spool(request: Request, size: int, store: Any) -> Path:
    """The request's body in a private temp file (the blob directory's own, to be moved from)."""
    if isinstance(store, BlobDir):
        path = store.root / TMP_DIR / f"{secrets.token_hex(12)}.exec"
    else:
        path = Path(tempfile.gettempdir()) / f"lakeshore-exec-{secrets.token_hex(12)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    done = False
    try:
        got = 0
        async for chunk in request.stream():
            got += len(chunk)
            if got > size:
                raise HTTPError(400, f"the output is longer than its Content-Length of {size} bytes")
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        if got != size:
            raise HTTPError(400, f"the output ended after {got} of its {size} bytes: send it again")
        os.fsync(fd)
        done = True
    finally:
        os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                path.unlink()
    return path


def _commit(store: Any, spool: Path, key: str) -> None:
    if isinstance(store, BlobDir):
        final = _blob_path(store, key)
        final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.replace(spool, final)
        return
    with open(spool, "rb") as fh:
        store.client.put_object(Bucket=store.bucket, Key=key, Body=fh)


async def get(ctx: Context, namespace: str, exec_id: str, request: Request) -> Response:
    """One stream of an exec job's archived output (see the module docstring)."""
    stream = _stream(request)
    store = _store(ctx)
    job = await ctx.call(ctx.store.get_exec, namespace, exec_id)
    if job is None:
        raise HTTPError(404, f"unknown exec job '{exec_id}' in namespace '{namespace}'")
    key = archive_key(exec_id, float(job["created_at"]), stream)
    missing = HTTPError(
        404, f"exec job {exec_id} has no archived {stream} (not done yet, or it printed nothing)"
    )
    if isinstance(store, BlobDir):
        path = _blob_path(store, key)
        if not path.is_file():
            raise missing
        return FileResponse(path, media_type="application/octet-stream")
    try:
        obj = await run_in_threadpool(store.client.get_object, Bucket=store.bucket, Key=key)
    except Exception as exc:  # botocore's NoSuchKey and friends
        if "NoSuchKey" in type(exc).__name__ or "404" in str(exc) or "NoSuchKey" in str(exc):
            raise missing from None
        raise
    body = obj["Body"]

    async def pieces() -> Any:
        try:
            while True:
                piece = await run_in_threadpool(body.read, CHUNK)
                if not piece:
                    return
                yield piece
        finally:
            body.close()

    return StreamingResponse(pieces(), media_type="application/octet-stream")
