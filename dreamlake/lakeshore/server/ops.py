"""Operator routes (JSON, ``/v1/ops/*``): who am I, queues, workers, invocations, one invocation's
detail, cancel; and the store gauges ``GET /metrics`` renders.

Who sees what (docs/protocol.md, "Operator routes"): an ``admin`` token sees every namespace (and
may narrow with ``?namespace=``); a ``producer`` token sees its own namespace (``default`` when it
is bound to none, where its submits land); a ``namespace`` token its namespace. Workers bound to
another namespace and invocations of another namespace are invisible: an invocation of another
namespace answers 404, exactly like an unknown id. ``daemon`` and ``metrics`` tokens get 403.

The JSON shapes are built here once (``queue_json``, ``worker_json``, ``invocation_json``,
``detail_json``) and shared by the dashboard (``server/ui``) and the ``lakeshore`` CLI's
``--json`` output.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from dreamlake.lakeshore.server import authz, producer, waiting
from dreamlake.lakeshore.server import http as h
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.daemon import server_limits
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.states import STATES
from dreamlake.lakeshore.store.api import (
    LIST_LIMIT_MAX,
    LIVE_WINDOW_S,
    TERMINAL_STATES,
    FrameStats,
    Invocation,
    Principal,
    QueueStats,
    WorkerRow,
)
from dreamlake.lakeshore.store.api import visible as store_visible
from dreamlake.lakeshore.store.placement import shown_key
from dreamlake.lakeshore.version import __version__

Handler = Callable[[Request], Awaitable[Response]]


def scope(principal: Principal) -> str | None:
    """The namespace a principal sees (``authz.confined_to``); None for an admin (every namespace)."""
    return authz.confined_to(principal)


def visible(principal: Principal, inv: Invocation | None) -> Invocation | None:
    """``inv`` when the principal may see it; None (answered 404) otherwise."""
    if inv is None or not store_visible(scope(principal), inv):
        return None
    return inv


# -- JSON shapes -----------------------------------------------------------------------------------


def queue_json(q: QueueStats, now: float, max_running: int | None = None) -> dict[str, Any]:
    return {
        "name": q.name,
        "counts": q.counts,
        "queued": q.counts.get("queued", 0),
        "running": q.counts.get("running", 0),
        "oldest_queued_age_s": round(now - q.oldest_queued_at, 3) if q.oldest_queued_at else None,
        "workers_live": q.workers_live,
        "max_running": max_running,  # the fleet-wide limit (lakeshore queue limit); None: none
    }


def worker_json(w: WorkerRow, now: float, live_within: float = LIVE_WINDOW_S) -> dict[str, Any]:
    info = w.info
    slots = info.get("slots")
    return {
        "worker_id": w.worker_id,
        "hostname": info.get("hostname", ""),
        "runner": info.get("runner", ""),
        "queues": info.get("queues", []),
        "slots": slots if isinstance(slots, int) else None,
        "busy": w.busy,
        "version": info.get("version", ""),
        "labels": info.get("labels", {}),
        "namespace": info.get("namespace"),
        "allow_pickled": info.get("allow_pickled"),  # None: it did not say (an SDK worker, an old nymph)
        "registered_at": w.registered_at,
        "last_seen": w.last_seen,
        "last_seen_age_s": round(max(0.0, now - w.last_seen), 3),
        "live": now - w.last_seen <= live_within and w.stopped_at is None,
        "stopped_at": w.stopped_at,  # a clean stop deregistered it then (not live since)
        "capacity": capacity_json(info.get("capacity")),
        "free": {  # what it has free now: slots from what it runs, GPUs from its latest poll's offer
            "slots": max(0, slots - w.busy) if isinstance(slots, int) else None,
            "gpus": w.free_gpus,
        },
    }


def capacity_json(capacity: Any) -> dict[str, Any] | None:
    """What a worker registered it has (docs/protocol.md "Placement"); None: it said nothing."""
    if not isinstance(capacity, dict):
        return None
    gpus = [g for g in capacity.get("gpus") or [] if isinstance(g, dict)]
    return {
        "cpus": capacity.get("cpus"),
        "memory_mb": capacity.get("memory_mb"),
        "gpus": len(gpus),
        "gpu_models": sorted({str(g.get("model")) for g in gpus if g.get("model")}),
        "gpu_memory_mib": [g.get("memory_mib") for g in gpus],
        "arch": capacity.get("arch"),
        "os": capacity.get("os"),
    }


def _error_summary(error: Any) -> dict[str, Any] | None:
    if not isinstance(error, dict):
        return None
    return {"type": error.get("type"), "message": error.get("message")}


def invocation_json(inv: Invocation) -> dict[str, Any]:
    """One row of a listing: no arguments, no result, the error without its traceback."""
    return {
        "invocation_id": inv.invocation_id,
        "queue": inv.queue,
        "state": inv.state,
        "namespace": inv.namespace,
        "priority": inv.priority,
        "attempt": inv.attempt,
        "max_attempts": inv.max_attempts,
        "worker_id": inv.worker_id,
        "submitted_at": inv.submitted_at,
        "started_at": inv.started_at,
        "finished_at": inv.finished_at,
        "cancel_requested": inv.cancel_requested,
        "error": _error_summary(inv.error),
        "sweep": _sweep(inv.run_config),  # the map it belongs to (store/activity.py), if any
    }


def _sweep(run_config: Any) -> str | None:
    sweep = run_config.get("sweep") if isinstance(run_config, dict) else None
    return sweep if isinstance(sweep, str) else None


def attempts(inv: Invocation, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every attempt with its outcome, from ``history`` (``store.attempts``: the retried failures
    and lapsed leases the store kept, then the current attempt from the row). An attempt with no
    record (a lease that lapsed before the store kept attempts) shows as ``lease_expired``."""
    if history is None:
        history = [] if inv.attempt < 1 else [_current(inv)]
    kept = {a["attempt"]: a for a in history}
    out: list[dict[str, Any]] = []
    for n in range(1, inv.attempt + 1):
        a = kept.get(n)
        out.append(_attempt_json(a) if a is not None else _attempt_json({"attempt": n, "state": "lost"}))
    return out


