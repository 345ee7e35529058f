"""The dashboard ``lakeshore server`` serves at ``/ui``: queues, workers, invocations, one
invocation's timeline with its live output (the LOG frames: stdout and stderr) and live stream (the
other frames), and cancel.

Server-rendered HTML: Jinja2 templates (``templates/``, autoescaped) over the same reads as the
operator routes (``server.ops``), so the scoping is the same: an admin sees every namespace, a
producer or namespace token its own. The live parts are fragments under ``/ui/parts/`` that htmx
(``static/htmx.min.js``, htmx.org 2.0.11 vendored as published on npm, 0BSD licence in
``static/htmx.LICENSE``; no Node build step) re-fetches every second or two; a fragment for a
finished invocation stops polling. ``static/dashboard.js`` keeps the live output at its tail (unless
the reader scrolled up) and draws the overview's charts (queue depth and throughput over the last
hour, ``charts.py``) with uPlot (``static/uPlot.iife.min.js``, vendored from npm, MIT); every
script is a file (no inline script). An invocation page shows its arguments and result
(``views.py``: decoded when plain values, size-capped); the calls of one ``map`` (a sweep) are one
group with its progress in the invocation list.

Sessions: ``POST /ui/login`` checks the token and opens a server-side session (``store.
create_session``: a random id whose sha256 the store keeps with the token's id, 12 h); the
``lakeshore_session`` cookie holds that opaque id, never the token (HttpOnly, ``SameSite=Strict``,
``Path=/ui``, ``Secure`` behind https), so scripts on the page never see it, no other site's request
carries it, and signing out ends it on every replica. A login whose ``Origin`` (or
``Sec-Fetch-Site``) names another site is refused (login CSRF: signing the operator in as someone
else). Every state-changing form (cancel, sign out) also carries a CSRF token, an HMAC of the
session id, and a POST whose ``Origin`` names another host is refused. A request without a valid
session is sent to the login page (an htmx fragment request gets 401 with ``HX-Redirect``).

Every ``/ui`` answer carries ``X-Frame-Options: DENY``, ``Content-Security-Policy`` (:data:`CSP`:
scripts, styles and requests from this origin only, no framing, forms post here only),
``X-Content-Type-Options: nosniff`` and ``Referrer-Policy: same-origin``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import msgpack
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from dreamlake.lakeshore import humanize
from dreamlake.lakeshore.server import authz, ops
from dreamlake.lakeshore.server import http as h
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.server.ui import charts, views
from dreamlake.lakeshore.states import STATES
from dreamlake.lakeshore.store.api import LIVE_WINDOW_S, Principal

HERE = Path(__file__).resolve().parent
COOKIE = "lakeshore_session"
SESSION_S = 12 * 3600
FORM_LIMIT = 8 * 1024
FRAMES_SHOWN = 200
LOG_KINDS = ("log", "stderr")  # LOG frames: the Output panel, not the stream table
OUTPUT_SHOWN = 64 * 1024  # characters of one LOG frame the Output panel shows
HEALTHY_S = 30.0  # seen this recently: "ok" (nymph heartbeats every 10 s); then "late", then "gone"
SINCE_CHOICES = {"10m": 600, "1h": 3600, "1d": 86400, "7d": 7 * 86400}
SWEEPS_SINCE_S = 86400.0  # the invocation list's first page shows the sweeps of the last day
_CSRF_CONTEXT = b"lakeshore-ui-csrf-v1"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
_RAW_HEADERS = [(k.lower().encode(), v.encode()) for k, v in HEADERS.items()]

Handler = Callable[[Request], Awaitable[Response]]


class _LoginNeeded(Exception):
    pass


@dataclass
class Session:
    principal: Principal
    csrf: str

    @property
    def namespace(self) -> str | None:
        return ops.scope(self.principal)


def csrf_token(secret: str) -> str:
    """The CSRF token of a session: an HMAC of its id, so it is unknowable without the cookie."""
    key = hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()
    return hmac.new(key, _CSRF_CONTEXT, hashlib.sha256).hexdigest()


def frame_view(data: bytes) -> dict[str, Any]:
    """A journaled frame for the page: kind, seq, time and a short preview of its body.

    Values are previewed with plain msgpack, never decoded by the wire codec: an extension value
    (an array, a tensor, an image) shows as its size, and nothing it names is imported here."""
    from dreamlake.lakeshore import wire

    try:
        frame = wire.decode_frame(data)
    except Exception as exc:
        return {
            "seq": None,
            "kind": "invalid",
            "preview": f"undecodable frame: {type(exc).__name__}",
            "at": None,
        }
    kinds = {
        wire.FRAME_VALUE: "value",
        wire.FRAME_END: "end",
        wire.FRAME_ERROR: "error",
        wire.FRAME_LOG: "log",
    }
    meta = frame.meta if isinstance(frame.meta, dict) else {}
    kind = kinds.get(frame.kind, str(frame.kind))
    if frame.kind == wire.FRAME_LOG and isinstance(frame.body, bytes):
        preview = frame.body.decode("utf-8", "replace")
        if meta.get("stream") == "stderr":
            kind = "stderr"
    elif isinstance(frame.body, dict):
        preview = f"{frame.body.get('type', 'Error')}: {frame.body.get('message', '')}"
    elif isinstance(frame.body, bytes) and frame.body:
        preview = _preview_value(frame.body)
    else:
        preview = ""
    at = meta.get("ts")
    return {
        "seq": frame.seq,
        "kind": kind,
        "preview": preview[:500],
        "text": preview[:OUTPUT_SHOWN] if frame.kind == wire.FRAME_LOG else "",
        "at": at if isinstance(at, (int, float)) else None,
    }


def _runs(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive LOG frames of one stream as one piece of text (a line may span two frames)."""
    runs: list[dict[str, Any]] = []
    for view in output:
        if runs and runs[-1]["kind"] == view["kind"]:
            runs[-1] = {**runs[-1], "text": runs[-1]["text"] + view["text"]}
        else:
            runs.append(view)
    return runs


