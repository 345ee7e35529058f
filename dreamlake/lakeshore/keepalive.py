"""The control-plane client's fast path: keep-alive ``http.client`` connections.

Measured on this project's 2-core machine against a hello-world on the server's HTTP stack, one
msgpack POST costs the client about 0.9-1.0 ms of CPU through ``httpx.Client`` and 0.22 ms through
``http.client``: for the short calls of a warm
worker and a waiting producer, httpx's request building was most of the client's cost. So
:class:`~dreamlake.lakeshore.client.PlaneClient` sends its ordinary requests (``request``) here
when it can: a plain ``http://`` control plane, no transport injected (tests inject
``httpx.MockTransport``), and no proxy set for that host in the environment (httpx honours
``HTTP_PROXY`` / ``ALL_PROXY`` / ``NO_PROXY``; this path does not speak to proxies, so it steps
aside). Streams, downloads, ``https://`` and everything else stay on httpx.

Connections are pooled (a request takes an idle one, or opens one, and puts it back once the
answer was read whole), at most ``MAX_IDLE`` kept idle.

The answer comes back as an ``httpx.Response`` (status, headers, body), so the client's error tree
and decoding are the same on both paths. A failure to connect, send or read raises
:class:`KeepAliveError` (the client translates it as it does httpx's transport errors). A
connection the server closed while idle is noticed before reuse (readable with nothing to read)
and replaced, as httpcore does; a request is never sent twice here (the client's retry rule
decides that).
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import urllib.parse
import urllib.request
from typing import Any

import httpx

__all__ = ["KeepAlive", "KeepAliveError", "usable"]

MAX_IDLE = 16  # idle connections kept per client
# Linux's TCP_CORK: http.client writes a request's head and body in two sends, which with
# TCP_NODELAY leave as two segments, and the server reads (and wakes for) each; corked around the
# two sends, they leave as one. None where the platform has no such option.
_CORK: int | None = getattr(socket, "TCP_CORK", None)


class KeepAliveError(Exception):
    """The request did not complete (connect, send or read failed, or timed out)."""


def usable(url: str) -> bool:
    """Whether ``url`` (the control plane's base URL) can go through this path."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    if not ({"http", "all"} & set(proxies)):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname))


class KeepAlive:
    """Requests to one ``http://host:port`` base URL over a pool of keep-alive connections: a
    request takes an idle one (or opens one) and puts it back when the answer was read whole, so
    threads share a few connections and none outlives :meth:`close`."""

    def __init__(self, base_url: str, headers: dict[str, str], *, connect_timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(base_url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._headers = dict(headers)
        self._connect_s = connect_timeout_s
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                if self._closed:
                    raise KeepAliveError("the client is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return http.client.HTTPConnection(self._host, self._port, timeout=self._connect_s)
            if conn.sock is not None and not _dropped(conn.sock):
                return conn
            conn.close()

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None,
        headers: dict[str, str] | None,
        params: dict[str, Any] | None,
        read_timeout_s: float,
    ) -> httpx.Response:
        target = self._prefix + path
        if params:
            query = {k: ("true" if v is True else "false" if v is False else v) for k, v in params.items()}
            target += "?" + urllib.parse.urlencode(query)
        sent = {**self._headers, **(headers or {})}
        conn = self._take()
        try:
            if conn.sock is None:
                conn.connect()
                assert conn.sock is not None
                # http.client sends the headers and the body apart: no Nagle wait for the body
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert conn.sock is not None
            conn.sock.settimeout(read_timeout_s)
            cork = _CORK if content else None
            if cork is not None:  # the head and the body in one segment (http.client sends them apart)
                conn.sock.setsockopt(socket.IPPROTO_TCP, cork, 1)
            try:
                conn.request(method, target, body=content, headers=sent)
            finally:
                if cork is not None and conn.sock is not None:
                    conn.sock.setsockopt(socket.IPPROTO_TCP, cork, 0)  # uncorked: sent now
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise KeepAliveError(f"{type(exc).__name__}: {exc}") from exc
        if resp.will_close:
            conn.close()
        else:
            self._give_back(conn)
        return httpx.Response(resp.status, headers=resp.getheaders(), content=body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._idle = self._idle, []
        for conn in conns:
            conn.close()


def _dropped(sock: Any) -> bool:
    """An idle keep-alive socket that is readable has been closed by the server (or sent junk)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
