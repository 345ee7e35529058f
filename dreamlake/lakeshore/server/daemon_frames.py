"""The daemon's frames: ``result-chunk`` (one frame) and ``result-chunks`` (a batch of one attempt).

``result-chunks`` takes many frames of one attempt in one request and journals them through the
group commit (a ``FramesRequest``: many requests' batches in one transaction), answering per seq
(stored or duplicate); the frames that were new are then published to the live fan-out in one
call. ``result-chunk`` is the seed's one-frame form. Only the worker holding the current lease
posts frames, and in order (the store refuses a gap, or a frame after the final one, 409 with
``expected_seq``). A frame body over the inline threshold is refused 413: it travels as
``{"ref": ...}`` (:func:`_check_frame`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore.server import http
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.daemon_checks import _attempt, _refused, _worker
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.store.api import UNKNOWN, ChunkResult, FrameRequest, FramesRequest, FramesResult

if TYPE_CHECKING:
    from dreamlake.lakeshore.wire import Frame

log = logging.getLogger("dreamlake.lakeshore.server.daemon")


def _frame(data: bytes, what: str = "field 'bytes'") -> Frame:
    from dreamlake.lakeshore.wire import decode_frame

    try:
        return decode_frame(data)
    except Exception as exc:
        raise HTTPError(400, f"{what} is not one encoded frame [kind, seq, body, meta]: {exc}") from None


def _check_frame(ctx: Context, caller: Caller, frame: Frame, what: str) -> None:
    """413 for a frame whose body bytes are over the inline threshold: such a frame travels as a
    frame whose body is ``{"ref": {bucket, key, size, sha256}}`` (docs/protocol.md, Payload refs)."""
    body = frame.body
    if isinstance(body, bytes | bytearray):
        ctx.check_inline(
            f"{what} (seq {frame.seq}) body", len(body), caller.namespace or ":ns", "a frame body {ref: ...}"
        )
    elif isinstance(body, dict) and "ref" in body:
        ctx.ref(body["ref"], f"{what}.body.ref")


async def result_chunk(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Journal one frame, then publish it live. The frame's kind decides whether it closes the
    stream (END and ERROR do, as the seed says); a ``final: true`` on a VALUE or LOG frame is
    logged and ignored. Only the worker holding the current lease posts frames, in seq order."""
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    seq = http.integer(body, "seq", hi=http.I64_MAX)
    data = field(body, "bytes", bytes)
    said_final = field(body, "final", bool, default=False)
    attempt = _attempt(body)
    worker_id = await _worker(ctx, caller, body)
    frame = _frame(data)
    _check_frame(ctx, caller, frame, "frame")
    if frame.seq != seq:
        raise HTTPError(
            400,
            f"the frame's own seq {frame.seq} differs from the body's seq {seq}: "
            "send the frame with the seq it was encoded with",
        )
    final = frame.final
    if said_final and not final:
        log.warning(
            "result chunk %s seq %d says final but is a frame of kind %d: only END and ERROR close a stream",
            invocation_id,
            seq,
            frame.kind,
        )
    result = await ctx.write(FrameRequest(invocation_id, seq, data, final, attempt, worker_id))
    assert isinstance(result, ChunkResult)
    if not result.ok:
        reason = result.reason or "frame refused"
        if result.status == UNKNOWN:
            raise HTTPError(404, reason, ok=False)
        _refused(caller, f"frame {seq}", invocation_id, result.status, reason)
        out: dict[str, Any] = {"ok": False, "error": reason}
        if result.expected_seq is not None:
            out["expected_seq"] = result.expected_seq
        return result.status, out
    ctx.metrics.child(ctx.metrics.chunks, str(result.duplicate).lower()).inc()
    if result.duplicate:
        return 200, {"ok": True, "seq": seq, "duplicate": True}
    ctx.metrics.frames_appended((frame.kind,))
    ctx.wake.notify(f"inv:{invocation_id}")
    if ctx.fanout is not None:
        try:  # at its journal position, as journaled (a later attempt's frames are restamped)
            pos = seq if result.pos is None else result.pos
            await ctx.fanout.publish(invocation_id, pos, result.data or data, final)
        except Exception:
            log.warning(
                "live publish of %s seq %d failed; followers catch up from the journal",
                invocation_id,
                seq,
                exc_info=True,
            )
    return 200, {"ok": True, "seq": seq}


