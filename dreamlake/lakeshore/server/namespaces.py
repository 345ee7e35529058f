"""Namespace routes (JSON, seed 003): exec jobs, their results, payload presign, version pin."""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.server import http
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.server.payloads import PayloadError, check_key_in
from dreamlake.lakeshore.store.notify import exec_queue_channel
from dreamlake.lakeshore.store.values import check_max_attempts, check_timeout

log = logging.getLogger(__name__)


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise HTTPError(400, f"field '{what}' must be a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPError(
            400,
            f"field '{what}' is not valid base64: encode the payload bytes with "
            "standard base64 (A-Z a-z 0-9 + /, '=' padding)",
        ) from None


def _payload_ref(value: Any, namespace: str, *, legacy: bool) -> dict[str, Any]:
    """An exec's ``payloadRef``: a key presigned in ``namespace`` (404 as for an unknown key
    otherwise: a job cannot be pointed at another namespace's payload) and its sha256, which the
    daemon checks after the download (required: a ref without one could be swapped unnoticed)."""
    if not isinstance(value, dict):
        raise HTTPError(400, "field 'payloadRef' must be an object {bucket, key, size, sha256}")
    try:
        check_key_in(value.get("key"), namespace, legacy=legacy)
    except PayloadError as exc:
        raise HTTPError(
            exc.status,
            f"payloadRef.key: {exc.message}; upload through POST /v1/namespaces/{namespace}/payloads/presign "
            "and pass the key it returns",
        ) from None
    field(value, "bucket", str)
    size = field(value, "size", int)
    if size < 0:
        raise HTTPError(400, "payloadRef.size must be >= 0")
    sha = value.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise HTTPError(
            400,
            "payloadRef.sha256 is required: the sha256 of the uploaded bytes, 64 lower-case hex "
            "characters (the daemon checks the download against it)",
        )
    return dict(value)


async def exec_(
    ctx: Context, namespace: str, body: dict[str, Any], *, legacy: bool = False
) -> tuple[int, dict[str, Any]]:
    """Seed 003's enqueue; ``legacy``: a payloadRef minted before keys carried their namespace is
    taken (a caller bound to no namespace)."""
    command = field(body, "command", str)
    if not command:
        raise HTTPError(400, "field 'command' must not be empty")
    inline_raw = body.get("payloadInline")
    ref_raw = body.get("payloadRef")
    if inline_raw is not None and ref_raw is not None:
        raise HTTPError(
            400,
            "payloadInline and payloadRef are mutually exclusive: send one "
            "(payloadRef for payloads over the inline threshold)",
        )
    inline = _b64(inline_raw, "payloadInline") if inline_raw is not None else None
    ref = _payload_ref(ref_raw, namespace, legacy=legacy) if ref_raw is not None else None
    queue = http.name(field(body, "queue", str, default="default"), "queue")
    worker_id = http.ulid_field(body, "worker_id", optional=True)
    try:
        timeout_s = check_timeout(body.get("timeout_s"), "field 'timeout_s'")
        max_attempts = check_max_attempts(body.get("max_attempts"), "field 'max_attempts'")
    except PlaneError as exc:
        raise HTTPError(400, str(exc)) from None
    exec_id = await ctx.call(
        ctx.store.create_exec,
        namespace,
        command,
        payload_inline=inline,
        payload_ref=ref,
        queue=queue,
        worker_id=worker_id,
        timeout_s=timeout_s,
        max_attempts=max_attempts,
    )
    ctx.wake.notify(f"worker:{worker_id}" if worker_id else exec_queue_channel(namespace, queue))
    log.info("exec %s queued on %s in namespace %s", exec_id, queue, namespace)
    return 202, {"exec_id": exec_id, "worker_id": worker_id}


def _done(job: dict[str, Any]) -> dict[str, Any]:
    result = job.get("result") or {}
    return {
        "exec_id": job["exec_id"],
        "state": "done",
        "exit_code": result.get("exit_code"),
        "stdout": result.get("stdout", ""),
        "stderr": result.get("stderr", ""),
        "resultInline": result.get("resultInline"),
        "resultRef": result.get("resultRef"),
    }


async def result_get(ctx: Context, namespace: str, exec_id: str, wait: float) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + wait
    while True:
        mark = ctx.wake.mark()
        job = await ctx.call(ctx.store.get_exec, namespace, exec_id)
        if job is None:
            raise HTTPError(404, f"unknown exec job '{exec_id}' in namespace '{namespace}'")
        if job.get("state") == "done":
            return 200, _done(job)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return 202, {"exec_id": exec_id, "state": "pending"}
        await ctx.wake.wait([f"exec:{exec_id}"], min(remaining, ctx.config.recheck_s), since=mark)