def _current(inv: Invocation) -> dict[str, Any]:
    return {
        "attempt": inv.attempt,
        "state": inv.state,
        "worker_id": inv.worker_id,
        "started_at": inv.started_at,
        "finished_at": inv.finished_at,
        "error": inv.error,
    }


def _attempt_json(a: dict[str, Any]) -> dict[str, Any]:
    """One attempt for the detail: a lost lease (or a requeue with no record) is ``lease_expired``."""
    lost = a["state"] == "lost" or (a["state"] == "queued" and a.get("retry_at") is None)
    return {
        "attempt": a["attempt"],
        "outcome": "lease_expired" if lost else a["state"],
        "worker_id": a.get("worker_id"),
        "started_at": None if lost and a["state"] == "queued" else a.get("started_at"),
        "finished_at": a.get("finished_at"),
        "error": _brief(a.get("error")) if a["state"] not in ("running", "succeeded") else None,
        "retry_at": a.get("retry_at"),
    }


def _brief(error: dict[str, Any] | None) -> dict[str, Any] | None:
    return {"type": error.get("type"), "message": error.get("message")} if error else None


def function_of(inv: Invocation) -> dict[str, Any] | None:
    """``{kind, module, qualname, hash, code}`` of the Envelope's function, when the arguments are
    an Envelope: ``hash`` is the source hash of a function shipped by reference (``src_hash``,
    None when the submitter had no source) or the pickle's blob hash; ``code`` the sha256 of a
    code archive shipped with the call (None when none)."""
    from dreamlake.lakeshore.envelope import Envelope

    try:
        header = Envelope.header(inv.args_blob)
    except Exception:
        return None
    fn = header.get("fn")
    if not isinstance(fn, dict):
        return None
    out: dict[str, Any] = {k: fn.get(k) for k in ("kind", "module", "qualname") if isinstance(fn.get(k), str)}
    digest = fn.get("src_hash") if fn.get("kind") == "ref" else fn.get("hash")
    out["hash"] = digest if isinstance(digest, str) else None
    code = (header.get("cfg") or {}).get("code")
    out["code"] = (
        code.get("sha256") if isinstance(code, dict) and isinstance(code.get("sha256"), str) else None
    )
    return out


def timings(inv: Invocation, now: float) -> dict[str, float | None]:
    end = inv.finished_at if inv.finished_at is not None else now
    return {
        "wait_s": round(inv.started_at - inv.submitted_at, 3) if inv.started_at is not None else None,
        "run_s": round(end - inv.started_at, 3) if inv.started_at is not None else None,
        "total_s": round(end - inv.submitted_at, 3),
    }


