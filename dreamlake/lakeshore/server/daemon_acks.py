"""The daemon's acks: the ``ack`` route and the acks a poll carries.

An ack names the invocation, its state (``ACK_STATES``), the worker and attempt that hold the
lease, and the result (``result_blob`` inline, or ``result_ref`` in the payload store) or the
error. It writes through the group commit (``ctx.write``), which applies the lease checks (409 a
superseded attempt or lapsed lease, 403 another worker's lease, 404 an unknown invocation), and is
answered once committed; the producers waiting on the invocation get its outcome
(``ctx.acks``) and its live followers are poked, so a stream that ends without a final frame ends
at once. A poll may carry up to :data:`MAX_POLL_ACKS` acks (:func:`_poll_acks`), each checked and
answered as the route would (:func:`_answer_acks`), committed with the poll's claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.server import http
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context, answer_of
from dreamlake.lakeshore.server.daemon_checks import _attempt, _refused, _worker, log
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.store.api import ACK_STATES, UNKNOWN, AckRequest, AckResult, WriteResult
from dreamlake.lakeshore.store.outage import StoreOutage
from dreamlake.lakeshore.store.values import json_safe


def _error_info(body: dict[str, Any]) -> dict[str, Any] | None:
    error = body.get("error")
    if error is None or error == "":
        return None
    if isinstance(error, str):
        return {"type": "DaemonError", "message": error}
    if not isinstance(error, dict):
        raise HTTPError(
            400,
            f"field 'error' must be a map {{type, message, traceback?}} or a string, "
            f"got {type(error).__name__}",
        )
    if not all(isinstance(k, str) for k in error):
        raise HTTPError(400, "field 'error' must have string keys")
    return error


async def ack(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    state = field(body, "state", str)
    if state not in ACK_STATES:
        raise HTTPError(400, f"cannot ack state {state[:40]!r}: use one of {', '.join(sorted(ACK_STATES))}")
    result_blob = field(body, "result_blob", bytes, default=None, nullable=True)
    raw_ref = field(body, "result_ref", dict, default=None, nullable=True)
    result_ref = None if raw_ref is None else ctx.ref(raw_ref, "result_ref")
    error = _error_info(body)
    attempt = _attempt(body)
    worker_id = await _worker(ctx, caller, body)
    if result_ref is not None and result_blob:
        raise HTTPError(400, "send result_blob or result_ref, not both")
    ctx.check_inline("result_blob", len(result_blob or b""), caller.namespace or ":ns", "result_ref")
    return await _ack(ctx, caller, worker_id, invocation_id, state, attempt, result_blob, error, result_ref)


MAX_POLL_ACKS = 256


def _poll_acks(ctx: Context, caller: Caller, worker_id: str, body: dict[str, Any]) -> list[_PollAck]:
    """The ``acks`` a poll carries (``[{invocation_id, state, attempt, result_blob?, error?}]``,
    each of ``worker_id``'s leases), each checked as the ack route checks it: an ack to write, or
    the answer of one that failed its check (:func:`_answer_acks` answers them all, in order)."""
    acks = field(body, "acks", list, default=[])
    if len(acks) > MAX_POLL_ACKS:
        raise HTTPError(400, f"field 'acks' lists {len(acks)} acks; the limit is {MAX_POLL_ACKS}")
    out = []
    for item in acks:
        inv = str(item.get("invocation_id", ""))[:64] if isinstance(item, dict) else ""
        try:
            if not isinstance(item, dict):
                raise HTTPError(
                    400, "field 'acks' must list maps {invocation_id, state, attempt, result_blob?, error?}"
                )
            invocation_id = http.ulid_field(item, "invocation_id")
            assert invocation_id is not None
            state = field(item, "state", str)
            if state not in ACK_STATES:
                raise HTTPError(
                    400, f"cannot ack state {state[:40]!r}: use one of {', '.join(sorted(ACK_STATES))}"
                )
            blob = field(item, "result_blob", bytes, default=None, nullable=True)
            raw = field(item, "result_ref", dict, default=None, nullable=True)
            ref = None if raw is None else ctx.ref(raw, "result_ref")
            if ref is not None and blob:
                raise HTTPError(400, "send result_blob or result_ref, not both")
            ctx.check_inline("result_blob", len(blob or b""), caller.namespace or ":ns", "result_ref")
            request = AckRequest(
                invocation_id, state, _attempt(item), worker_id, blob, _error_info(item), ref
            )
        except HTTPError as exc:
            out.append(_PollAck(inv, None, {"status": exc.status, "ok": False, "error": exc.message}))
        else:
            out.append(_PollAck(inv, request, None))
    return out


@dataclasses.dataclass
class _PollAck:
    """One ack a poll carries: the write it makes (None when it failed its check) or its answer."""

    invocation_id: str
    request: AckRequest | None
    answer: dict[str, Any] | None


def _answer_acks(
    ctx: Context,
    caller: Caller,
    acks: list[_PollAck],
    results: list[WriteResult | PlaneError],
    flights: list[asyncio.Future[Any]],
) -> tuple[list[dict[str, Any]], PlaneError | None]:
    """The answers of a poll's acks, whose writes committed with ``results`` (those of the acks
    that passed their checks, in order, each with its ``ctx.acks.begin`` in ``flights``, all
    ended here): ``{invocation_id, status, ok, duplicate?, error?}`` (status: the ack route's)
    per ack sent; and the first store failure (5xx) among them, None when none failed. An ack
    the store failed is answered 500, to be sent again (``HttpDispatch.claim_batch`` does)."""
    out = []
    failed: PlaneError | None = None
    written = iter(zip(results, flights, strict=True))
    for ack in acks:
        if ack.request is None:
            assert ack.answer is not None
            out.append({"invocation_id": ack.invocation_id, **ack.answer})
            continue
        result, flight = next(written)
        try:
            status, answer = _ack_settled(ctx, caller, ack.request, result, flight)
        except HTTPError as exc:
            status, answer = exc.status, {"ok": False, "error": exc.message}
        except PlaneError as exc:
            failed = failed or exc
            status = 503 if isinstance(exc, StoreOutage) else 500  # the store is down, or a bug
            answer = {"ok": False, "error": f"{exc}; send the ack again"}
        out.append({"invocation_id": ack.invocation_id, "status": status, **answer})
    return out, failed


async def _poke_all(ctx: Context, acks: list[_PollAck], answers: list[dict[str, Any]]) -> None:
    """The live followers of every invocation a poll's acks ended, told at once."""
    done = [a.invocation_id for a, out in zip(acks, answers, strict=True) if out.get("ok")]
    if len(done) == 1:  # the warm path's one ack: no task to gather
        await _poke(ctx, done[0])
    elif done:
        await asyncio.gather(*(_poke(ctx, inv) for inv in done))


async def _ack(
    ctx: Context,
    caller: Caller,
    worker_id: str,
    invocation_id: str,
    state: str,
    attempt: int,
    result_blob: bytes | None,
    error: dict[str, Any] | None,
    result_ref: dict[str, Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Write one checked ack through the group commit and answer as the ack route does."""
    request = AckRequest(invocation_id, state, attempt, worker_id, result_blob, error, result_ref)
    flight = ctx.acks.begin(invocation_id)
    try:
        (result,) = await ctx.write_many([request], settle_flights(ctx, [request], [flight]))
    except BaseException:
        ctx.acks.end(invocation_id, flight, None)
        raise
    status, answer = _ack_settled(ctx, caller, request, result, flight)
    if answer.get("ok"):
        await _poke(ctx, invocation_id)
    return status, answer


def _outcome(request: AckRequest, result: WriteResult | PlaneError) -> dict[str, Any] | None:
    """What a producer waiting on the acked invocation gets from memory: the outcome as the store
    keeps it (an empty blob is None, the error JSON-safe); None when the ack was refused or
    failed, or is no outcome (a failure that queued a retry: ``result.state`` "queued")."""
    if (
        not isinstance(result, AckResult)
        or not result.ok
        or result.duplicate
        or result.state != request.state
    ):
        return None
    committed = {
        "state": request.state,
        "result_blob": request.result_blob or None,
        "error": None if request.error is None else json_safe(request.error, "error"),
    }
    if request.result_ref is not None:  # the result is in the payload store (producer.outcome's shape)
        committed["result_ref"] = request.result_ref
    return committed


def settle_flights(
    ctx: Context, writes: list[AckRequest], flights: list[asyncio.Future[Any]]
) -> Callable[[list[Any]], None]:
    """What the group commit calls with the results of ``writes`` (and of any write after them)
    the moment it answers them: each ack's flight ended with its outcome, so a producer waiting on
    it is answered at the commit, not after the acking route has gone on (the route's
    ``_ack_settled`` finds its flight ended)."""

    def settle(results: list[Any]) -> None:
        for request, result, flight in zip(writes, results, flights, strict=False):  # then the pass
            if not flight.done():
                ctx.acks.end(request.invocation_id, flight, _outcome(request, result))

    return settle


def _ack_settled(
    ctx: Context,
    caller: Caller,
    request: AckRequest,
    result: WriteResult | PlaneError,
    flight: asyncio.Future[Any],
) -> tuple[int, dict[str, Any]]:
    """Answer one committed ack as the ack route does, and hand its outcome to the producers
    waiting on it (``flight``: the ``ctx.acks.begin`` made before its write, ended here). The
    live followers are the caller's to poke (``_poke``)."""
    invocation_id, state = request.invocation_id, request.state
    if not flight.done():  # not ended at the commit already (``settle_flights``)
        ctx.acks.end(invocation_id, flight, _outcome(request, result))
    if isinstance(result, PlaneError):
        raise answer_of(result)
    assert isinstance(result, AckResult)
    if result.ok:
        ctx.metrics.child(ctx.metrics.acks, state, "duplicate" if result.duplicate else "ok").inc()
        ctx.wake.notify(f"inv:{invocation_id}")
        log.debug("ack %s %s (attempt %s)", invocation_id, state, request.attempt)
        return 200, ({"ok": True, "duplicate": True} if result.duplicate else {"ok": True})
    if result.status == UNKNOWN:
        ctx.metrics.acks.labels(state=state, outcome="unknown").inc()
        raise HTTPError(404, result.reason or f"unknown invocation '{invocation_id}'", ok=False)
    ctx.metrics.acks.labels(state=state, outcome="refused").inc()
    reason = result.reason or "ack refused: the attempt was superseded"
    _refused(caller, "ack", invocation_id, result.status, reason)
    return result.status, {"ok": False, "error": reason}


async def _poke(ctx: Context, invocation_id: str) -> None:
    """Tell the live followers of ``invocation_id`` to re-read the store (its state changed)."""
    poke = getattr(ctx.fanout, "poke", None)
    if poke is None:
        return
    try:
        await poke(invocation_id)
    except Exception:
        log.warning("live poke of %s failed", invocation_id, exc_info=True)
