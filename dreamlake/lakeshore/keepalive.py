"""The control-plane client's fast path: keep-alive HTTP/1.1 connections, one exchange each.

Measured on this project's 2-core machine against a hello-world on the server's HTTP stack, one
msgpack POST costs the client about 0.9-1.0 ms of CPU through ``httpx.Client`` and 0.22 ms through
``http.client``; most of what was left was ``http.client``'s own (a file object per answer, every
header checked by a regular expression, the answer's head parsed by the ``email`` package). So
:class:`~dreamlake.lakeshore.client.PlaneClient` sends its ordinary requests (``request``) here
when it can: a plain ``http://`` control plane, no transport injected (tests inject
``httpx.MockTransport``), and no proxy set for that host in the environment (httpx honours
``HTTP_PROXY`` / ``ALL_PROXY`` / ``NO_PROXY``; this path does not speak to proxies, so it steps
aside). Streams, downloads, ``https://`` and everything else stay on httpx.

One exchange is a request written in one ``sendall`` (its head and a body of up to 64 KiB in one
segment: the server reads, and wakes, once) and the answer read off the socket: a status line,
headers, then a body of ``Content-Length`` bytes, chunked, or up to the end of the connection;
``1xx`` answers are skipped. Names and values with a CR or LF are refused before anything is sent.

Connections are pooled (a request takes an idle one, or opens one, and puts it back once the
answer was read whole), at most ``MAX_IDLE`` kept idle.

The answer comes back as a :class:`Reply` (status, headers, body): building an ``httpx.Response``
for every answer cost the client more than reading it (a warm worker's CPU per call fell from
0.41 to 0.33 ms without it), so the client takes the reply's body as it is and makes the
``httpx.Response`` (:meth:`Reply.response`) only for a refusal, whose error tree is then the same
on both paths. A failure to connect, send or read, or an answer that is not HTTP/1.x, raises
:class:`KeepAliveError` (the client translates it as it does httpx's transport errors). A
connection the server closed while idle is noticed before reuse (readable with nothing to read)
and replaced, as httpcore does; a request is never sent twice here (the client's retry rule
decides that).
"""

from __future__ import annotations

import json
import re
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

import httpx

__all__ = ["KeepAlive", "KeepAliveError", "Reply", "usable"]

MAX_IDLE = 16  # idle connections kept per client
MAX_HEAD = 64 * 1024  # an answer's status line and headers, at most
MAX_HEADS = 256  # request heads kept built (by method, target and headers)
_JOINED = 64 * 1024  # a body up to this size is sent in the same sendall as the head
_NO_BODY = frozenset({204, 304})
_POLL = hasattr(select, "poll")
_POLL_MAX_S = 2_000_000  # poll's timeout is an int of milliseconds: longer ones keep the socket's
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")  # as http.client refuses them in a request target
_BAD_NAME = re.compile(r"[\x00-\x20\x7f:]|^$")  # in a header name (a token)


class KeepAliveError(Exception):
    """The request did not complete (connect, send or read failed, or timed out)."""


class Reply:
    """One answer: ``status_code``, ``headers`` (names lower-cased; of a repeated name, the last),
    ``content``; :meth:`response` is the same answer as an ``httpx.Response``."""

    __slots__ = ("_lines", "content", "headers", "status_code")

    def __init__(self, status_code: int, lines: list[str], headers: dict[str, str], content: bytes):
        self.status_code = status_code
        self.headers = headers
        self.content = content
        self._lines = lines  # the head's header lines, checked: split into (name, value) on demand

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)

    def response(self) -> httpx.Response:
        return httpx.Response(self.status_code, headers=_pairs(self._lines), content=self.content)


