"""The control plane's ASGI app: ``create_app(store, ...)`` wires every route of docs/protocol.md.

The routes are the entries of ``authz.ROUTES`` (the one table of who may call what); handlers live
by audience in ``producer``, ``streams``, ``daemon``, ``namespaces`` and ``ops`` (operators' JSON
views; the ``/ui`` dashboard is ``server.ui``, behind its session cookie and the table's ``/ui``
entry). This module does what is common to all of them: authentication (401) and the table's
verdict (403) first, then ids (400), then the bounded body (413/400), then the handler, which
applies the caller's ownership rule; an :class:`~.http.HTTPError` becomes ``{"error": ...}`` in
the route's encoding, a client that hung up mid-body nothing, anything unexpected a logged 500. Long polls
are admitted up to ``max_polls`` (past it: 503 with ``Retry-After``). A store that is down (store/outage.py)
is a 503 with ``Retry-After`` and its cause, logged once per outage; ``/healthz`` reads the store and
says 503 while it cannot. Background tasks expire lapsed leases every second (paused while writes
fail and for a lease's length after: a heartbeat the store could not take costs no attempt) and,
over PostgreSQL, relay wake-ups between replicas (``server/relay.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from dreamlake.lakeshore.server import (
    authz,
    blobroutes,
    bulk,
    checkpoints,
    daemon,
    execout,
    hotroutes,
    namespaces,
    ops,
    producer,
    secrets,
    sends,
    streams,
    tasks,
)
from dreamlake.lakeshore.server import http as h
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.blobdir import BlobDir
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.server.context import Context, store_dialect
from dreamlake.lakeshore.server.fanout import LocalFanout
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.server.polls import PollsFull
from dreamlake.lakeshore.server.relay import PgRelay, libpq_dsn
from dreamlake.lakeshore.server.ui import Dashboard
from dreamlake.lakeshore.store.api import Store
from dreamlake.lakeshore.store.outage import Outages, StoreOutage, classify, probe

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
BLOB_PRUNE_EVERY_S = 3600.0
HEALTH_READ_S = 5.0  # /healthz's store read: longer is an outage


def _guard(fn: Handler, outages: Outages | None = None) -> Handler:
    """Turn HTTPError into an error answer, a store outage into a 503 with ``Retry-After`` (logged
    once per outage by ``outages``, store/outage.py) and anything unexpected into a logged 500."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except HTTPError as exc:
            if exc.status in (400, 413, 429):  # the caller's mistake or limit: one line, no traceback
                log.info("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message[:200])
            response = h.error_answer(request, exc)
            if "retry_after_s" in exc.extra:  # a quota's 429 (server/quotas.py)
                response.headers["Retry-After"] = str(exc.extra["retry_after_s"])
            return response
        except ClientDisconnect:
            # The client hung up (or the server's body read timeout closed it) mid-body: nobody
            # reads this answer.
            log.debug(
                "%s %s: the client left before sending its whole body", request.method, request.url.path
            )
            return Response(status_code=400)
        except Exception as exc:
            outage = classify(exc)
            if outage is None:
                log.exception("%s %s failed", request.method, request.url.path)
                err = HTTPError(500, "internal error in the control plane; see its log")
                return h.error_answer(request, err)
            if outages is not None and outage is not exc:  # (one raised as such was counted)
                outages.failed(outage)
            return outage_answer(request, outage)

    return wrapped


def outage_answer(request: Request, outage: StoreOutage) -> Response:
    """The 503 of a store outage: its one-line cause, ``Retry-After``."""
    response = h.error_answer(request, HTTPError(503, str(outage)))
    response.headers["Retry-After"] = str(outage.retry_after)
    return response


class Routes:
    """The route handlers of one app, bound to its :class:`Context`. Each takes the request and
    the :class:`~.authz.Caller` that :func:`~.authz.authorize` made of its token and the route's
    entry in :data:`~.authz.ROUTES`, and applies the caller's rule to what it touches."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.ops = ops.OpsRoutes(ctx)

    async def _msgpack(self, request: Request) -> dict[str, Any]:
        return h.decode_msgpack(await h.read_body(request, self.ctx.config.max_body_bytes))

    async def _json(self, request: Request) -> dict[str, Any]:
        return h.decode_json(await h.read_body(request, self.ctx.config.max_body_bytes))

    # -- health --------------------------------------------------------------------------------

    async def healthz(self, request: Request, caller: Caller) -> Response:
        """200 ``{"ok": true, "store"}`` while the store answers a cheap read (and a SQLite file's
        disk has room); else 503 ``{"ok": false, "store", "error": "store unavailable: ..."}``."""
        try:
            outage = await asyncio.wait_for(asyncio.to_thread(probe, self.ctx.store), HEALTH_READ_S)
        except TimeoutError:
            outage = StoreOutage("unavailable", f"a read took over {HEALTH_READ_S:g} s")
        if outage is None:
            return h.json_response({"ok": True, "store": self.ctx.dialect})
        response = h.json_response({"ok": False, "store": self.ctx.dialect, "error": str(outage)}, 503)
        response.headers["Retry-After"] = str(outage.retry_after)
        return response

    async def metrics(self, request: Request, caller: Caller) -> Response:
        await ops.observe_store(self.ctx)
        return Response(self.ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    # -- producer ------------------------------------------------------------------------------

    # A task token (kind ``task``, rule "own descendants": server/tasks.py) is held to its own
    # invocation: it submits children of it, and reads or cancels its descendants only.

    async def _reach(self, caller: Caller, invocation_id: str) -> None:
        if caller.rule is authz.Own.DESCENDANTS:
            await tasks.check_target(self.ctx, caller, invocation_id)

    async def submit(self, request: Request, caller: Caller) -> Response:
        body = await self._msgpack(request)
        if caller.rule is authz.Own.DESCENDANTS:
            await tasks.check_submit(self.ctx, caller, body)
        return h.msgpack_response(await producer.submit(self.ctx, caller, body))

    async def submit_batch(self, request: Request, caller: Caller) -> Response:
        body = await self._msgpack(request)
        task = None
        if caller.rule is authz.Own.DESCENDANTS:  # its items are children of the task's invocation
            task = await tasks.live(self.ctx, caller.principal)
        return h.msgpack_response(await producer.submit_batch(self.ctx, caller, body, task))

    async def await_(self, request: Request, caller: Caller) -> Response:
        body = await self._msgpack(request)
        if caller.rule is authz.Own.DESCENDANTS:
            target = h.ulid_field(body, "invocation_id")
            assert target is not None
            await self._reach(caller, target)
        return h.msgpack_response(await producer.await_(self.ctx, caller, body))

    async def await_batch(self, request: Request, caller: Caller) -> Response:
        body = await self._msgpack(request)
        return h.msgpack_response(await bulk.await_batch(self.ctx, caller, body))

    async def status(self, request: Request, caller: Caller) -> Response:
        inv = producer.request_id(request, "id", "invocation_id")
        await self._reach(caller, inv)
        return h.msgpack_response(await producer.status(self.ctx, caller, inv))

    async def cancel(self, request: Request, caller: Caller) -> Response:
        inv = producer.request_id(request, "id", "invocation_id")
        await self._reach(caller, inv)
        raw = await h.read_body(request, self.ctx.config.max_body_bytes)
        body = h.decode_msgpack(raw) if raw else {}
        descendants = h.field(body, "descendants", bool, default=True)
        return h.msgpack_response(await producer.cancel(self.ctx, caller, inv, descendants=descendants))

    def _stream_params(self, request: Request) -> tuple[int, float]:
        since = h.query_int(request, "since", -1)
        timeout = h.query_number(
            request, "timeout", self.ctx.config.stream_default_s, lo=0.0, hi=self.ctx.config.stream_max_s
        )
        return since, timeout

    async def result_stream(self, request: Request, caller: Caller) -> Response:
        inv = producer.request_id(request, "id", "invocation_id")
        await self._reach(caller, inv)
        since, timeout = self._stream_params(request)
        authz.see_invocation(caller, inv, await self.ctx.call(self.ctx.store.get, inv))
        body = streams.follow(self.ctx, inv, f"inv:{inv}", since, timeout, invocation=True)
        return StreamingResponse(body, media_type=h.MSGPACK_STREAM)

    async def send(self, request: Request, caller: Caller) -> Response:
        inv = producer.request_id(request, "id", "invocation_id")
        await self._reach(caller, inv)
        status, out = await sends.send(self.ctx, caller, inv, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def topic_post(self, request: Request, caller: Caller) -> Response:
        topic = h.name(request.path_params["name"], "topic name")
        return h.msgpack_response(
            await producer.topic_post(self.ctx, caller, topic, await self._msgpack(request))
        )

    async def topic_stream(self, request: Request, caller: Caller) -> Response:
        topic = h.name(request.path_params["name"], "topic name")
        since, timeout = self._stream_params(request)
        owner = f"topic:{topic}"
        body = streams.follow(self.ctx, owner, owner, since, timeout, invocation=False)
        return StreamingResponse(body, media_type=h.MSGPACK_STREAM)

    # -- daemon --------------------------------------------------------------------------------

    async def register(self, request: Request, caller: Caller) -> Response:
        return h.msgpack_response(await daemon.register(self.ctx, caller, await self._msgpack(request)))

    async def poll(self, request: Request, caller: Caller) -> Response:
        try:
            with self.ctx.polls.admitted():
                body = await self._msgpack(request)
                out = await daemon.poll(self.ctx, caller, body, request.receive)
        except PollsFull as exc:
            self.ctx.metrics.polls_refused.inc()
            after = self.ctx.config.poll_retry_after_s
            after = random.randint(after, 2 * after)  # spread the fleet's retries
            response = h.msgpack_response({"error": f"{exc}; retry after {after} s"}, 503)
            response.headers["Retry-After"] = str(after)
            return response
        return h.msgpack_response(out)

    async def ack(self, request: Request, caller: Caller) -> Response:
        status, out = await daemon.ack(self.ctx, caller, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def checkpoint(self, request: Request, caller: Caller) -> Response:
        status, out = await checkpoints.checkpoint(self.ctx, caller, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def result_chunk(self, request: Request, caller: Caller) -> Response:
        status, out = await daemon.result_chunk(self.ctx, caller, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def result_chunks(self, request: Request, caller: Caller) -> Response:
        status, out = await daemon.result_chunks(self.ctx, caller, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def sends_fetch(self, request: Request, caller: Caller) -> Response:
        status, out = await sends.fetch(self.ctx, caller, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def heartbeat(self, request: Request, caller: Caller) -> Response:
        return h.msgpack_response(await daemon.heartbeat(self.ctx, caller, await self._msgpack(request)))

    async def deregister(self, request: Request, caller: Caller) -> Response:
        return h.msgpack_response(await daemon.deregister(self.ctx, caller, await self._msgpack(request)))

    # -- namespaces (JSON) ---------------------------------------------------------------------

    def _ns(self, request: Request, caller: Caller) -> str:
        ns = h.name(request.path_params["ns"], "namespace")
        authz.enter_namespace(caller, ns)
        return ns

    async def exec_(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        body = await self._json(request)
        status, out = await namespaces.exec_(self.ctx, ns, body, legacy=caller.namespace is None)
        return h.json_response(out, status)

    async def job_result(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        exec_id = h.ulid(request.path_params["id"], "exec_id")
        wait = h.query_number(request, "wait", 0.0, lo=0.0, hi=self.ctx.config.exec_wait_max_s)
        status, out = await namespaces.result_get(self.ctx, ns, exec_id, wait)
        return h.json_response(out, status)

    async def job_publish(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        exec_id = h.ulid(request.path_params["id"], "exec_id")
        body = await self._json(request)
        status, out = await namespaces.result_post(self.ctx, caller, ns, exec_id, body)
        return h.json_response(out, status)

    async def job_output_put(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        exec_id = h.ulid(request.path_params["id"], "exec_id")
        return h.json_response(await execout.put(self.ctx, caller, ns, exec_id, request))

    async def job_output(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        exec_id = h.ulid(request.path_params["id"], "exec_id")
        return await execout.get(self.ctx, ns, exec_id, request)

    async def presign(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        if caller.rule is authz.Own.DESCENDANTS:
            await tasks.live(self.ctx, caller.principal)  # a task presigns while its attempt runs
        body = await self._json(request)
        legacy = caller.namespace is None  # an admin, an unbound nymph: keys minted before namespaces too
        answer = await namespaces.presign(self.ctx, ns, body, str(request.base_url), legacy=legacy)
        return h.json_response(answer)

    # -- the local blob directory (no bucket): presigned URLs onto the control plane itself ------

    async def blob_put(self, request: Request, caller: Caller) -> Response:
        return await blobroutes.put(self.ctx, request)

    async def blob_get(self, request: Request, caller: Caller) -> Response:
        return await blobroutes.get(self.ctx, request)

    async def pin(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        return h.json_response(await namespaces.pin(self.ctx, ns, await self._json(request)))

    # -- secrets (server/secrets.py) ---------------------------------------------------------

    async def secret_list(self, request: Request, caller: Caller) -> Response:
        return h.json_response(await secrets.listing(self.ctx, self._ns(request, caller)))

    async def secret_put(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        name = request.path_params["name"]
        return h.json_response(await secrets.put(self.ctx, ns, name, await self._json(request)))

    async def secret_delete(self, request: Request, caller: Caller) -> Response:
        ns = self._ns(request, caller)
        return h.json_response(await secrets.delete(self.ctx, ns, request.path_params["name"]))

    async def secrets_fetch(self, request: Request, caller: Caller) -> Response:
        return h.msgpack_response(await secrets.fetch(self.ctx, caller, await self._msgpack(request)))

    def _endpoint(self, route: authz.RouteAuth) -> Handler:
        """The route's handler behind its gate: authenticate (401), then authorize (403)."""
        owner: Any = self.ops if route.handler.startswith("ops.") else self
        handler: Callable[[Request, Caller], Awaitable[Response]] = getattr(
            owner, route.handler.removeprefix("ops.")
        )

        async def endpoint(request: Request) -> Response:
            if route.public:
                caller = authz.Caller(authz.ANONYMOUS, authz.Own.ANY, route)
            else:
                caller = authz.authorize(route, await self.ctx.auth.principal(request))
                if caller.principal.kind == "task" and caller.rule is not authz.Own.DESCENDANTS:
                    # a task token lives while its attempt runs, on every route (whoami too): the
                    # "own descendants" routes check that with their target, the others here
                    await tasks.live(self.ctx, caller.principal)
            return await handler(request, caller)

        return _guard(endpoint, self.ctx.outages)

    def table(self) -> list[BaseRoute]:
        """One Starlette route per entry of :data:`~.authz.ROUTES`, in its order, then the
        dashboard's (``server.ui``, which checks its sessions against the table's ``/ui`` entry)."""
        routes: list[BaseRoute] = [
            Route(r.path, self._endpoint(r), methods=[r.method]) for r in authz.ROUTES if not r.session
        ]
        return [*routes, *Dashboard(self.ctx).table()]


async def _expire_loop(ctx: Context) -> None:
    while True:
        await asyncio.sleep(ctx.config.expire_every_s)
        if ctx.outages.expiry_paused():  # heartbeats could not be written: no lease lapses for it
            continue
        try:
            expired = await ctx.call(ctx.store.expire_leases)
        except StoreOutage:
            continue  # logged once by ctx.outages; expiry pauses from now
        except Exception:
            log.warning(
                "lease expiry pass failed; retrying in %.1fs", ctx.config.expire_every_s, exc_info=True
            )
            continue
        ctx.outages.succeeded()  # a write committed: on a quiet plane this is what ends an outage
        if expired:
            ctx.metrics.expired.inc(len(expired))
            for inv in expired:
                ctx.wake.notify(f"inv:{inv}")


async def sweep(ctx: Context, now: float | None = None) -> Any:
    """One retention sweep: ``store.gc_batch`` until a batch comes back short (each batch its own
    short transaction, so the hot path waits for one batch at most), the payloads the expired
    exec jobs referenced deleted from S3, the counts in ``lakeshore_gc_deleted``. The totals."""
    from dreamlake.lakeshore.store.api import GcResult

    config = ctx.config
    total = GcResult()
    while True:
        when = time.time() if now is None else now
        got = await ctx.call(
            ctx.store.gc_batch, when, config.retention_s, dict(config.retention_queues), limit=config.gc_batch
        )
        total.add(got)
        for kind in ("invocations", "frames", "attempts", "exec_jobs"):
            ctx.metrics.gc_deleted.labels(kind=kind).inc(getattr(got, kind))
        delete = getattr(ctx.payloads, "delete", None)  # S3; a local blob directory prunes by age
        if got.payload_keys and delete is not None:
            deleted = await asyncio.to_thread(delete, got.payload_keys)
            ctx.metrics.gc_deleted.labels(kind="payloads").inc(deleted)
        if got.rows < config.gc_batch:
            break
        await asyncio.sleep(0)  # the next batch after the routes that waited
    if total.rows:
        log.info(
            "retention: deleted %d invocations (%d frames), %d exec jobs, %d payload keys",
            total.invocations, total.frames, total.exec_jobs, len(total.payload_keys),
        )  # fmt: skip
    return total


async def _gc_loop(ctx: Context) -> None:
    if not (ctx.config.retention_s or ctx.config.retention_queues):
        return  # everything is kept for ever
    while True:
        await asyncio.sleep(ctx.config.gc_every_s * random.uniform(0.9, 1.1))  # replicas spread out
        try:
            await sweep(ctx)
            ctx.metrics.gc_runs.labels(outcome="ok").inc()
        except Exception:
            ctx.metrics.gc_runs.labels(outcome="failed").inc()
            log.warning("retention sweep failed; retrying in %.0fs", ctx.config.gc_every_s, exc_info=True)


async def _prune_loop(blobs: BlobDir, every_s: float) -> None:
    """Drop blobs past their retention from the local blob directory, as an S3 lifecycle rule would."""
    while True:
        try:
            await asyncio.to_thread(blobs.prune)
        except Exception:
            log.warning("pruning the blob directory %s failed", blobs.root, exc_info=True)
        await asyncio.sleep(every_s)


def _relay(ctx: Context) -> PgRelay | None:
    """The LISTEN/NOTIFY relay of a PostgreSQL store, attached to the poll hub; None on SQLite."""
    url = getattr(getattr(ctx.store, "db", None), "url", None)
    if not ctx.polls.shared_store or ctx.dialect != "postgresql" or not isinstance(url, str):
        return None  # SQLite siblings (--workers N) have no LISTEN: their polls re-check the store

    def on_listening(up: bool) -> None:
        if not up:
            ctx.polls.degrade()

    relay = PgRelay(libpq_dsn(url), ctx.wake.notifier, on_listening=on_listening)
    ctx.polls.relay = relay
    return relay


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = {
        404: f"no route {request.url.path[:200]}: see docs/protocol.md",
        405: f"method {request.method} not allowed on {request.url.path[:200]}",
    }.get(status, str(getattr(exc, "detail", "error")))
    return h.error_answer(request, HTTPError(status, message))


def create_app(
    store: Store, *, fanout: Any = None, payloads: Any = None, config: ServerConfig | None = None
) -> Starlette:
    """The control plane over ``store``; ``fanout`` (live frames; in process when None) and
    ``payloads`` (presign: a ``PayloadStore`` over S3 or a ``BlobDir``) are optional."""
    ctx = Context(
        store=store,
        config=config or ServerConfig(),
        fanout=fanout if fanout is not None else LocalFanout(),
        payloads=payloads,
        dialect=store_dialect(store),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx.polls.start(asyncio.get_running_loop())
        tasks = [asyncio.create_task(_expire_loop(ctx)), asyncio.create_task(_gc_loop(ctx))]
        if isinstance(ctx.payloads, BlobDir):
            tasks.append(asyncio.create_task(_prune_loop(ctx.payloads, BLOB_PRUNE_EVERY_S)))
        relay = _relay(ctx)
        if relay is not None:
            tasks.append(asyncio.create_task(relay.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            ctx.polls.stop()
            await ctx.writer.aclose()
            # The Fanout protocol closes with ``aclose`` (a Redis fan-out holds two clients).
            closer = getattr(ctx.fanout, "aclose", None) or getattr(ctx.fanout, "close", None)
            if callable(closer):
                try:
                    result = closer()
                    if asyncio.iscoroutine(result):
                        await result
                except Exception:
                    log.warning("closing the live fan-out failed", exc_info=True)
            ctx.close()

    table = Routes(ctx).table()
    # the hot routes' own endpoints (the same gate and guard), dispatched without Starlette's
    # middleware and routing (server/hotroutes.py)
    hot = {
        (method, r.path): r.endpoint
        for r in table
        if isinstance(r, Route)
        for method in r.methods or ()
        if (method, r.path) in hotroutes.HOT
    }
    app = hotroutes.HotStarlette(
        routes=table, lifespan=lifespan, exception_handlers={HTTPException: _http_error}, hot=hot
    )
    app.state.ctx = ctx
    return app