def _preview_value(body: bytes) -> str:
    def ext(code: int, data: bytes) -> str:
        return f"<ext {code}: {len(data)} bytes>"

    try:
        value = msgpack.unpackb(
            body, raw=False, strict_map_key=False, ext_hook=ext, max_str_len=64 * 1024, max_bin_len=64 * 1024
        )
    except Exception:
        return f"<{len(body)} bytes>"
    return repr(value)


def _grouped(rows: list[dict[str, Any]], keep_sweeps: bool) -> list[dict[str, Any]]:
    """The list's rows, with consecutive calls of one sweep (a ``map``) folded into one group
    (``{"sweep", "rows"}``): a 2,000-call map is one line, not 2,000 (unless its own list is shown)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        sweep = None if keep_sweeps else row.get("sweep")
        if sweep and out and out[-1].get("sweep") == sweep:
            out[-1]["rows"].append(row)
        elif sweep:
            out.append({"sweep": sweep, "rows": [row]})
        else:
            out.append({"sweep": None, "rows": [row]})
    return out


def _health(worker: dict[str, Any]) -> str:
    if worker.get("stopped_at"):  # deregistered: a clean stop, not a lost worker
        return "stopped"
    age = worker["last_seen_age_s"]
    return "ok" if age <= HEALTHY_S else "late" if age <= LIVE_WINDOW_S else "gone"


class Dashboard:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        env = self.templates.env
        env.filters["age"] = humanize.age
        env.filters["when"] = humanize.when
        env.globals["duration"] = humanize.duration
        env.globals["states"] = STATES

    # -- sessions ----------------------------------------------------------------------------------

    async def _session(self, request: Request) -> Session:
        secret = request.cookies.get(COOKIE, "")
        principal = await self.ctx.call(self.ctx.store.session_principal, secret) if secret else None
        if principal is None or principal.kind not in authz.UI.grants:
            raise _LoginNeeded
        return Session(principal, csrf_token(secret))

    @staticmethod
    def _foreign(request: Request) -> str | None:
        """The other site a browser says this request came from; None for this one (or a client
        that says nothing, as curl)."""
        origin = request.headers.get("origin")
        if origin is not None and (origin == "null" or urlsplit(origin).netloc != request.url.netloc):
            return origin[:100]
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return f"a {site[:20]} page"
        return None

    def _check_post(self, request: Request, session: Session, form: dict[str, str]) -> None:
        origin = request.headers.get("origin")
        if origin and origin != "null" and urlsplit(origin).netloc != request.url.netloc:
            raise HTTPError(403, f"refused a form posted from another site ({origin[:100]})")
        if not hmac.compare_digest(form.get("csrf", ""), session.csrf):
            raise HTTPError(403, "missing or stale form token: reload the page and try again")

    async def _form(self, request: Request) -> dict[str, str]:
        body = await h.read_body(request, FORM_LIMIT)
        try:
            fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20)
        except (UnicodeDecodeError, ValueError):
            raise HTTPError(400, "unreadable form") from None
        return {k: v[0] for k, v in fields.items()}

    def _page(self, request: Request, name: str, status: int = 200, **values: Any) -> Response:
        return self.templates.TemplateResponse(request, name, values, status_code=status)

    def guard(self, fn: Callable[[Request, Session], Awaitable[Response]]) -> Handler:
        """Session first (else to the login page), then the handler; HTTPError as an error page."""

        async def wrapped(request: Request) -> Response:
            try:
                session = await self._session(request)
                return await fn(request, session)
            except _LoginNeeded:
                if request.headers.get("hx-request"):
                    return Response("sign in again", status_code=401, headers={"HX-Redirect": "/ui/login"})
                return RedirectResponse("/ui/login", status_code=303)
            except HTTPError as exc:
                return self._page(request, "error.html", exc.status, message=exc.message, session=None)

        return wrapped

    # -- login -------------------------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            return self._page(request, "login.html", error=None, session=None)
        foreign = self._foreign(request)
        if foreign is not None:
            error = f"refused a sign-in posted from another site ({foreign}): open this page and sign in here"
            return self._page(request, "login.html", 403, error=error, session=None)
        try:
            form = await self._form(request)
        except HTTPError as exc:
            return self._page(request, "login.html", exc.status, error=exc.message, session=None)
        secret = form.get("token", "").strip()
        principal = await self.ctx.auth.verify(secret) if secret else None
        if principal is None:
            return self._page(request, "login.html", 401, error="unknown token", session=None)
        if principal.kind not in authz.UI.grants:
            error = f"a {principal.kind} token cannot open the dashboard: use an admin, producer or namespace token"
            return self._page(request, "login.html", 403, error=error, session=None)
        session = await self.ctx.call(self.ctx.store.create_session, principal.token_id, SESSION_S)
        response = RedirectResponse("/ui", status_code=303)
        response.set_cookie(
            COOKIE,
            session,
            max_age=SESSION_S,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https",
        )
        return response

    async def logout(self, request: Request, session: Session) -> Response:
        self._check_post(request, session, await self._form(request))
        await self.ctx.call(self.ctx.store.end_session, request.cookies.get(COOKIE, ""))
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(COOKIE, path="/ui")
        return response

    # -- pages -------------------------------------------------------------------------------------

    async def _overview_values(self, session: Session) -> dict[str, Any]:
        queues = await ops.read_queues(self.ctx, session.namespace)
        workers, _ = await ops.read_workers(self.ctx, session.namespace, limit=500)
        for w in workers:
            w["health"] = _health(w)
        keys = await ops.read_key_limits(self.ctx, session.namespace)
        return {"queues": queues, "key_limits": keys, "workers": workers, "session": session}

    async def overview(self, request: Request, session: Session) -> Response:
        values = {**await self._overview_values(session), **await self._chart_values(session)}
        return self._page(request, "overview.html", **values)

    async def overview_part(self, request: Request, session: Session) -> Response:
        return self._page(request, "_overview.html", **await self._overview_values(session))

    async def _chart_values(self, session: Session) -> dict[str, Any]:
        now = time.time()
        rows = await self.ctx.call(self.ctx.store.activity, session.namespace, now - charts.WINDOW_S)
        return {"charts": charts.charts(rows, now), "session": session}

    async def charts_part(self, request: Request, session: Session) -> Response:
        return self._page(request, "_charts.html", **await self._chart_values(session))

    async def _list_values(self, request: Request, session: Session) -> dict[str, Any]:
        queue = ops.queue_param(request)
        states = ops.states_param(request)
        since_key = request.query_params.get("since", "")
        if since_key and since_key not in SINCE_CHOICES:
            raise HTTPError(400, f"since must be one of {', '.join(SINCE_CHOICES)}")
        since = time.time() - SINCE_CHOICES[since_key] if since_key else None
        cursor = ops.cursor_param(request, "invocation")
        sweep = ops.sweep_param(request)
        rows, next_cursor = await ops.read_invocations(
            self.ctx,
            session.namespace,
            queue=queue,
            states=states,
            since=since,
            limit=50,
            cursor=cursor,
            sweep=sweep,
        )
        filters = {
            "queue": queue or "",
            "state": states[0] if states else "",
            "since": since_key,
            "sweep": sweep or "",
        }
        sweeps = []
        if not cursor and not sweep:  # the first page: recent sweeps, one row each, with progress
            found = await self.ctx.call(
                self.ctx.store.sweeps, session.namespace, time.time() - SWEEPS_SINCE_S
            )
            sweeps = [views.sweep_view(s) for s in found if not queue or s.queue == queue]
        query = urlencode({k: v for k, v in filters.items() if v})
        older = (
            urlencode({**{k: v for k, v in filters.items() if v}, "cursor": next_cursor})
            if next_cursor
            else None
        )
        return {
            "rows": rows,
            "groups": _grouped(rows, keep_sweeps=bool(sweep)),
            "sweeps": sweeps,
            "filters": filters,
            "query": query,
            "older": older,
            "cursor": cursor,
            "since_choices": list(SINCE_CHOICES),
            "session": session,
        }

    async def invocations(self, request: Request, session: Session) -> Response:
        return self._page(request, "invocations.html", **await self._list_values(request, session))

    async def invocations_part(self, request: Request, session: Session) -> Response:
        return self._page(request, "_invocations.html", **await self._list_values(request, session))

    async def _detail_values(self, request: Request, session: Session) -> dict[str, Any]:
        inv = h.ulid(request.path_params["id"], "invocation_id")
        detail = await ops.read_detail(self.ctx, session.principal, inv)
        last = detail["frames"]["last_seq"]
        since = -1 if last is None else max(-1, last - FRAMES_SHOWN)
        frames = await self.ctx.call(self.ctx.store.read_frames, inv, since, FRAMES_SHOWN + 1)
        shown = [frame_view(f.data) for f in frames]
        row = await self.ctx.call(self.ctx.store.get, inv)
        return {
            "d": detail,
            "arguments": views.arguments(row) if row is not None else None,
            "result": views.result(row) if row is not None else None,
            "frames": [v for v in shown if v["kind"] not in LOG_KINDS],
            "output": _runs([v for v in shown if v["kind"] in LOG_KINDS]),
            "hidden": max(0, detail["frames"]["count"] - len(shown)),
            "frames_shown": FRAMES_SHOWN,
            "session": session,
        }

    async def invocation(self, request: Request, session: Session) -> Response:
        return self._page(request, "invocation.html", **await self._detail_values(request, session))

    async def invocation_part(self, request: Request, session: Session) -> Response:
        return self._page(request, "_invocation.html", **await self._detail_values(request, session))

    async def cancel(self, request: Request, session: Session) -> Response:
        self._check_post(request, session, await self._form(request))
        inv = h.ulid(request.path_params["id"], "invocation_id")
        await ops.cancel(self.ctx, session.principal, inv)
        return RedirectResponse(f"/ui/invocations/{inv}", status_code=303)

    def table(self) -> list[BaseRoute]:
        def g(fn: Callable[[Request, Session], Awaitable[Response]]) -> Handler:
            return _hardened(self.guard(fn))

        return [
            Route("/ui", g(self.overview), methods=["GET"]),
            Route("/ui/login", _hardened(self.login), methods=["GET", "POST"]),
            Route("/ui/logout", g(self.logout), methods=["POST"]),
            Route("/ui/invocations", g(self.invocations), methods=["GET"]),
            Route("/ui/invocations/{id}", g(self.invocation), methods=["GET"]),
            Route("/ui/invocations/{id}/cancel", g(self.cancel), methods=["POST"]),
            Route("/ui/parts/overview", g(self.overview_part), methods=["GET"]),
            Route("/ui/parts/charts", g(self.charts_part), methods=["GET"]),
            Route("/ui/parts/invocations", g(self.invocations_part), methods=["GET"]),
            Route("/ui/parts/invocations/{id}", g(self.invocation_part), methods=["GET"]),
            Mount(
                "/ui/static", app=_HardenedApp(StaticFiles(directory=str(HERE / "static"))), name="ui-static"
            ),
        ]


def _hardened(fn: Handler) -> Handler:
    """``fn`` with the dashboard's security headers (:data:`HEADERS`) on every answer."""

    async def wrapped(request: Request) -> Response:
        response = await fn(request)
        response.headers.update(HEADERS)
        return response

    return wrapped


class _HardenedApp:
    """An ASGI app (the static files) whose answers carry :data:`HEADERS`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_hardened(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_RAW_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_hardened)
