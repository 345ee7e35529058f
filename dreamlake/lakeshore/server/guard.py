"""The connections' guard of the control plane's HTTP server (``server/serve.py`` serves with it).

uvicorn alone holds a connection that sends part of a request for ever: its ``timeout_keep_alive``
only covers the silence between requests and is reset by every byte, and an ASGI middleware runs
only once the headers are in. The guard (:class:`GuardedHttpToolsProtocol`, or
:class:`GuardedH11Protocol` when serving with h11) adds, per connection:

- a **header deadline** (``header_timeout_s``): the request line and headers must be complete
  within that many seconds of the connection opening, or of the first byte of the next request on
  a kept-alive connection (a trickle of bytes does not extend it). Between requests the silence
  is uvicorn's ``timeout_keep_alive`` (``keep_alive_s``, 30 s): longer than nymph's heartbeat
  period (10 s), so a fleet's heartbeats and acks reuse their connections instead of paying a TCP
  and protocol set-up each (at 1,000 nymphs that was about 100 connections a second);
- a **body idle timeout** (``body_timeout_s``): while a body is being received, a pause longer
  than that closes the connection (the handler sees a client that left);
- a **connection cap** (``max_connections``): a connection beyond it is closed as soon as it is
  accepted, before it costs a buffer or a task.

Unfinished headers are bounded (``max_header_bytes``, ``LAKESHORE_MAX_HEADER_BYTES``): a request
whose headers pile up past it is refused (httptools: 431; h11: uvicorn's 400) and its connection
closed. Nothing is armed while the app works on a request, so long polls and streams are never cut.

The parser is httptools when installed (the ``server`` extra installs it; about half the CPU of
h11 per request here), else h11; ``LAKESHORE_HTTP_PARSER=h11`` (or ``httptools``) picks one
(:func:`http_parser`). The guard follows h11's connection state, and httptools' callbacks (which
keep no state and set no bound of their own), so both parsers hold the same limits. The event
loop is ``uvloop`` when installed, else asyncio (:func:`event_loop`). Each connection writes
through a :class:`CoalescingTransport`: a response's pieces leave in one write, as soon as the
response is complete (a streamed body's chunks at the end of each turn of the loop).
``uvicorn_config`` builds the uvicorn Config a single process (and the tests) serve with.

The guard subclasses uvicorn's protocol classes, which are not uvicorn's public API, so
pyproject.toml pins uvicorn to the one minor range the slow-client tests
(tests/security/test_slow_clients.py, tests/unit/test_coalescing_transport.py) pass on; a new uvicorn minor moves the pin
together with a run of those tests.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed (the ``server`` extra installs it)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.server.config import ServerConfig

log = logging.getLogger(__name__)

PARSER_ENV = "LAKESHORE_HTTP_PARSER"

_CAP_LOG_EVERY_S = 10.0


class CoalescingTransport:
    """A transport whose writes within one turn of the event loop leave in one ``write``.

    uvicorn's h11 protocol writes a response in three pieces (status line and headers, body, end
    of message), each a ``send`` syscall and, with ``TCP_NODELAY``, a packet of its own: for the
    control plane's small msgpack answers that was about a fifth of the event loop's time and three
    wake-ups of the reader. Here the pieces are joined and written once, at the end of the current
    turn of the loop (``call_soon``): a streamed body is not held back beyond that turn. ``close``
    and ``write_eof`` write what is pending first; ``abort`` drops it. Everything else is the
    wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._armed = False
        # the wrapped transport's methods uvicorn calls on every request, bound once: each one
        # through ``__getattr__`` cost a failed lookup first (3 % of the loop under submit load)
        for name in ("is_closing", "get_extra_info", "pause_reading", "resume_reading", "is_reading"):
            method = getattr(transport, name, None)
            if method is not None:
                setattr(self, name, method)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._pending.append(bytes(data))
        if not self._armed:
            self._armed = True
            self._loop.call_soon(self.flush)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._armed = False
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Guard(asyncio.Protocol):
    """The guard of the module docstring, less what depends on the parser: the connection cap,
    the two timers, and the shutdown that lets long requests answer first. Mixed in before
    uvicorn's protocol class (which gives ``loop``, ``transport``, ``app``, ``client`` and
    ``connections``)."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    max_connections: ClassVar[int] = 10240
    max_header_bytes: ClassVar[int] = 64 * 1024  # httptools (h11 is handed it by uvicorn)
    _cap_logged_at: ClassVar[float] = 0.0

    _timer: asyncio.TimerHandle | None = None
    _timer_for: str | None = None  # "headers" or "body": what the armed timer waits for

    if TYPE_CHECKING:
        loop: asyncio.AbstractEventLoop
        transport: Any
        app: Any
        client: tuple[str, int] | None
        connections: set[Any]

    def _answered(self) -> None:
        """A response is complete: its pieces leave now, in one write, rather than at the end of
        the loop's turn. The callbacks that turn runs after this one (the route that handed this
        response its answer going on: a submit-and-wait that handed a waiting poll its claim, a
        poll whose acks answered a waiting producer) no longer hold the answer back."""
        if isinstance(self.transport, CoalescingTransport):
            self.transport.flush()

    def _accept(self, transport: asyncio.Transport) -> bool:
        """Right after uvicorn's ``connection_made``: write through a :class:`CoalescingTransport`,
        and close a connection past the cap (False)."""
        # every request cycle of the connection writes through it (they take self.transport)
        self.transport = CoalescingTransport(transport, self.loop)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - _Guard._cap_logged_at > _CAP_LOG_EVERY_S:
                _Guard._cap_logged_at = now
                log.warning(
                    "connection cap reached (%d open): closing new connections at once", self.max_connections
                )
            self.transport.close()
            return False
        return True

    def shutdown(self) -> None:
        """uvicorn's shutdown of this connection (the server stopped accepting): first let the
        control plane answer its long requests now (:meth:`Context.begin_shutdown`), so a poll
        in flight ends as an empty answer, not cancelled after the graceful timeout."""
        ctx = plane_context(self.app)
        if ctx is not None:
            ctx.begin_shutdown()
        super().shutdown()  # type: ignore[misc]

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._timer_for = what
        self._timer = self.loop.call_later(seconds, self._expired, what)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_for = None

    def _expired(self, what: str) -> None:
        self._timer = None
        self._timer_for = None
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.debug("closing the connection of %s: its request %s did not arrive in time", client, what)
        self.transport.close()


class GuardedH11Protocol(_Guard, H11Protocol):
    """uvicorn's h11 protocol with the guard; the timers follow h11's connection state."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._accept(transport):
            self._rearm(request_began=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._rearm(fresh_body=True, request_began=True)

    def handle_events(self) -> None:
        super().handle_events()
        self._rearm()

    def on_response_complete(self) -> None:
        self._answered()
        super().on_response_complete()
        self._rearm()

    def _rearm(self, *, fresh_body: bool = False, request_began: bool = False) -> None:
        """Arm the timer the connection's state calls for: the header deadline once a request has
        begun (the connection opened, or a byte of the next request arrived) and until its headers
        are in (armed once per request), the body idle timer while receiving a body (re-armed by
        every chunk), none otherwise: a kept-alive connection's silence between requests is
        uvicorn's keep-alive timeout, which the first byte of a request cancels."""
        if self.transport is None or self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._timer_for != "headers":
                if request_began:
                    self._arm("headers", self.header_timeout_s)
                else:
                    self._disarm()
        elif state is h11.SEND_BODY:
            if self._timer_for != "body" or fresh_body:
                self._arm("body", self.body_timeout_s)
        else:
            self._disarm()


if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol with the guard. httptools keeps no state to read and no
        bound on headers, so this one follows the parser's callbacks: ``_phase`` is "headers"
        from a request's first byte (or the connection's opening) until its headers are in,
        "body" until its message is complete, "idle" between requests. The header bound counts
        every byte received while a request's headers are incomplete; a request over it is
        answered 431 and its connection closed (at most one read past the bound is parsed).

        As with h11, nothing is armed for a request while an earlier one of the connection is
        still being answered (uvicorn queues a pipelined request and stops reading until then):
        its deadline starts when the answer is complete. And a request whose answer went out
        before its body was read (a 401, a 413) gets uvicorn's keep-alive timeout once the body
        is in, which uvicorn itself would not start again."""

        _phase = "headers"
        _head_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self._accept(transport):
                self._rearm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._phase == "idle":  # the first byte of the next request
                self._phase, self._head_bytes = "headers", 0
            if self._phase == "headers":
                self._head_bytes += len(data)
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
            elif self._phase == "headers" and self._head_bytes > self.max_header_bytes:
                self._refuse_headers()
            else:
                self._rearm(fresh_body=True)

        def on_message_begin(self) -> None:
            if self._phase != "headers":  # a request pipelined behind the last one
                self._phase, self._head_bytes = "headers", 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._phase = "body"
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._phase = "idle"  # nothing armed while the app answers; then uvicorn's keep-alive
            self._disarm()
            super().on_message_complete()
            cycle = self.cycle
            answered = cycle is not None and cycle.response_complete and not self.pipeline
            if answered and not self.transport.is_closing():
                # answered before its body was all in: the body's bytes cancelled the keep-alive
                # timeout uvicorn started with the answer, and it starts none again
                self._unset_keepalive_if_required()
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

        def on_response_complete(self) -> None:
            self._answered()
            super().on_response_complete()  # may start a queued request and read again
            self._rearm()

        def _rearm(self, *, fresh_body: bool = False) -> None:
            """Arm the timer the phase calls for: the header deadline (once per request) while a
            request's headers come in, the body idle timer (re-armed by every chunk) while its
            body does; none while an earlier request is still being answered, none between
            requests."""
            if self.transport is None or self.transport.is_closing():
                self._disarm()
                return
            cycle = self.cycle  # the last request whose headers were in
            if self._phase == "headers":
                if cycle is not None and not cycle.response_complete:
                    self._disarm()  # the request before it is still being answered
                elif self._timer_for != "headers":
                    self._arm("headers", self.header_timeout_s)
            elif self._phase == "body":
                if self.pipeline:
                    self._disarm()  # queued behind an earlier request: not read until its turn
                elif fresh_body or self._timer_for != "body":
                    self._arm("body", self.body_timeout_s)
            else:
                self._disarm()

        def _refuse_headers(self) -> None:
            self._disarm()
            body = (
                f"request headers over {self.max_header_bytes} bytes: send fewer or shorter headers "
                "(the server's limit is LAKESHORE_MAX_HEADER_BYTES)"
            ).encode()
            head = (
                "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            ).encode()
            self.transport.write(head + body)
            self.transport.close()


def plane_context(app: Any) -> Any:
    """The control plane's :class:`Context` under ``app`` and the middleware uvicorn wraps it
    in (each keeps the app it wraps as ``.app``); None for another app."""
    for _ in range(8):
        ctx = getattr(getattr(app, "state", None), "ctx", None)
        if ctx is not None and hasattr(ctx, "begin_shutdown"):
            return ctx
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def event_loop() -> str:
    """uvicorn's ``loop`` setting: uvloop when installed, else asyncio."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def http_parser() -> str:
    """The HTTP parser to serve with: ``httptools`` when installed (the ``server`` extra installs
    it), else ``h11``; ``LAKESHORE_HTTP_PARSER=h11`` (or ``httptools``) picks one."""
    wanted = envvars.choice(PARSER_ENV)  # httptools | h11 | None; another value is a ValueError
    if HttpToolsProtocol is None:
        if wanted == "httptools":
            raise ValueError(
                f"{PARSER_ENV}=httptools, but httptools is not installed: "
                "pip install 'dreamlake-lakeshore[server]' (or unset the variable to serve with h11)"
            )
        return "h11"
    return wanted or "httptools"


