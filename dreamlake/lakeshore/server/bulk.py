"""``POST /v1/producer/await-batch``: the outcomes of many invocations in one request, waiting on any.

A sweep reads its results through this route (the SDK's ``Calls.results()``, ``dls.wait`` and
``dls.as_completed``): one request answers up to ``AWAIT_BATCH_MAX`` ids, instead of one await
per call. The body is ``{invocation_ids: [...], timeout_s}``; the answer::

    {"results": [{invocation_id, state, result_blob | result_ref, error}, ...],   # terminal ones
     "states": {invocation_id: state, ...},   # not terminal yet (queued, running, ...), or a
                                              # terminal one left for the next request (see below)
     "unknown": [invocation_id, ...]}         # no such invocation, or not the caller's

It answers at once when one of the ids is terminal; otherwise it waits up to ``timeout_s`` for any
of them to end (woken by its commit, re-checked every ``recheck_s`` for other replicas' acks).
An id outside the caller's namespace (or, for a task token, outside its descendants) is answered
exactly as an id that does not exist: in ``unknown``, nothing about it disclosed. Results travel
inline up to ``AWAIT_BATCH_BYTES`` in all; the terminal ones past that are answered in ``states``
with their terminal state and come in full with the next request.
"""

from __future__ import annotations

import time
from typing import Any

from dreamlake.lakeshore.server import authz, http, tasks
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.store.api import TERMINAL_STATES, Outcome, visible

AWAIT_BATCH_MAX = 1000  # ids per request; past it: 413
AWAIT_BATCH_BYTES = 16 * 1024 * 1024  # inline result bytes one answer carries at most


async def _visible(ctx: Context, caller: Caller, found: list[Outcome]) -> list[Outcome]:
    """The invocations the caller may see: its namespace's; a task's descendants only."""
    if caller.rule is authz.Own.ANY:
        return found
    ns = caller.namespace
    mine = [inv for inv in found if visible(ns, inv)]
    if caller.rule is not authz.Own.DESCENDANTS:
        return mine
    out = []
    for inv in mine:
        try:
            await tasks.check_target(ctx, caller, inv.invocation_id)
        except HTTPError as exc:
            if exc.status != (caller.route.outside or 403):
                raise  # 401: the task's attempt ended
            continue
        out.append(inv)
    return out


def _result(inv: Outcome) -> dict[str, Any]:
    """One terminal outcome as the answer lists it (as ``producer.outcome`` writes an
    invocation's: ``result_ref``, and no bytes, for a result that went to the payload store)."""
    out: dict[str, Any] = {
        "invocation_id": inv.invocation_id,
        "state": inv.state,
        "result_blob": inv.result_blob,
        "error": inv.error,
    }
    if inv.result_ref is not None:
        out["result_ref"] = inv.result_ref
    return out


def _answer(ids: list[str], seen: list[Outcome]) -> tuple[dict[str, Any], bool]:
    """The route's answer for ``ids`` from the outcomes the caller may see; and whether any is
    terminal."""
    by_id = {inv.invocation_id: inv for inv in seen}
    results: list[dict[str, Any]] = []
    states: dict[str, str] = {}
    unknown: list[str] = []
    budget = AWAIT_BATCH_BYTES
    for inv_id in ids:
        inv = by_id.get(inv_id)
        if inv is None:
            unknown.append(inv_id)
        elif inv.state not in TERMINAL_STATES:
            states[inv_id] = inv.state
        else:
            size = len(inv.result_blob or b"")
            if results and size > budget:
                states[inv_id] = inv.state  # next request: this answer is full
                continue
            budget -= size
            results.append(_result(inv))
    return {"results": results, "states": states, "unknown": unknown}, bool(results)


async def await_batch(ctx: Context, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    raw = field(body, "invocation_ids", list)
    if not raw:
        raise HTTPError(400, "field 'invocation_ids' is empty: send a list of 1 to N invocation ids")
    if len(raw) > AWAIT_BATCH_MAX:
        raise HTTPError(
            413,
            f"{len(raw)} invocation ids are over the limit of {AWAIT_BATCH_MAX} per request; "
            f"send them in chunks of at most {AWAIT_BATCH_MAX}",
            await_batch_max=AWAIT_BATCH_MAX,
        )
    ids: list[str] = []
    for i, value in enumerate(raw):
        if not isinstance(value, str):
            raise HTTPError(400, f"invocation_ids[{i}] must be a str (an invocation id)")
        ids.append(http.ulid(value, f"invocation_ids[{i}]"))
    ids = list(dict.fromkeys(ids))
    timeout = http.number(body, "timeout_s", 0.0, lo=0.0, hi=ctx.config.await_max_s)
    deadline = time.monotonic() + timeout
    channels = [f"inv:{inv_id}" for inv_id in ids]
    while True:
        mark = ctx.wake.mark()
        seen = await _visible(ctx, caller, await ctx.call(ctx.store.outcomes, ids))
        answer, ended = _answer(ids, seen)
        remaining = deadline - time.monotonic()
        if ended or not answer["states"] or remaining <= 0 or ctx.closing:
            return answer
        await ctx.wake.wait(channels, min(remaining, ctx.config.recheck_s), since=mark)