MAX_BATCH_FRAMES = 10_000


async def result_chunks(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Journal a batch ``{invocation_id, attempt, worker_id, frames: [bytes, ...]}`` of one attempt
    through the group commit (one transaction, shared with the other writes committed with it;
    the lease and order checks run per batch, inside it) and answer, once committed, ``{ok, results: [{seq, duplicate}]}`` in the order sent. Each
    frame is a repeat of a seq already journaled (``duplicate``) or the next seq. A gap or a frame
    after the final one is refused with the rest of the batch: 409 ``{ok: false, error,
    expected_seq, results}`` with the results of the frames kept before it. Only the worker holding
    the current lease posts frames (403 another worker, 409 superseded, nothing journaled); an
    unknown invocation is a 404. Frames whose kind is END or ERROR close the stream."""
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    attempt = _attempt(body)
    worker_id = await _worker(ctx, caller, body)
    raw = field(body, "frames", list)
    if not raw or len(raw) > MAX_BATCH_FRAMES:
        raise HTTPError(400, f"field 'frames' must list 1 to {MAX_BATCH_FRAMES} encoded frames")
    batch: list[tuple[int, bytes, bool]] = []
    kinds: list[int] = []
    for i, data in enumerate(raw):
        if not isinstance(data, bytes):
            raise HTTPError(
                400, f"frames[{i}] must be the bytes of one encoded frame, not {type(data).__name__}"
            )
        frame = _frame(data, f"frames[{i}]")
        _check_frame(ctx, caller, frame, f"frames[{i}]")
        batch.append((frame.seq, data, frame.final))
        kinds.append(frame.kind)
    written = await ctx.write(FramesRequest(invocation_id, attempt, batch, worker_id))
    assert isinstance(written, FramesResult)
    results = written.results
    kept = [r for r in results if r.ok]
    fresh = [  # at their journal positions, as journaled (a later attempt's frames are restamped)
        (seq if r.pos is None else r.pos, r.data or data, final)
        for (seq, data, final), r in zip(batch, results, strict=False)
        if r.ok and not r.duplicate
    ]
    ctx.metrics.child(ctx.metrics.chunks, "false").inc(len(fresh))
    ctx.metrics.frames_appended(k for k, r in zip(kinds, results, strict=False) if r.ok and not r.duplicate)
    if len(kept) > len(fresh):
        ctx.metrics.child(ctx.metrics.chunks, "true").inc(len(kept) - len(fresh))
    if fresh:
        ctx.wake.notify(f"inv:{invocation_id}")
        await _publish(ctx, invocation_id, fresh)
    answers = [{"seq": r.seq, "duplicate": r.duplicate} for r in kept]
    if len(kept) == len(results):
        return 200, {"ok": True, "results": answers}
    refused = results[len(kept)]
    reason = refused.reason or "frames refused"
    if refused.status == UNKNOWN:
        raise HTTPError(404, reason, ok=False)
    _refused(caller, f"frames from {refused.seq}", invocation_id, refused.status, reason)
    out: dict[str, Any] = {"ok": False, "error": reason, "results": answers}
    if refused.expected_seq is not None:
        out["expected_seq"] = refused.expected_seq
    return refused.status, out


async def _publish(ctx: Context, invocation_id: str, items: list[tuple[int, bytes, bool]]) -> None:
    """Hand new frames to the live fan-out; a failure is logged (followers read the journal)."""
    fanout = ctx.fanout
    if fanout is None:
        return
    try:
        if hasattr(fanout, "publish_many"):
            await fanout.publish_many(invocation_id, items)
        else:
            for seq, data, final in items:
                await fanout.publish(invocation_id, seq, data, final)
    except Exception:
        log.warning("live publish of %s (%d frame(s)) failed; followers catch up from the journal",
                    invocation_id, len(items), exc_info=True)  # fmt: skip
