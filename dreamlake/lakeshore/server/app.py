"""The control plane's ASGI app: ``create_app(store, ...)`` wires every route of docs/protocol.md.

Handlers live by audience in ``producer``, ``streams``, ``daemon``, ``namespaces`` and ``ops``
(operators' JSON views; the ``/ui`` dashboard is ``server.ui``); this module
does what is common to all of them: auth first (401/403), then ids (400), then the bounded body
(413/400), then the handler; an :class:`~.http.HTTPError` becomes ``{"error": ...}`` in the route's
encoding, anything unexpected a logged 500. A background task expires lapsed leases every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from dreamlake.lakeshore.server import daemon, namespaces, ops, producer, streams, tasks
from dreamlake.lakeshore.server import http as h
from dreamlake.lakeshore.server.auth import require_kind, require_namespace
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.server.context import Context, store_dialect
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.server.ui import Dashboard
from dreamlake.lakeshore.store.api import Principal, Store

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def _guard(fn: Handler) -> Handler:
    """Turn HTTPError into an error answer and anything unexpected into a logged 500."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except HTTPError as exc:
            return h.error_answer(request, exc)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            err = HTTPError(500, "internal error in the control plane; see its log")
            return h.error_answer(request, err)

    return wrapped


class Routes:
    """The route handlers of one app, bound to its :class:`Context`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def _who(self, request: Request, *kinds: str) -> Principal:
        principal = await self.ctx.auth.principal(request)
        if kinds:
            require_kind(principal, *kinds)
        return principal

    async def _msgpack(self, request: Request) -> dict[str, Any]:
        return h.decode_msgpack(await h.read_body(request, self.ctx.config.max_body_bytes))

    async def _json(self, request: Request) -> dict[str, Any]:
        return h.decode_json(await h.read_body(request, self.ctx.config.max_body_bytes))

    # -- health --------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return h.json_response({"ok": True, "store": self.ctx.dialect})

    async def metrics(self, request: Request) -> Response:
        await self._who(request, "metrics")
        await ops.observe_store(self.ctx)
        return Response(self.ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    # -- producer ------------------------------------------------------------------------------

    # A task token (kind ``task``, server/tasks.py) may use these producer routes, held to its own
    # invocation: it submits children of it, and reads or cancels its descendants only.

    async def _reach(self, principal: Principal, invocation_id: str) -> None:
        if principal.kind == "task":
            await tasks.check_target(self.ctx, principal, invocation_id)

    async def submit(self, request: Request) -> Response:
        principal = await self._who(request, "producer", "task")
        body = await self._msgpack(request)
        if principal.kind == "task":
            await tasks.check_submit(self.ctx, principal, body)
        return h.msgpack_response(await producer.submit(self.ctx, principal, body))

    async def await_(self, request: Request) -> Response:
        principal = await self._who(request, "producer", "task")
        body = await self._msgpack(request)
        if principal.kind == "task":
            target = h.ulid_field(body, "invocation_id")
            assert target is not None
            await self._reach(principal, target)
        return h.msgpack_response(await producer.await_(self.ctx, principal, body))

    async def status(self, request: Request) -> Response:
        principal = await self._who(request, "producer", "task")
        inv = producer.request_id(request, "id", "invocation_id")
        await self._reach(principal, inv)
        return h.msgpack_response(await producer.status(self.ctx, inv))

    async def cancel(self, request: Request) -> Response:
        principal = await self._who(request, "producer", "task")
        inv = producer.request_id(request, "id", "invocation_id")
        await self._reach(principal, inv)
        raw = await h.read_body(request, self.ctx.config.max_body_bytes)
        body = h.decode_msgpack(raw) if raw else {}
        descendants = h.field(body, "descendants", bool, default=True)
        return h.msgpack_response(await producer.cancel(self.ctx, inv, descendants=descendants))

    def _stream_params(self, request: Request) -> tuple[int, float]:
        since = h.query_int(request, "since", -1)
        timeout = h.query_number(
            request, "timeout", self.ctx.config.stream_default_s, lo=0.0, hi=self.ctx.config.stream_max_s
        )
        return since, timeout

    async def result_stream(self, request: Request) -> Response:
        principal = await self._who(request, "producer", "task")
        inv = producer.request_id(request, "id", "invocation_id")
        await self._reach(principal, inv)
        since, timeout = self._stream_params(request)
        if await self.ctx.call(self.ctx.store.get, inv) is None:
            raise HTTPError(404, f"unknown invocation '{inv}'")
        body = streams.follow(self.ctx, inv, f"inv:{inv}", since, timeout, invocation=True)
        return StreamingResponse(body, media_type=h.MSGPACK_STREAM)

    async def topic_post(self, request: Request) -> Response:
        await self._who(request, "producer")
        topic = h.name(request.path_params["name"], "topic name")
        return h.msgpack_response(await producer.topic_post(self.ctx, topic, await self._msgpack(request)))

    async def topic_stream(self, request: Request) -> Response:
        await self._who(request, "producer")
        topic = h.name(request.path_params["name"], "topic name")
        since, timeout = self._stream_params(request)
        owner = f"topic:{topic}"
        body = streams.follow(self.ctx, owner, owner, since, timeout, invocation=False)
        return StreamingResponse(body, media_type=h.MSGPACK_STREAM)

    # -- daemon --------------------------------------------------------------------------------

    async def register(self, request: Request) -> Response:
        principal = await self._who(request, "daemon")
        return h.msgpack_response(await daemon.register(self.ctx, principal, await self._msgpack(request)))

    async def poll(self, request: Request) -> Response:
        principal = await self._who(request, "daemon")
        body = await self._msgpack(request)
        return h.msgpack_response(await daemon.poll(self.ctx, principal, body, request.is_disconnected))

    async def ack(self, request: Request) -> Response:
        principal = await self._who(request, "daemon")
        status, out = await daemon.ack(self.ctx, principal, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def result_chunk(self, request: Request) -> Response:
        principal = await self._who(request, "daemon")
        status, out = await daemon.result_chunk(self.ctx, principal, await self._msgpack(request))
        return h.msgpack_response(out, status)

    async def heartbeat(self, request: Request) -> Response:
        principal = await self._who(request, "daemon")
        return h.msgpack_response(await daemon.heartbeat(self.ctx, principal, await self._msgpack(request)))

    # -- namespaces (JSON) ---------------------------------------------------------------------

    async def _ns(self, request: Request, *, daemon_ok: bool = False) -> str:
        return (await self._ns_principal(request, daemon_ok=daemon_ok))[0]

    async def _ns_principal(self, request: Request, *, daemon_ok: bool = False) -> tuple[str, Principal]:
        principal = await self._who(request)
        ns = h.name(request.path_params["ns"], "namespace")
        require_namespace(principal, ns, daemon_ok=daemon_ok)
        return ns, principal

    async def exec_(self, request: Request) -> Response:
        ns = await self._ns(request)
        status, out = await namespaces.exec_(self.ctx, ns, await self._json(request))
        return h.json_response(out, status)

    async def job_result(self, request: Request) -> Response:
        if request.method == "POST":
            ns, principal = await self._ns_principal(request, daemon_ok=True)
            exec_id = h.ulid(request.path_params["id"], "exec_id")
            status, out = await namespaces.result_post(
                self.ctx, principal, ns, exec_id, await self._json(request)
            )
            return h.json_response(out, status)
        ns = await self._ns(request)
        exec_id = h.ulid(request.path_params["id"], "exec_id")
        wait = h.query_number(request, "wait", 0.0, lo=0.0, hi=self.ctx.config.exec_wait_max_s)
        status, out = await namespaces.result_get(self.ctx, ns, exec_id, wait)
        return h.json_response(out, status)

    async def presign(self, request: Request) -> Response:
        ns = await self._ns(request, daemon_ok=True)
        return h.json_response(await namespaces.presign(self.ctx, ns, await self._json(request)))

    async def pin(self, request: Request) -> Response:
        principal = await self._who(request, "admin")
        ns = h.name(request.path_params["ns"], "namespace")
        del principal
        return h.json_response(await namespaces.pin(self.ctx, ns, await self._json(request)))

    def table(self) -> list[BaseRoute]:
        g = _guard
        return [
            Route("/healthz", g(self.healthz), methods=["GET"]),
            Route("/metrics", g(self.metrics), methods=["GET"]),
            Route("/v1/producer/submit", g(self.submit), methods=["POST"]),
            Route("/v1/producer/await", g(self.await_), methods=["POST"]),
            Route("/v1/producer/invocations/{id}", g(self.status), methods=["GET"]),
            Route("/v1/producer/invocations/{id}/cancel", g(self.cancel), methods=["POST"]),
            Route("/v1/producer/invocations/{id}/result/stream", g(self.result_stream), methods=["GET"]),
            Route("/v1/producer/topics/{name}/post", g(self.topic_post), methods=["POST"]),
            Route("/v1/producer/topics/{name}/stream", g(self.topic_stream), methods=["GET"]),
            Route("/v1/daemon/register", g(self.register), methods=["POST"]),
            Route("/v1/daemon/poll", g(self.poll), methods=["POST"]),
            Route("/v1/daemon/ack", g(self.ack), methods=["POST"]),
            Route("/v1/daemon/result-chunk", g(self.result_chunk), methods=["POST"]),
            Route("/v1/daemon/heartbeat", g(self.heartbeat), methods=["POST"]),
            Route("/v1/namespaces/{ns}/exec", g(self.exec_), methods=["POST"]),
            Route("/v1/namespaces/{ns}/jobs/{id}/result", g(self.job_result), methods=["GET", "POST"]),
            Route("/v1/namespaces/{ns}/payloads/presign", g(self.presign), methods=["POST"]),
            Route("/v1/namespaces/{ns}/pin", g(self.pin), methods=["PUT"]),
            *ops.OpsRoutes(self.ctx).table(g),
            *Dashboard(self.ctx).table(),
        ]


async def _expire_loop(ctx: Context) -> None:
    while True:
        await asyncio.sleep(ctx.config.expire_every_s)
        try:
            expired = await ctx.call(ctx.store.expire_leases)
        except Exception:
            log.warning(
                "lease expiry pass failed; retrying in %.1fs", ctx.config.expire_every_s, exc_info=True
            )
            continue
        if expired:
            ctx.metrics.expired.inc(len(expired))
            for inv in expired:
                ctx.wake.notify(f"inv:{inv}")


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
    """The control plane over ``store``; ``fanout`` (live frames) and ``payloads`` (presign) are optional."""
    ctx = Context(
        store=store,
        config=config or ServerConfig(),
        fanout=fanout,
        payloads=payloads,
        dialect=store_dialect(store),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        expirer = asyncio.create_task(_expire_loop(ctx))
        try:
            yield
        finally:
            expirer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expirer
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

    app = Starlette(
        routes=Routes(ctx).table(), lifespan=lifespan, exception_handlers={HTTPException: _http_error}
    )
    app.state.ctx = ctx
    return app