def detail_json(
    inv: Invocation, frames: FrameStats, now: float, history: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``GET /v1/ops/invocations/:id``: the status, plus what an operator needs to judge a run."""
    out = inv.status()
    out.update(
        namespace=inv.namespace,
        run_config=inv.run_config,
        cancel_requested=inv.cancel_requested,
        lease_expires_at=inv.lease_expires_at,
        function=function_of(inv),
        attempts=attempts(inv, history),
        timings=timings(inv, now),
        frames={
            "count": frames.count,
            "last_seq": frames.last_seq,
            "first_at": frames.first_at,
            "last_at": frames.last_at,
        },
        terminal=inv.state in TERMINAL_STATES,
    )
    return out


# -- reads shared with the dashboard -------------------------------------------------------------


async def read_queues(ctx: Context, namespace: str | None) -> list[dict[str, Any]]:
    stats = await ctx.call(ctx.store.queue_stats, namespace)
    limits = (await ctx.call(ctx.store.limits))["queues"]
    now = time.time()
    return [queue_json(q, now, limits.get(q.name)) for q in stats]


async def read_key_limits(ctx: Context, namespace: str | None) -> list[dict[str, Any]]:
    """The concurrency keys' limits (``@dls.udf(concurrency_key=, max_concurrency=)``) and their
    calls running now. Keys belong to namespaces (``placement.scoped_key``): a namespace's caller
    sees its own keys by the names it gave them; a fleet-wide caller (None) sees every key as
    ``<namespace>/<key>``."""
    use = await ctx.call(ctx.store.key_limit_use)
    own = f"{namespace}/"
    return [
        {"key": shown_key(namespace, key), "max_concurrency": most, "running": n}
        for key, most, n in use
        if namespace is None or key.startswith(own)
    ]


async def read_workers(
    ctx: Context,
    namespace: str | None,
    *,
    live_only: bool = False,
    limit: int = 100,
    cursor: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    page = await ctx.call(
        ctx.store.list_workers,
        namespace,
        live_within=LIVE_WINDOW_S if live_only else None,
        limit=limit,
        cursor=cursor,
    )
    now = time.time()
    return [worker_json(w, now) for w in page.workers], page.next_cursor


async def read_invocations(
    ctx: Context,
    namespace: str | None,
    *,
    queue: str | None = None,
    states: list[str] | None = None,
    since: float | None = None,
    limit: int = 50,
    cursor: str | None = None,
    sweep: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    page = await ctx.call(
        ctx.store.list_invocations,
        namespace,
        queue=queue,
        states=states,
        since=since,
        limit=limit,
        cursor=cursor,
        sweep=sweep,
    )
    return [invocation_json(i) for i in page.invocations], page.next_cursor


async def read_detail(ctx: Context, principal: Principal, invocation_id: str) -> dict[str, Any]:
    inv = visible(principal, await ctx.call(ctx.store.get, invocation_id))
    if inv is None:
        raise HTTPError(404, f"unknown invocation '{invocation_id}'")
    frames = await ctx.call(ctx.store.frame_stats, invocation_id)
    history = await ctx.call(ctx.store.attempts, invocation_id)
    out = detail_json(inv, frames, time.time(), history)
    out["children"] = await producer.children(ctx, invocation_id)
    out["waiting"] = await waiting.why_waiting(ctx, inv)  # a queued call: why (server/waiting.py)
    return out


async def cancel(ctx: Context, principal: Principal, invocation_id: str) -> dict[str, Any]:
    if visible(principal, await ctx.call(ctx.store.get, invocation_id)) is None:
        raise HTTPError(404, f"unknown invocation '{invocation_id}'")
    return await producer.request_cancel(ctx, invocation_id)


async def observe_store(ctx: Context) -> None:
    """Refresh the store gauges of ``ctx.metrics`` (before ``GET /metrics`` renders them)."""
    stats = await ctx.call(ctx.store.queue_stats, None)
    live = await ctx.call(ctx.store.count_workers, LIVE_WINDOW_S)
    ctx.metrics.observe_store(stats, live)


# -- query parameters ------------------------------------------------------------------------------


def states_param(request: Request) -> list[str] | None:
    raw = request.query_params.get("state", "")
    if not raw:
        return None
    states = [s.strip() for s in raw.split(",") if s.strip()]
    bad = [s for s in states if s not in STATES]
    if bad:
        raise HTTPError(400, f"unknown state {bad[0][:40]!r}: use one or more of {', '.join(STATES)}")
    return states


def limit_param(request: Request, default: int) -> int:
    return int(h.query_number(request, "limit", default, lo=1, hi=LIST_LIMIT_MAX))


def sweep_param(request: Request) -> str | None:
    """``?sweep=<id>``: the calls of one ``map`` (``run_config.sweep``, a ULID)."""
    raw = request.query_params.get("sweep")
    return h.ulid(raw, "sweep") if raw else None


def cursor_param(request: Request, what: str) -> str | None:
    raw = request.query_params.get("cursor")
    return h.ulid(raw, f"{what} cursor") if raw else None


def queue_param(request: Request) -> str | None:
    raw = request.query_params.get("queue")
    return h.name(raw, "queue") if raw else None


def since_param(request: Request) -> float | None:
    raw = request.query_params.get("since")
    if not raw:
        return None
    return h.query_number(request, "since", 0.0, lo=0.0, hi=1e12)


# -- routes ----------------------------------------------------------------------------------------


class OpsRoutes:
    """The ``/v1/ops/*`` handlers; ``authz.ROUTES`` names them (``ops.<method>``) and ``app``
    serves them behind the table's verdict, with the caller's namespace as their scope."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def _scope(self, request: Request, caller: Caller) -> str | None:
        """The caller's namespace, or the ``?namespace=`` an admin narrows to (403 for another
        namespace than a confined caller's own)."""
        ns = caller.namespace
        asked = request.query_params.get("namespace")
        if asked:
            asked = h.name(asked, "namespace")
            if ns is not None and asked != ns:
                name = caller.principal.name
                raise HTTPError(403, f"token '{name}' sees namespace '{ns}' only, not '{asked}'")
            ns = asked
        return ns

    async def whoami(self, request: Request, caller: Caller) -> Response:
        principal = caller.principal
        return h.json_response(
            {"kind": principal.kind, "name": principal.name, "namespace": principal.namespace}
        )

    async def info(self, request: Request, caller: Caller) -> Response:
        """``GET /v1/ops/info``: the version and the limits this control plane decides (acks per
        poll, inline threshold, batch sizes), for any token: nothing here is a secret, and a
        client sizes its requests by it (``protocol.limits.ServerLimits``)."""
        return h.json_response({"version": __version__, "limits": server_limits(self.ctx)})

    async def queues(self, request: Request, caller: Caller) -> Response:
        ns = self._scope(request, caller)
        return h.json_response(
            {
                "queues": await read_queues(self.ctx, ns),
                # a concurrency key is its namespace's: the namespace's own keys, by their names
                "key_limits": await read_key_limits(self.ctx, ns),
                "live_window_s": LIVE_WINDOW_S,
            }
        )

    async def workers(self, request: Request, caller: Caller) -> Response:
        ns = self._scope(request, caller)
        live_only = request.query_params.get("live", "") in ("1", "true", "yes")
        rows, cursor = await read_workers(
            self.ctx,
            ns,
            live_only=live_only,
            limit=limit_param(request, 100),
            cursor=cursor_param(request, "worker"),
        )
        return h.json_response({"workers": rows, "next_cursor": cursor, "live_window_s": LIVE_WINDOW_S})

    async def invocations(self, request: Request, caller: Caller) -> Response:
        ns = self._scope(request, caller)
        rows, cursor = await read_invocations(
            self.ctx,
            ns,
            queue=queue_param(request),
            states=states_param(request),
            since=since_param(request),
            limit=limit_param(request, 50),
            cursor=cursor_param(request, "invocation"),
            sweep=sweep_param(request),
        )
        return h.json_response({"invocations": rows, "next_cursor": cursor})

    async def invocation(self, request: Request, caller: Caller) -> Response:
        inv = producer.request_id(request, "id", "invocation_id")
        return h.json_response(await read_detail(self.ctx, caller.principal, inv))

    async def cancel(self, request: Request, caller: Caller) -> Response:
        inv = producer.request_id(request, "id", "invocation_id")
        return h.json_response(await cancel(self.ctx, caller.principal, inv))

    async def queue_limit(self, request: Request, caller: Caller) -> Response:
        """``PUT /v1/ops/queues/:name/limit {"max_running": N}``: cap the calls of the queue
        running at once across the fleet (admins only: a queue's limit covers every namespace)."""
        queue = h.name(request.path_params["name"], "queue")
        body = h.decode_json(await h.read_body(request, self.ctx.config.max_body_bytes))
        if "max_running" not in body:
            raise HTTPError(400, "missing field 'max_running' (clear a limit with DELETE)")
        await self.ctx.call(self.ctx.store.set_queue_limit, queue, body["max_running"])
        return h.json_response({"queue": queue, "max_running": body["max_running"]})

    async def queue_limit_clear(self, request: Request, caller: Caller) -> Response:
        """``DELETE /v1/ops/queues/:name/limit``: no limit on the queue."""
        queue = h.name(request.path_params["name"], "queue")
        await self.ctx.call(self.ctx.store.set_queue_limit, queue, None)
        return h.json_response({"queue": queue, "max_running": None})
