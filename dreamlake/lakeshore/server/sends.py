"""Two-way generators: what a consumer sends into a paused remote body, and nymph fetching it.

``POST /v1/producer/invocations/:id/send`` (the invocation's owner: its namespace's producer, or a
task whose descendant it is) takes ``{index, kind, body}``: the answer to the body's yield
``index`` (the ``send`` of that VALUE frame's meta). ``kind`` is ``value`` (``body``: the
``wire.pack`` of the value), ``throw`` (``body``: ``{type, message}``, raised in the body at that
yield) or ``close`` (``GeneratorExit`` at that yield; the last send). It is journaled under
``send:<id>`` (store/frames.py, ``send_append``: in order, a repeat with the same bytes is a
duplicate, at most ``SEND_WINDOW`` yields ahead of the body, only into a two-way call) as an
encoded frame (VALUE, ERROR, END) whose seq is the index (twoway.encode_send), and the daemon
holding the invocation is woken. Answers ``{ok}`` (``duplicate`` on a repeat), 409 ``{ok: false,
error, expected_index}`` when refused.

``POST /v1/daemon/sends`` (the worker holding the lease) takes ``{invocation_id, attempt,
worker_id, since, wait_s}`` and answers ``{frames: [bytes, ...]}``: the sends after ``since``,
waiting up to ``wait_s`` for the first one (an empty list after that). nymph writes them to the
task's workdir, where the entry reads them (docs/protocol.md, "Two-way streams").
"""

from __future__ import annotations

import time
from typing import Any

from dreamlake.lakeshore import twoway
from dreamlake.lakeshore.server import authz, http
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.store.api import UNKNOWN
from dreamlake.lakeshore.store.frames import SEND_PREFIX
from dreamlake.lakeshore.store.invocations import lease_refusal

PAGE = 64
MAX_WAIT_S = 60.0


async def send(
    ctx: Context, caller: Caller, invocation_id: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """Journal one send into the two-way body of ``invocation_id`` (see the module docstring)."""
    index = http.integer(body, "index", hi=http.I32_MAX)
    kind = field(body, "kind", str, default="value")
    authz.see_invocation(caller, invocation_id, await ctx.call(ctx.store.get, invocation_id))
    value = body.get("body")
    if kind == "value":
        value = field(body, "body", bytes)
        ctx.check_inline("the sent value", len(value), caller.namespace or ":ns", "a smaller value")
    try:
        data = twoway.encode_send(index, kind, value)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None
    result = await ctx.call(ctx.store.send_append, invocation_id, index, data, kind == "close")
    if not result.ok:
        out: dict[str, Any] = {"ok": False, "error": result.reason or "send refused"}
        if result.expected_seq is not None:
            out["expected_index"] = result.expected_seq
        return (404 if result.status == UNKNOWN else result.status), out
    ctx.wake.notify(SEND_PREFIX + invocation_id)
    return 200, ({"ok": True, "duplicate": True} if result.duplicate else {"ok": True})


async def fetch(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The sends into an invocation this daemon's worker holds, after ``since`` (long-poll)."""
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    attempt = http.integer(body, "attempt", hi=http.I32_MAX)
    worker_id = http.ulid_field(body, "worker_id")
    assert worker_id is not None
    await ctx.workers.check(caller, worker_id)
    since = field(body, "since", int, default=-1)
    if not -1 <= since <= http.I32_MAX:
        raise HTTPError(400, f"field 'since' must be the last index fetched (-1: none), got {since}")
    wait_s = http.number(body, "wait_s", 30.0, lo=0.0, hi=MAX_WAIT_S)
    owner = SEND_PREFIX + invocation_id
    deadline = time.monotonic() + wait_s
    while True:
        mark = ctx.wake.mark()
        inv = await ctx.call(ctx.store.get, invocation_id)
        if inv is None:
            raise HTTPError(404, f"unknown invocation {invocation_id}", ok=False)
        refused = lease_refusal(inv, attempt, worker_id)
        if refused is not None:
            return refused[0], {"ok": False, "error": refused[1]}
        frames = await ctx.call(ctx.store.read_frames, owner, since, PAGE)
        remaining = deadline - time.monotonic()
        if frames or remaining <= 0:
            return 200, {"ok": True, "frames": [f.data for f in frames]}
        await ctx.wake.wait([owner], min(remaining, ctx.config.recheck_s), since=mark)