def protocol_class(parser: str | None = None) -> type[_Guard]:
    """The guarded protocol class of ``parser`` (default :func:`http_parser`)."""
    if (parser or http_parser()) == "httptools":
        return GuardedHttpToolsProtocol
    return GuardedH11Protocol


def _limits(config: ServerConfig) -> dict[str, Any]:
    return {
        "header_timeout_s": config.header_timeout_s,
        "body_timeout_s": config.body_timeout_s,
        "max_connections": config.max_connections,
        "max_header_bytes": config.max_header_bytes,
    }


def guarded_protocol(config: ServerConfig, parser: str | None = None) -> type[_Guard]:
    """The guarded protocol of ``parser`` with ``config``'s limits (uvicorn builds protocols by class)."""
    base = protocol_class(parser)
    return type(base.__name__, (base,), _limits(config))


def guard_options(config: ServerConfig) -> dict[str, Any]:
    """The uvicorn settings behind the guard, but the protocol class: keep-alive and header bound."""
    return {
        "timeout_keep_alive": max(1, int(config.keep_alive_s)),
        "h11_max_incomplete_event_size": config.max_header_bytes,
        # uvicorn logs at "warning", so its access lines never print; left on, every response
        # still formatted the client address and the quoted path for them
        "access_log": False,
    }


def uvicorn_config(app: Any, config: ServerConfig, *, parser: str | None = None, **options: Any) -> Config:
    """The uvicorn Config that serves ``app`` with ``config``'s read deadlines, cap and header bound,
    parsing with ``parser`` (default :func:`http_parser`); ``options`` (host, port, log_level,
    loop, ...) go to uvicorn as given."""
    return Config(app, http=guarded_protocol(config, parser), **guard_options(config), **options)


def set_process_limits(config: ServerConfig) -> None:
    """Give every guarded protocol of this process ``config``'s limits: a worker process of
    ``--workers N`` gets its protocol class by name from its parent (a class made by
    :func:`guarded_protocol` cannot be handed down), so the limits are set on the class itself."""
    for name, value in _limits(config).items():
        setattr(_Guard, name, value)