def usable(url: str) -> bool:
    """Whether ``url`` (the control plane's base URL, http or https) can go through this path."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    if not ({parts.scheme, "all"} & set(proxies)):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname))


class _Conn:
    """One keep-alive connection and what of the server's bytes it read past the last answer.

    A plain socket is kept non-blocking and waited on here, with a ``poll`` object made once: a
    socket with a timeout has CPython poll before every ``send`` and ``recv`` and costs a syscall
    to set (each request of a worker's poll loop had six; this way it has four: the idle check, the
    send, the wait for the answer and its read). A TLS socket (decrypted bytes it holds are not the
    socket's to poll for), a platform without ``poll`` and a timeout too long for ``poll`` keep the
    socket's own timeout. Either way a read or a write waits at most the timeout, as before."""

    __slots__ = ("_poll", "buf", "polled", "sock", "timeout_s")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.timeout_s: float | None = None  # as last set (``settimeout`` is a syscall)
        self.polled = False  # whether the socket is non-blocking and waited on by ``_poll``
        self._poll: Any = None
        if _POLL and not isinstance(sock, ssl.SSLSocket):
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN)

    def set_timeout(self, timeout_s: float) -> None:
        if timeout_s == self.timeout_s:
            return
        if self._poll is not None and isinstance(timeout_s, (int, float)) and 0 < timeout_s < _POLL_MAX_S:
            if not self.polled:
                self.sock.setblocking(False)
                self.polled = True
        else:
            self.sock.settimeout(timeout_s)
            self.polled = False
        self.timeout_s = timeout_s

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, data: bytes) -> None:
        """``sendall``, within the timeout (as a whole)."""
        if not self.polled:
            self.sock.sendall(data)
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        timeout_s = self.timeout_s or 0.0
        deadline = time.monotonic() + timeout_s
        view = memoryview(data)[sent:]
        writable = select.poll()
        writable.register(self.sock, select.POLLOUT)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not writable.poll(left * 1000):
                raise TimeoutError("timed out")
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                continue

    def read_some(self) -> bytes:
        """Up to 64 KiB the server sent (b"" once it closed), waiting at most the timeout. (Not
        named ``recv``: bench/_sampler.py takes a frame of that name for a thread waiting.)"""
        if not self.polled:
            return self.sock.recv(65536)
        ms = (self.timeout_s or 0.0) * 1000
        deadline = None
        while True:
            if not self._poll.poll(ms):
                raise TimeoutError("timed out")
            try:
                return self.sock.recv(65536)
            except BlockingIOError:  # readable, then nothing to read: wait what is left
                if deadline is None:
                    deadline = time.monotonic() + ms / 1000
                ms = max(0.0, deadline - time.monotonic()) * 1000

    def _fill(self) -> None:
        data = self.read_some()
        if not data:
            raise ConnectionResetError("the server closed the connection")
        self.buf += data

    def read_head(self) -> tuple[int, str, list[str], dict[str, str], bool]:
        """The next answer's status, version and header lines (the buffer keeps what follows);
        the headers by lower-cased name (of a repeated name, the last), and whether two
        ``Content-Length`` headers differ."""
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buf) > MAX_HEAD:
                raise ValueError(f"an answer's head over {MAX_HEAD} bytes")
            self._fill()
        head = self.buf[:end].decode("latin-1")
        del self.buf[: end + 4]
        lines = head.split("\r\n")
        status_line = lines.pop(0)
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
        fields: dict[str, str] = {}
        clash = False
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"a malformed header line: {line[:80]!r}")
            key, value = name.strip().lower(), value.strip()
            if key == "content-length" and fields.get(key, value) != value:
                clash = True
            fields[key] = value
        return int(rest.partition(" ")[0]), version, lines, fields, clash

    def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        if len(self.buf) == n:  # the answer's last bytes (the usual case): one copy
            out = bytes(self.buf)
            self.buf.clear()
            return out
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            while b"\r\n" not in self.buf:
                if len(self.buf) > MAX_HEAD:
                    raise ValueError("a malformed chunk size line")
                self._fill()
            line, _, _ = bytes(self.buf[: self.buf.index(b"\r\n")]).partition(b";")
            del self.buf[: self.buf.index(b"\r\n") + 2]
            size = int(line.strip(), 16)
            if size == 0:  # the trailer, up to an empty line
                while True:
                    while b"\r\n" not in self.buf:
                        if len(self.buf) > MAX_HEAD:
                            raise ValueError("a chunked answer's trailer line is too long")
                        self._fill()
                    at = self.buf.index(b"\r\n")
                    del self.buf[: at + 2]
                    if at == 0:
                        return bytes(body)
            body += self.read_exactly(size + 2)[:-2]

    def read_to_end(self) -> bytes:
        body = bytearray(self.buf)
        self.buf.clear()
        while True:
            data = self.read_some()
            if not data:
                return bytes(body)
            body += data


