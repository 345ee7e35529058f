"""Producer routes (msgpack): submit, await, status, cancel and topic posts.

A producer acts in one namespace (``authz.confined_to``): its submits land there, and an
invocation of another namespace is unknown to it (404). A submit is checked before it is queued:
run_config limits (``store.values.check_run_config``, 400) and a script's permission
(``authz.check_submit``, 403), then written through the group commit (``ctx.write``) and
answered once committed. A namespace's ``max_queued`` quota is checked early here and held
strictly in the submit's own transaction (server/quotas.py). The result and topic streams live in
``server.streams``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

from starlette.requests import Request

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import PlaneError, QuotaExceeded
from dreamlake.lakeshore.server import authz, http, secrets, tasks
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.server.liveness import placement_warning
from dreamlake.lakeshore.server.quotas import answer as quota_answer
from dreamlake.lakeshore.store.api import (
    DEFAULT_NAMESPACE,
    TERMINAL_STATES,
    Invocation,
    SubmitRequest,
    SubmitResult,
    visible,
)
from dreamlake.lakeshore.store.notify import invocation_channels
from dreamlake.lakeshore.store.placement import needs_of
from dreamlake.lakeshore.store.values import check_run_config

log = logging.getLogger(__name__)
_QUOTA_GROUPS = itertools.count(1)  # a submit-batch's ``quota_group``: its items queued all or none


def check_config(caller: Caller, run_config: dict[str, Any]) -> None:
    """A submit's ``run_config``: string keys and limits in range (400), a script only from a
    token that may submit one (403)."""
    for key in run_config:
        if not isinstance(key, str):
            raise HTTPError(400, "run_config keys must be strings")
    http.bound_document(run_config, "run_config")
    try:
        check_run_config(run_config)
    except PlaneError as exc:
        raise HTTPError(400, str(exc)) from None
    authz.check_submit(caller, run_config)


def submit_request(
    ctx: Context, caller: Caller, body: dict[str, Any], *, checked: object = None
) -> tuple[SubmitRequest, float | None]:
    """A submit body checked (400, 403 for a script without ``may_script``, 413 over the inline
    threshold) into its store request and its ``wait_s`` (None: answer at once). The one check
    of ``/v1/producer/submit`` and of each item of ``/v1/producer/submit-batch``; ``checked`` is
    a ``run_config`` object :func:`check_config` passed already (a batch's shared one, checked
    once for all of its items)."""
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    run_config = field(body, "run_config", dict, default={})
    queue = body.get("queue")
    if queue is None:
        queue = run_config.get("queue") or "default"
    queue = http.name(queue, "queue")
    function = http.document(body, "function")
    namespace = caller.namespace or DEFAULT_NAMESPACE
    raw_ref = field(body, "args_ref", dict, default=None, nullable=True)
    args_ref = (
        None if raw_ref is None else ctx.ref(raw_ref, "args_ref", namespace, legacy=caller.namespace is None)
    )
    args_blob = field(body, "args_blob", bytes, default=b"" if args_ref is not None else http.MISSING)
    if args_ref is not None and args_blob:
        raise HTTPError(
            400, "send args_blob or args_ref, not both (args_ref for an Envelope over the threshold)"
        )
    ctx.check_inline("args_blob", len(args_blob), namespace, "args_ref")
    code_context = http.document(body, "code_context", default={})
    parent = http.ulid_field(body, "parent_invocation_id", optional=True)
    if run_config is not checked:
        check_config(caller, run_config)
    wait_s = None
    if body.get("wait_s") is not None:
        wait_s = http.number(body, "wait_s", 0.0, lo=0.0, hi=ctx.config.await_max_s)
    req = SubmitRequest(
        invocation_id=invocation_id,
        queue=queue,
        function=function,
        args_blob=args_blob,
        run_config=dict(run_config),
        code_context=code_context,
        parent_invocation_id=parent,
        namespace=namespace,
        args_ref=args_ref,
    )
    return req, wait_s


def _submitted(
    ctx: Context, req: SubmitRequest, result: SubmitResult, *, count: bool = True
) -> dict[str, Any]:
    """The answer of a committed submit, counted (unless the caller counts a batch at once); its
    waiters woken when the store notifies none."""
    if count:
        ctx.metrics.submitted(result.duplicate)
    if ctx.wake.own and not result.duplicate:
        for channel in invocation_channels(
            req.namespace, result.queue, needs_of(req.run_config, req.namespace or DEFAULT_NAMESPACE).key()
        ):
            ctx.wake.notify(channel)
    out: dict[str, Any] = {"invocation_id": result.invocation_id, "queue": result.queue}
    if result.duplicate:
        out["duplicate"] = True
    return out


async def _placement_warning(ctx: Context, queue: str, req: SubmitRequest) -> str | None:
    """The warning for a call no live worker of ``queue`` could take (server/liveness.py)."""
    needs = needs_of(req.run_config, req.namespace or DEFAULT_NAMESPACE)
    if not (needs.gpus or needs.selector or needs.memory or needs.cpus):
        return None
    namespace = req.namespace or DEFAULT_NAMESPACE  # the workers that may claim it (waiting.py)
    infos = await ctx.call(ctx.store.live_workers_of, queue, namespace=namespace)
    return placement_warning(queue, needs, infos)


async def check_parent(ctx: Context, caller: Caller, parent: str | None) -> None:
    """404 unless ``parent`` (a submit's ``parent_invocation_id``) is an invocation the caller
    sees: a producer cannot hang its call under another namespace's invocation (where the other
    tenant's status would list it and its cancel would cancel it). Unknown and foreign answer
    alike. A task's parent is its own invocation (``tasks.own_child``); an admin's is unchecked."""
    if parent is None or caller.rule is not authz.Own.NAMESPACE:
        return
    inv = await ctx.call(ctx.store.get, parent)
    if inv is None or not visible(caller.namespace, inv):
        raise HTTPError(
            404,
            f"unknown parent_invocation_id '{parent}' (a parent must be an invocation of namespace "
            f"'{caller.namespace}')",
        )


async def submit(ctx: Context, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    req, wait_s = submit_request(ctx, caller, body)
    await check_parent(ctx, caller, req.parent_invocation_id)
    if req.run_config.get("secrets"):  # every name must be a secret of its namespace (400 naming it)
        refused = secrets.unknown_secret(
            req.namespace, req.run_config, await secrets.missing(ctx, req.namespace, [req.run_config])
        )
        if refused is not None:
            raise refused
    # 429 early when already full; the store holds the submit to the limit in its transaction
    req.max_queued = await ctx.quotas.check_queued(req.namespace, 1)
    mark = ctx.wake.mark()  # before the write: a submit-and-wait misses no wake-up after its commit
    result = await ctx.write(req)
    assert isinstance(result, SubmitResult)
    out = _submitted(ctx, req, result)
    log.debug("submitted %s to queue %s (duplicate=%s)", result.invocation_id, result.queue, result.duplicate)
    warning = await ctx.queue_warning(result.queue) or await _placement_warning(ctx, result.queue, req)
    if warning:
        out["warning"] = warning
        log.info("submitted %s: %s", result.invocation_id, warning)
    if wait_s is not None:
        if caller.rule is authz.Own.DESCENDANTS:  # a keyed duplicate may be no descendant of the task's
            await tasks.check_target(ctx, caller, result.invocation_id)
        deadline = time.monotonic() + wait_s
        acked = None if result.duplicate else await _acked(ctx, result.invocation_id, deadline, mark)
        if acked is not None:
            out["outcome"] = dict(acked)
        else:
            left = max(0.0, deadline - time.monotonic())
            out["outcome"] = await _await_answer(ctx, caller, result.invocation_id, left, warning)
    return out


async def _acked(ctx: Context, invocation_id: str, deadline: float, mark: int) -> dict[str, Any] | None:
    """The outcome of an invocation this request just made, when an ack of this process ends it
    soon (the warm path: claimed in the submit's own commit, run, acked): taken from the ack
    (``server/outcomes.py``: committed outcomes only), without reading the store. Waits for the
    first two wake-ups of ``inv:`` since ``mark`` (the submit's and its claim's, or the ack's);
    None when neither brought an ack's outcome: the caller then waits as ``await`` does (a
    cancel, a lapsed lease, an ack on another replica, a long run). ``deadline``: monotonic."""
    for _ in range(2):
        acked = await ctx.acks.outcome(invocation_id, 0.0)
        remaining = deadline - time.monotonic()
        if acked is not None or remaining <= 0 or ctx.closing:
            return acked
        since, mark = mark, ctx.wake.mark()
        if not await ctx.wake.wait(
            [f"inv:{invocation_id}"], min(remaining, ctx.config.recheck_s), since=since
        ):
            return None
    return await ctx.acks.outcome(invocation_id, max(0.0, deadline - time.monotonic()))


def _item_error(exc: HTTPError | PlaneError, body: Any) -> dict[str, Any]:
    """One refused item of a submit batch: the error text (and extra fields) the single submit
    answers, its status, and the item's invocation id when it had a readable one."""
    if isinstance(exc, QuotaExceeded):  # (items written alone after a failed group commit)
        exc = quota_answer(exc)  # its quota, limit and retry_after_s, as the whole batch's 429 has
    if isinstance(exc, HTTPError):
        out: dict[str, Any] = {"error": exc.message, "status": exc.status, **exc.extra}
    else:
        out = {"error": str(exc), "status": exc.status if isinstance(exc.status, int) else 500}
    inv = body.get("invocation_id") if isinstance(body, dict) else None
    if isinstance(inv, str) and len(inv) <= 64:
        out["invocation_id"] = inv
    return out


async def submit_batch(
    ctx: Context, caller: Caller, body: dict[str, Any], task: Invocation | None = None
) -> dict[str, Any]:
    """``POST /v1/producer/submit-batch``: many submits in one request and one group commit.

    ``submits`` is a list of submit bodies (each as ``/v1/producer/submit`` takes it, less
    ``wait_s``), ``common`` a map of fields every item takes unless it sets its own (the queue,
    ``function``, ``run_config`` of a sweep). Each item is checked as a single submit is and
    answers alone, in order: ``{invocation_id, queue[, duplicate]}`` or ``{error, status[,
    invocation_id]}`` with the single submit's error text; one item's refusal never fails another.
    The items that pass are written in one transaction, answered after its commit, and wake one
    poll each. ``task`` is the running invocation of a task token (its items are its children)."""
    items = field(body, "submits", list)
    common = http.document(body, "common", default={})
    cap = ctx.config.submit_batch_max
    if not items:
        raise HTTPError(400, "field 'submits' is empty: send a list of 1 to N submit bodies")
    if len(items) > cap:
        raise HTTPError(
            413,
            f"a batch of {len(items)} submits is over the limit of {cap} per request "
            f"(LAKESHORE_SUBMIT_BATCH_MAX); send it in chunks of at most {cap}",
            submit_batch_max=cap,
        )
    answers: list[dict[str, Any] | None] = [None] * len(items)
    reqs: list[SubmitRequest] = []
    where: list[int] = []
    parents_seen: set[str | None] = {None}  # each parent checked once (a sweep's all share one)
    shared = common.get("run_config")  # a sweep's: checked once, not per item
    try:
        if isinstance(shared, dict):
            check_config(caller, shared)
        else:
            shared = None
    except HTTPError:
        shared = None  # each item that takes it answers the error
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            err = HTTPError(400, f"submits[{i}] must be a map (a submit body), got {type(item).__name__}")
            answers[i] = _item_error(err, None)
            continue
        merged = {**common, **item} if common else item
        try:
            if merged.get("wait_s") is not None:
                raise HTTPError(
                    400,
                    "wait_s is not taken by submit-batch: await each invocation "
                    "(POST /v1/producer/await), or submit it alone with wait_s",
                )
            if task is not None:
                tasks.own_child(task, merged)
            req, _ = submit_request(ctx, caller, merged, checked=shared)
            if req.parent_invocation_id not in parents_seen:
                await check_parent(ctx, caller, req.parent_invocation_id)
                parents_seen.add(req.parent_invocation_id)
        except HTTPError as exc:
            answers[i] = _item_error(exc, merged)
            continue
        reqs.append(req)
        where.append(i)
    lacking = await secrets.missing(ctx, caller.namespace or DEFAULT_NAMESPACE, [r.run_config for r in reqs])
    if lacking:  # the items naming a secret their namespace lacks answer 400, the others go on
        kept = []
        for i, req in zip(where, reqs, strict=True):
            refused = secrets.unknown_secret(req.namespace, req.run_config, lacking)
            if refused is not None:
                answers[i] = _item_error(refused, items[i])
            else:
                kept.append((i, req))
        where, reqs = [i for i, _ in kept], [r for _, r in kept]
    if reqs:  # the batch is queued whole or not at all past the namespace's quota
        limit = await ctx.quotas.check_queued(reqs[0].namespace, len(reqs))
        if limit is not None:  # held in the store's transaction, the batch as one (server/quotas.py)
            group = next(_QUOTA_GROUPS)
            for req in reqs:
                req.max_queued, req.quota_group = limit, group
    results = await ctx.write_many(list(reqs))
    over = next((r for r in results if isinstance(r, QuotaExceeded)), None)
    if over is not None and not any(isinstance(r, SubmitResult) for r in results):
        raise quota_answer(over)  # the store refused the batch whole: nothing of it was queued
    queues: dict[str, None] = {}
    counts = [0, 0]  # new, duplicate
    for i, req, result in zip(where, reqs, results, strict=True):
        if isinstance(result, SubmitResult):
            answers[i] = _submitted(ctx, req, result, count=False)
            counts[result.duplicate] += 1
            queues[result.queue] = None
        else:
            assert isinstance(result, PlaneError)  # a submit's write answers a SubmitResult or this
            answers[i] = _item_error(result, items[i])
    for duplicate, n in enumerate(counts):
        if n:
            ctx.metrics.submitted(bool(duplicate), n)
    out: dict[str, Any] = {"results": answers}
    warnings = {}
    for queue in queues:
        warning = await ctx.queue_warning(queue)
        if warning:
            warnings[queue] = warning
    if warnings:
        out["warnings"] = warnings
        log.info("submitted a batch of %d: %s", len(reqs), "; ".join(warnings.values()))
    log.debug("submitted a batch: %d of %d items passed its checks", len(reqs), len(items))
    return out


def outcome(inv: Invocation) -> dict[str, Any]:
    """``{state, result_blob, error}``, with ``result_ref`` (and no bytes) for a result that went
    to the payload store."""
    out = {"state": inv.state, "result_blob": inv.result_blob, "error": inv.error}
    if inv.result_ref is not None:
        out["result_ref"] = inv.result_ref
    return out


async def wait_terminal(ctx: Context, caller: Caller, invocation_id: str, timeout: float) -> Invocation:
    """The invocation once terminal, or as it stands after ``timeout``; 404 when the caller may
    not see it. Woken by an ack of this process, it takes the outcome from the ack in flight at
    its commit (``server/outcomes.py``) instead of reading the store again."""
    deadline = time.monotonic() + timeout
    inv: Invocation | None = None
    while True:
        mark = ctx.wake.mark()
        if inv is not None:
            acked = await ctx.acks.outcome(invocation_id, deadline - time.monotonic())
            if acked is not None:
                return dataclasses.replace(inv, **acked)
        inv = authz.see_invocation(caller, invocation_id, await ctx.call(ctx.store.get, invocation_id))
        if inv.state in TERMINAL_STATES:
            return inv
        remaining = deadline - time.monotonic()
        if remaining <= 0 or ctx.closing:  # the server stops: answer as it stands
            return inv
        await ctx.wake.wait([f"inv:{invocation_id}"], min(remaining, ctx.config.recheck_s), since=mark)


async def await_(ctx: Context, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    timeout = http.number(body, "timeout_s", ctx.config.await_default_s, lo=0.0, hi=ctx.config.await_max_s)
    return await _await_answer(ctx, caller, invocation_id, timeout)


async def _await_answer(
    ctx: Context, caller: Caller, invocation_id: str, timeout: float, warning: str | None = None
) -> dict[str, Any]:
    """What ``/v1/producer/await`` answers after waiting up to ``timeout``: the outcome, or
    ``{state: pending}`` (with the no-worker warning while queued)."""
    inv = await wait_terminal(ctx, caller, invocation_id, timeout)
    if inv.state not in TERMINAL_STATES:
        pending: dict[str, Any] = {"state": "pending"}
        if inv.state == "queued":
            warning = warning or await ctx.queue_warning(inv.queue)
            if warning:
                pending["warning"] = warning
        return pending
    return outcome(inv)


async def children(ctx: Context, invocation_id: str) -> list[dict[str, Any]]:
    """``[{invocation_id, state}]`` of the invocations ``invocation_id`` submitted, oldest first."""
    below = await ctx.call(ctx.store.descendants, invocation_id)
    return [{"invocation_id": i, "state": state} for i, parent, state in below if parent == invocation_id]


async def status(ctx: Context, caller: Caller, invocation_id: str) -> dict[str, Any]:
    inv = authz.see_invocation(caller, invocation_id, await ctx.call(ctx.store.get, invocation_id))
    out = inv.status()
    out["attempts"] = await ctx.call(ctx.store.attempts, invocation_id)
    out["children"] = await children(ctx, invocation_id)
    return out


async def cancel(
    ctx: Context, caller: Caller, invocation_id: str, *, descendants: bool = True
) -> dict[str, Any]:
    authz.see_invocation(caller, invocation_id, await ctx.call(ctx.store.get, invocation_id))
    return await request_cancel(ctx, invocation_id, descendants=descendants)


async def _cancel_one(ctx: Context, invocation_id: str) -> str | None:
    state = await ctx.call(ctx.store.cancel, invocation_id)
    if state is None:
        return None
    ctx.wake.notify(f"inv:{invocation_id}")
    if ctx.wake.own and state == "running":
        inv = await ctx.call(ctx.store.get, invocation_id)
        if inv is not None and inv.worker_id:
            ctx.wake.notify(f"worker:{inv.worker_id}")
    return state


async def request_cancel(ctx: Context, invocation_id: str, *, descendants: bool = True) -> dict[str, Any]:
    """Cancel an invocation the caller was found to see, and (``descendants``, the default) every
    descendant not yet finished: the tasks it submitted, the ones they submitted, ... Wakes their
    waiters and workers. The answer counts the descendants reached (``descendants_cancelled``,
    present when there were any)."""
    state = await _cancel_one(ctx, invocation_id)
    if state is None:
        raise HTTPError(404, f"unknown invocation '{invocation_id}'")
    out: dict[str, Any] = {"invocation_id": invocation_id, "state": state}
    if descendants:
        below = await ctx.call(ctx.store.descendants, invocation_id)
        reached = 0
        for child, _parent, child_state in below:
            if child_state not in TERMINAL_STATES and await _cancel_one(ctx, child) is not None:
                reached += 1
        if reached:
            out["descendants_cancelled"] = reached
    return out


async def topic_post(ctx: Context, caller: Caller, topic: str, body: dict[str, Any]) -> dict[str, Any]:
    """Append to ``topic``; a post that makes it records the caller's namespace as the topic's
    (429 past that namespace's ``max_topics``, server/quotas.py)."""
    payload = field(body, "body", bytes)
    final = field(body, "final", bool, default=False)
    namespace = caller.namespace or DEFAULT_NAMESPACE
    await ctx.quotas.check_topic(namespace, topic)
    frame = await ctx.call(ctx.store.topic_append, topic, payload, final, namespace=namespace)
    ctx.wake.notify(f"topic:{topic}")
    ctx.metrics.frames_appended((wire.FRAME_END if frame.final else wire.FRAME_VALUE,), owner="topic")
    if ctx.fanout is not None:
        # Row first (above), then live publish; a fan-out failure never fails the post.
        try:
            await ctx.fanout.publish(f"topic:{topic}", frame.seq, frame.data, frame.final)
        except Exception:
            log.warning("live publish of topic %s seq %d failed; followers catch up from the journal",
                        topic, frame.seq, exc_info=True)  # fmt: skip
    return {"seq": frame.seq}


def request_id(request: Request, key: str, what: str) -> str:
    return http.ulid(request.path_params[key], what)
