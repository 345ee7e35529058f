"""Serving the app: uvicorn with read deadlines and a connection cap, so idle sockets cannot pile up.

uvicorn alone holds a connection that sends part of a request for ever: its ``timeout_keep_alive``
only covers the silence between requests and is reset by every byte, and an ASGI middleware runs
only once the headers are in. :class:`GuardedH11Protocol` adds, per connection:

- a **header deadline** (``header_timeout_s``): the request line and headers must be complete
  within that many seconds of the connection opening, or of the previous response (a trickle of
  bytes does not extend it);
- a **body idle timeout** (``body_timeout_s``): while a body is being received, a pause longer
  than that closes the connection (the handler sees a client that left);
- a **connection cap** (``max_connections``): a connection beyond it is closed as soon as it is
  accepted, before it costs a buffer or a task.

Headers are bounded by h11's ``max_incomplete_event_size`` (``max_header_bytes``). Nothing is
armed while the app works on a request, so long polls and streams are never cut. ``uvicorn_config``
builds the uvicorn Config the CLI and the tests serve with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, ClassVar

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

from dreamlake.lakeshore.server.config import ServerConfig

log = logging.getLogger(__name__)

_CAP_LOG_EVERY_S = 10.0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and the cap of the module docstring."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    max_connections: ClassVar[int] = 2048
    _cap_logged_at: ClassVar[float] = 0.0

    _timer: asyncio.TimerHandle | None = None
    _timer_for: str | None = None  # "headers" or "body": what the armed timer waits for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - GuardedH11Protocol._cap_logged_at > _CAP_LOG_EVERY_S:
                GuardedH11Protocol._cap_logged_at = now
                log.warning(
                    "connection cap reached (%d open): closing new connections at once", self.max_connections
                )
            self.transport.close()
            return
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._rearm(fresh_body=True)

    def handle_events(self) -> None:
        super().handle_events()
        self._rearm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._rearm()

    def _rearm(self, *, fresh_body: bool = False) -> None:
        """Arm the timer the connection's state calls for: the header deadline while waiting for a
        request (armed once per request), the body idle timer while receiving a body (re-armed by
        every chunk), none otherwise."""
        if self.transport is None or self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._timer_for != "headers":
                self._arm("headers", self.header_timeout_s)
        elif state is h11.SEND_BODY:
            if self._timer_for != "body" or fresh_body:
                self._arm("body", self.body_timeout_s)
        else:
            self._disarm()

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


def guarded_protocol(config: ServerConfig) -> type[GuardedH11Protocol]:
    """:class:`GuardedH11Protocol` with ``config``'s limits (uvicorn builds protocols by class)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout_s": config.header_timeout_s,
            "body_timeout_s": config.body_timeout_s,
            "max_connections": config.max_connections,
        },
    )


def uvicorn_config(app: Any, config: ServerConfig, **options: Any) -> Config:
    """The uvicorn Config that serves ``app`` with ``config``'s read deadlines, cap and header bound;
    ``options`` (host, port, log_level, ...) go to uvicorn as given."""
    return Config(
        app,
        http=guarded_protocol(config),
        timeout_keep_alive=max(1, int(config.keep_alive_s)),
        h11_max_incomplete_event_size=config.max_header_bytes,
        **options,
    )