async def result_post(
    ctx: Context, caller: Caller, namespace: str, exec_id: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """A daemon publishes the result of the exec job it claimed: ``worker_id`` (required but for an
    admin, and bound to the daemon's token) must be the claimer, ``attempt`` (when sent) the latest
    claim; else 409."""
    worker_id = http.ulid_field(body, "worker_id", optional=True)
    if worker_id is None and not caller.admin:
        raise HTTPError(
            400,
            "missing field 'worker_id': send the id of the worker that claimed the exec job "
            "(only an admin token publishes without one)",
        )
    if worker_id is not None:
        await ctx.workers.check(caller, worker_id)
    attempt = http.integer(body, "attempt", hi=http.I32_MAX, default=None)
    exit_code = field(body, "exit_code", int)
    result: dict[str, Any] = {
        "exit_code": exit_code,
        "stdout": field(body, "stdout", str, default=""),
        "stderr": field(body, "stderr", str, default=""),
    }
    inline = body.get("resultInline")
    if inline is not None:
        _b64(inline, "resultInline")
        result["resultInline"] = inline
    ref = body.get("resultRef")
    if ref is not None:
        result["resultRef"] = _payload_ref(ref, namespace, legacy=caller.namespace is None)
    done = await ctx.call(
        ctx.store.publish_exec_result, namespace, exec_id, result, worker_id=worker_id, attempt=attempt
    )
    if not done.ok:
        if done.state is None:
            raise HTTPError(404, f"unknown exec job '{exec_id}' in namespace '{namespace}'")
        log.info("result of exec %s refused: %s", exec_id, done.reason)
        return 409, {"ok": False, "error": done.reason or "result refused: the claim was superseded"}
    ctx.wake.notify(f"exec:{exec_id}")
    return 200, ({"ok": True, "duplicate": True} if done.duplicate else {"ok": True})


async def presign(
    ctx: Context, namespace: str, body: dict[str, Any], base_url: str = "", *, legacy: bool = False
) -> dict[str, Any]:
    """Seed 003's presign: an S3 URL, or one onto this control plane's blob directory (``base_url``,
    the address the caller reached it at) when no bucket is configured. A put mints a key of
    ``namespace`` (optionally bound to the bytes' ``sha256`` / ``md5``); a get names a key of
    ``namespace`` (404 otherwise), or, with ``legacy``, one minted before keys carried it."""
    if ctx.payloads is None:
        raise HTTPError(
            501,
            "payload store not configured: set LAKESHORE_BLOBS_BUCKET (and "
            "LAKESHORE_S3_ENDPOINT / credentials) on the control plane, or LAKESHORE_BLOBS_DIR "
            "(the default next to a SQLite store file), or send payloads inline (payloadInline)",
        )
    op = field(body, "op", str)
    try:
        if op == "put":
            size = field(body, "size", int)
            content_type = field(body, "contentType", str, default=None, nullable=True)
            job_id = field(body, "jobId", str, default=None, nullable=True)
            kind = field(body, "kind", str, default="args")
            sha256 = field(body, "sha256", str, default=None, nullable=True)
            md5 = field(body, "md5", str, default=None, nullable=True)
            if isinstance(size, int) and size > 0:
                await ctx.quotas.check_payload(namespace, size)  # 429 past max_payload_bytes
            answer = await run_in_threadpool(
                functools.partial(
                    ctx.payloads.presign_put,
                    namespace,
                    size,
                    content_type,
                    job_id,
                    kind,
                    base_url=base_url,
                    sha256=sha256,
                    md5=md5,
                )
            )
            await ctx.quotas.record_payload(namespace, str(answer["key"]), size)
        elif op == "get":
            key = check_key_in(field(body, "key", str), namespace, legacy=legacy)
            answer = await run_in_threadpool(ctx.payloads.presign_get, key, base_url=base_url)
        else:
            raise HTTPError(400, f"field 'op' must be 'put' or 'get', got {op[:20]!r}")
    except HTTPError:
        raise
    except Exception as exc:
        status = getattr(exc, "status", None)
        if isinstance(status, int) and 400 <= status < 500:
            raise HTTPError(status, str(getattr(exc, "message", exc))) from None
        raise
    return dict(answer)


async def pin(ctx: Context, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    if "nymph_version" not in body:
        raise HTTPError(400, "missing field 'nymph_version' (a version string, or null to clear the pin)")
    version = field(body, "nymph_version", str, default=None, nullable=True)
    if (version is not None and not (0 < len(version) <= 64)) or (version and not version.isprintable()):
        raise HTTPError(400, "field 'nymph_version' must be a short version string such as '0.1.4', or null")
    await ctx.call(ctx.store.pin_version, namespace, version)
    ctx.daemons.forget_all()  # idle daemons answered from memory read the pin with their next request
    log.info("namespace %s pinned to nymph %s", namespace, version)
    return {"namespace": namespace, "nymph_version": version}