class KeepAlive:
    """Requests to one ``http://host:port`` base URL over a pool of keep-alive connections: a
    request takes an idle one (or opens one) and puts it back when the answer was read whole, so
    threads share a few connections and none outlives :meth:`close`."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        connect_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        self._host = parts.hostname or "127.0.0.1"
        secure = parts.scheme == "https"
        # https: each connection is wrapped in ``ssl_context`` (the client's CA file and client
        # certificate, tls.py), the server's name checked against its certificate
        self._ssl = (ssl_context or ssl.create_default_context()) if secure else None
        default = 443 if secure else 80
        self._port = parts.port or default
        self._prefix = parts.path.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = host if self._port == default else f"{host}:{self._port}"
        self._headers = dict(headers)
        self._connect_s = connect_timeout_s
        self._idle: list[_Conn] = []
        self._heads: dict[tuple[str, str, tuple[tuple[str, str], ...]], bytes] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> _Conn | None:
        """An idle connection still open; None: open a new one."""
        while True:
            with self._lock:
                if self._closed:
                    raise KeepAliveError("the client is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return None
            if not conn.buf and not (conn._poll.poll(0) if conn.polled else _dropped(conn.sock)):
                return conn  # nothing readable on an idle connection: the server did not close it
            conn.close()

    def _give_back(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def _head(self, method: str, target: str, headers: dict[str, str] | None, length: int | None) -> bytes:
        """The request's head; all but its ``Content-Length`` checked and built once per method,
        target and headers (a worker sends the same few requests all day)."""
        key = (method, target, tuple(headers.items()) if headers else ())
        start = self._heads.get(key)
        if start is None:
            start = self._head_start(method, target, headers)
            if len(self._heads) >= MAX_HEADS:
                self._heads.clear()
            self._heads[key] = start
        if length is None:
            return start + b"\r\n"
        return b"%sContent-Length: %d\r\n\r\n" % (start, length)

    def _head_start(self, method: str, target: str, headers: dict[str, str] | None) -> bytes:
        sent = {**self._headers, **(headers or {})}
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}", "Accept-Encoding: identity"]
        lines += [f"{name}: {value}" for name, value in sent.items()]
        if any("\r" in line or "\n" in line for line in lines):
            raise KeepAliveError("a request header or its target holds a line break; not sent")
        if _BAD_TARGET.search(target) or any(_BAD_NAME.search(name) for name in sent):
            raise KeepAliveError(
                f"a request target or header name with a control character, space or colon ({target[:80]!r}); "
                "not sent: quote it (urllib.parse.quote)"
            )
        return ("\r\n".join(lines) + "\r\n").encode("latin-1")

    def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None,
        headers: dict[str, str] | None,
        params: dict[str, Any] | None,
        read_timeout_s: float,
    ) -> Reply:
        target = self._prefix + path
        if params:
            query = {k: ("true" if v is True else "false" if v is False else v) for k, v in params.items()}
            target += "?" + urllib.parse.urlencode(query)
        length = len(content) if content is not None else (0 if method in ("POST", "PUT", "PATCH") else None)
        try:
            head = self._head(method, target, headers, length)
        except UnicodeEncodeError as exc:
            raise KeepAliveError(f"a request header is not latin-1: {exc}") from exc
        conn = self._take()
        try:
            if conn is None:
                sock = socket.create_connection((self._host, self._port), timeout=self._connect_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    try:
                        sock = self._ssl.wrap_socket(sock, server_hostname=self._host)
                    except BaseException:
                        sock.close()
                        raise
                conn = _Conn(sock)
            conn.set_timeout(read_timeout_s)
            if content and len(content) > _JOINED:
                conn.send(head)
                conn.send(content)
            else:
                conn.send(head + content if content else head)
            status, version, answer, fields, clash = conn.read_head()
            # an interim answer (100 Continue, 102, 103 Early Hints a proxy may add): the answer
            # follows, as http.client skips them; 101 (a protocol switch) is not one
            while 100 <= status < 200 and status != 101:
                status, version, answer, fields, clash = conn.read_head()
            if clash:
                raise ValueError(f"two different Content-Length headers: {_lengths(answer)}")
            connection = fields.get("connection")
            will_close = connection is not None and "close" in connection.lower()
            if version == "HTTP/1.0" and not will_close:
                will_close = "keep-alive" not in (connection or "").lower()
            encoding = fields.get("transfer-encoding")
            if method == "HEAD" or status in _NO_BODY or 100 <= status < 200:
                body = b""
            elif encoding is not None and "chunked" in encoding.lower():
                body = conn.read_chunked()
            elif "content-length" in fields:
                length_text = fields["content-length"]
                if not length_text.isdigit():
                    raise ValueError(f"a bad Content-Length: {length_text[:40]!r}")
                body = conn.read_exactly(int(length_text))
            else:
                body = conn.read_to_end()
                will_close = True
        except (OSError, ValueError) as exc:
            if conn is not None:
                conn.close()
            raise KeepAliveError(f"{type(exc).__name__}: {exc}") from exc
        if will_close:
            conn.close()
        else:
            self._give_back(conn)
        return Reply(status, answer, fields, body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._idle = self._idle, []
        for conn in conns:
            conn.close()


def _pairs(lines: list[str]) -> list[tuple[str, str]]:
    """Header lines (each checked to hold a colon) as (name, value) pairs, as sent but stripped."""
    pairs = []
    for line in lines:
        name, _, value = line.partition(":")
        pairs.append((name.strip(), value.strip()))
    return pairs


def _lengths(lines: list[str]) -> str:
    """The first two different ``Content-Length`` values of an answer's header lines, as the
    refusal names them."""
    seen: list[str] = []
    for name, value in _pairs(lines):
        if name.lower() == "content-length" and value not in seen:
            seen.append(value)
    return ", ".join(repr(v) for v in seen[:2])


def _dropped(sock: Any) -> bool:
    """An idle keep-alive socket that is readable has been closed by the server (or sent junk)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True  # decrypted bytes nobody asked for
    try:
        if _POLL:  # select.select refuses a descriptor of 1024 and more: a busy process has those
            once = select.poll()
            once.register(sock, select.POLLIN)
            return bool(once.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
