"""A lean front for the hot routes: one dict lookup instead of Starlette's middleware and routing.

Every request of a warm call, a submit, a claim or an ack goes through Starlette's stack:
``ServerErrorMiddleware``, ``ExceptionMiddleware``, the router's match of each route in turn (the
auth table has about 60), then the route's ``request_response`` wrapper; measured under a fleet's
polls and acks, that stack cost as much Python as the handler's own HTTP work. :class:`HotStarlette`
is the same Starlette app with one shortcut in front: a request whose method and path are one of
:data:`HOT` (fixed paths, no path parameters) goes straight to that route's endpoint, the very
callable the Starlette route holds, built by ``app.Routes._endpoint`` from the route's entry in
``authz.ROUTES``. So the hot routes keep everything that endpoint does, in the same order:
authentication (401) and the table's verdict (403), a task token's liveness, the bounded body
(413/400), the handler's ownership rule, and ``_guard``'s mapping of errors (an HTTPError to its
answer, a store outage to a 503 with ``Retry-After``, anything else to a logged 500). The
slow-client guards are the HTTP protocol's (server/guard.py), below any ASGI app, and unchanged.

Everything else (another method on a hot path, every other route, the dashboard, lifespan) goes
through Starlette as before, so a 404 or 405 is Starlette's answer, and a route moved out of
:data:`HOT` is only slower.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# The hot routes: (method, path) of entries in authz.ROUTES with fixed paths
HOT: frozenset[tuple[str, str]] = frozenset(
    {
        ("POST", "/v1/producer/submit"),
        ("POST", "/v1/producer/await"),
        ("POST", "/v1/daemon/poll"),
        ("POST", "/v1/daemon/ack"),
        ("POST", "/v1/daemon/heartbeat"),
        ("POST", "/v1/daemon/result-chunks"),
    }
)

Endpoint = Callable[[Request], Awaitable[Response]]


class HotStarlette(Starlette):
    """Starlette, with :data:`HOT`'s requests dispatched straight to their endpoints (see the
    module docstring). ``hot`` maps ``(method, path)`` to the endpoint of that route."""

    def __init__(self, *args: Any, hot: dict[tuple[str, str], Endpoint], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unknown = set(hot) - HOT
        if unknown:
            raise ValueError(f"not hot routes: {sorted(unknown)}")
        self.hot = dict(hot)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.hot.get((scope["method"], scope["path"]))
            if endpoint is not None and not scope.get("root_path"):
                scope["app"] = self
                response = await endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
