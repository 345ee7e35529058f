"""The client's keep-alive fast path (``dreamlake.lakeshore.keepalive``) against a real HTTP server
on loopback: the same requests and answers as httpx sends, connections reused, a connection the
server closed while idle replaced, errors translated the same way, and when it steps aside."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from dreamlake.lakeshore import errors
from dreamlake.lakeshore.client import PlaneClient
from dreamlake.lakeshore.keepalive import usable
from tests.stack.procs import busy_descriptors


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    seen: list[dict[str, Any]] = []
    close_after: str = ""  # "said": close after the answer with Connection: close; "silent": without

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(
            {
                "path": self.path,
                "auth": self.headers.get("Authorization"),
                "ctype": self.headers.get("Content-Type"),
                "body": msgpack.unpackb(body) if body else None,
                "peer": self.client_address[1],
            }
        )
        status = 409 if self.path.startswith("/conflict") else 200
        out = msgpack.packb({"error": "superseded"} if status == 409 else {"ok": True, "n": len(self.seen)})
        self.send_response(status)
        self.send_header("Content-Type", "application/x-msgpack")
        self.send_header("Content-Length", str(len(out)))
        if type(self).close_after == "said":
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(out)
        if type(self).close_after:
            self.close_connection = True


class _Server(http.server.ThreadingHTTPServer):
    closed = threading.Semaphore(0)  # released each time the server closed a connection

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        self.closed.release()


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {"seen": [], "close_after": ""})
    srv = _Server(("127.0.0.1", 0), handler)
    srv.closed = threading.Semaphore(0)
    handler.server_closed = srv.closed  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
        srv.server_close()


def test_requests_go_over_one_reused_connection_with_token_and_msgpack(
    server: tuple[str, type[_Handler]],
) -> None:
    url, handler = server
    client = PlaneClient(url, "lsk_tok")
    assert client._fast is not None  # a plain http:// control plane takes the fast path
    try:
        assert client.request("POST", "/v1/daemon/ack", {"blob": b"\x00\xff"}) == {"ok": True, "n": 1}
        assert client.request("POST", "/v1/daemon/poll", {"q": [1]}, params={"since": 3, "x": True})["n"] == 2
    finally:
        client.close()
    first, second = handler.seen
    assert first["path"] == "/v1/daemon/ack" and second["path"] == "/v1/daemon/poll?since=3&x=true"
    assert first["auth"] == "Bearer lsk_tok" and first["ctype"] == "application/x-msgpack"
    assert first["body"] == {"blob": b"\x00\xff"}
    assert first["peer"] == second["peer"]  # the same connection, kept alive


@pytest.mark.parametrize("how", ["said", "silent"])
def test_a_connection_the_server_closed_is_replaced(server: tuple[str, type[_Handler]], how: str) -> None:
    """Closed with ``Connection: close``, or silently while idle (noticed before reuse)."""
    url, handler = server
    handler.close_after = how
    client = PlaneClient(url, "lsk_tok")
    answers = []
    try:
        for i in range(3):
            answers.append(client.request("POST", "/x", {"i": i})["n"])
            assert handler.server_closed.acquire(timeout=10)  # type: ignore[attr-defined]
    finally:
        client.close()
    assert answers == [1, 2, 3]
    assert len({s["peer"] for s in handler.seen}) == 3


def test_a_refusal_and_an_unreachable_server_raise_the_same_errors(
    server: tuple[str, type[_Handler]],
) -> None:
    url, _handler = server
    client = PlaneClient(url, "lsk_tok")
    with pytest.raises(errors.Conflict, match="superseded"):
        client.request("POST", "/conflict", {})
    client.close()
    gone = PlaneClient("http://127.0.0.1:9", "lsk_tok")  # nothing listens on the discard port
    with pytest.raises(errors.Unavailable, match=r"cannot reach the control plane at http://127\.0\.0\.1:9"):
        gone.request("POST", "/v1/daemon/ack", {})
    gone.close()


def test_proxies_stay_on_httpx_and_https_takes_the_fast_path_over_tls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
        "NO_PROXY",
        "no_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    assert usable("http://cp.example:8470")
    assert usable("https://cp.example:8470")  # ssl-wrapped sockets (tests/security/test_tls.py)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert not usable("https://cp.example:8470") and usable("http://cp.example:8470")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert not usable("http://cp.example:8470")
    monkeypatch.setenv("NO_PROXY", "cp.example")
    assert usable("http://cp.example:8470")


@pytest.mark.skipif(not hasattr(socket, "TCP_CORK"), reason="TCP_CORK is Linux's")
def test_a_requests_head_and_body_leave_in_one_segment() -> None:
    """A request's head and body go in one write: they reach the server's first read together (one
    wake-up of the server per request, not two), and the socket is never left corked."""
    from dreamlake.lakeshore.keepalive import KeepAlive

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    first: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            first.append(conn.recv(65536))  # returns as soon as the first segment is in
            answer = b"\x81\xa2ok\xc3"
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/x-msgpack\r\nContent-Length: {len(answer)}\r\n\r\n"
            conn.sendall(head.encode() + answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = KeepAlive(f"http://127.0.0.1:{port}", {"Authorization": "Bearer t"}, connect_timeout_s=5)
    try:
        body = msgpack.packb({"x": "y" * 300})
        resp = client.request(
            "POST", "/v1/daemon/poll", content=body, headers={"Content-Type": "application/x-msgpack"},
            params=None, read_timeout_s=5,
        )  # fmt: skip
        (kept,) = client._idle  # back in the pool, not corked
        assert kept.sock is not None and kept.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0
    finally:
        client.close()
        thread.join(5)
        listener.close()
    assert resp.status_code == 200 and msgpack.unpackb(resp.content) == {"ok": True}
    assert first and first[0].startswith(b"POST /v1/daemon/poll ") and first[0].endswith(body)


def _one_answer(answer: bytes) -> tuple[str, list[bytes]]:
    """A server that reads one request and writes ``answer`` (raw bytes), then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            seen.append(conn.recv(65536))
            conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{port}", seen


@pytest.mark.parametrize(
    ("answer", "body", "kept"),
    [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n",
            b"abcde",
            True,
        ),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", True),
        (  # a proxy's Early Hints: an interim answer too (it was taken for the answer, body empty)
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            b"ok",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", b"ok", False),
        (b"HTTP/1.0 200 OK\r\n\r\nup to the end", b"up to the end", False),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
    ],
)
def test_answers_are_read_as_http_frames_them(answer: bytes, body: bytes, kept: bool) -> None:
    from dreamlake.lakeshore.keepalive import KeepAlive

    url, seen = _one_answer(answer)
    client = KeepAlive(url, {"Authorization": "Bearer t"}, connect_timeout_s=5)
    try:
        resp = client.request(
            "GET", "/v1/x", content=None, headers=None, params={"a": True}, read_timeout_s=5
        )
        assert resp.content == body and len(client._idle) == (1 if kept else 0)
    finally:
        client.close()
    head = seen[0].decode()
    assert head.startswith("GET /v1/x?a=true HTTP/1.1\r\n") and "\r\nAuthorization: Bearer t\r\n" in head


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort",
    ],
)
def test_an_answer_that_is_not_http_or_stops_short_is_a_keepalive_error(answer: bytes) -> None:
    from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError

    url, _seen = _one_answer(answer)
    client = KeepAlive(url, {}, connect_timeout_s=5)
    try:
        with pytest.raises(KeepAliveError):
            client.request("POST", "/v1/x", content=b"x", headers=None, params=None, read_timeout_s=5)
        assert client._idle == []  # a broken connection is not kept
    finally:
        client.close()


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError

    client = KeepAlive("http://127.0.0.1:9", {"Authorization": "Bearer t"}, connect_timeout_s=1)
    try:
        with pytest.raises(KeepAliveError, match="line break"):
            client.request(
                "POST",
                "/v1/x",
                content=b"",
                headers={"X-Evil": "a\r\nInjected: yes"},
                params=None,
                read_timeout_s=1,
            )
    finally:
        client.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\nabcdefgh",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nabcde",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"x" * (70 * 1024),
    ],
)
def test_an_answer_with_a_bad_length_or_an_endless_trailer_is_an_error_not_a_short_body(
    answer: bytes,
) -> None:
    from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError

    url, _seen = _one_answer(answer)
    client = KeepAlive(url, {}, connect_timeout_s=5)
    try:
        with pytest.raises(KeepAliveError):
            client.request("GET", "/v1/x", content=None, headers=None, params=None, read_timeout_s=5)
    finally:
        client.close()


@pytest.mark.parametrize(
    ("path", "headers"), [("/v1/topics/a b/post", {}), ("/v1/x\x00", {}), ("/v1/x", {"Bad:Name": "v"})]
)
def test_a_target_or_header_name_http_client_refuses_is_refused_before_sending(
    path: str, headers: dict[str, str]
) -> None:
    from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError

    client = KeepAlive("http://127.0.0.1:9", {}, connect_timeout_s=1)
    try:
        with pytest.raises(KeepAliveError, match="not sent"):
            client.request("GET", path, content=None, headers=headers, params=None, read_timeout_s=1)
    finally:
        client.close()


def test_two_different_content_lengths_are_named_in_the_error() -> None:
    from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError

    url, _seen = _one_answer(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nabcde"
    )
    client = KeepAlive(url, {}, connect_timeout_s=5)
    try:
        with pytest.raises(KeepAliveError, match="two different Content-Length headers: '2', '5'"):
            client.request("GET", "/v1/x", content=None, headers=None, params=None, read_timeout_s=5)
    finally:
        client.close()


def test_header_lines_seen_before_read_the_same_and_a_refusal_keeps_them_as_sent() -> None:
    """Answer header lines are split once and remembered: the same answer twice reads the same,
    and the ``httpx.Response`` of a refusal has the headers with their names as sent."""
    from dreamlake.lakeshore.keepalive import KeepAlive

    answer = b"HTTP/1.1 429 Too Many\r\nRetry-After:  7 \r\nX-Odd:a:b\r\nContent-Length: 2\r\n\r\nno"
    for _ in range(2):
        url, _seen = _one_answer(answer)
        client = KeepAlive(url, {}, connect_timeout_s=5)
        try:
            resp = client.request("GET", "/v1/x", content=None, headers=None, params=None, read_timeout_s=5)
        finally:
            client.close()
        assert (resp.status_code, resp.content) == (429, b"no")
        assert resp.headers == {"retry-after": "7", "x-odd": "a:b", "content-length": "2"}
        raw = resp.response().headers.raw
        assert raw == [(b"Retry-After", b"7"), (b"X-Odd", b"a:b"), (b"Content-Length", b"2")]


def test_a_body_bigger_than_the_socket_buffers_is_sent_whole_and_a_stalled_server_times_out() -> None:
    """The socket is non-blocking: a write the kernel takes in parts waits for room, within the
    request's timeout, and a server that reads nothing (or answers nothing) times the request out."""
    from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError

    body = b"z" * (32 << 20)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got: list[int] = []
    release = threading.Event()

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()  # the first: read slowly, then answer the length
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                want = int(
                    next(
                        v
                        for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                        if k == b"Content-Length"
                    )
                )
                n = len(rest)
                while n < want:
                    release.wait(0.001)
                    n += len(conn.recv(1 << 16))
                got.append(n)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            stalled, _ = listener.accept()  # the second: reads nothing, answers nothing
            with stalled:
                release.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = KeepAlive(f"http://127.0.0.1:{port}", {}, connect_timeout_s=5)
    try:
        resp = client.request("POST", "/v1/x", content=body, headers=None, params=None, read_timeout_s=30)
        assert resp.content == b"ok" and got == [len(body)]
        client.close()
        client = KeepAlive(f"http://127.0.0.1:{port}", {}, connect_timeout_s=5)
        with pytest.raises(KeepAliveError, match="TimeoutError: timed out"):
            client.request("POST", "/v1/x", content=body, headers=None, params=None, read_timeout_s=0.5)
    finally:
        release.set()
        client.close()
        thread.join(5)


def test_a_server_that_never_answers_times_the_read_out() -> None:
    from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                done.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = KeepAlive(f"http://127.0.0.1:{port}", {}, connect_timeout_s=5)
    try:
        with pytest.raises(KeepAliveError, match="TimeoutError: timed out"):
            client.request("POST", "/v1/x", content=b"x", headers=None, params=None, read_timeout_s=0.3)
    finally:
        done.set()
        client.close()
        thread.join(5)


def test_an_idle_connection_with_a_descriptor_past_1023_is_kept_and_a_closed_one_noticed() -> None:
    """A busy nymph holds more than 1024 descriptors: ``select.select`` refuses those, and every
    TLS connection past them was taken for closed and replaced before each request."""
    from dreamlake.lakeshore.keepalive import _dropped

    with busy_descriptors():
        ours, theirs = socket.socketpair()
    try:
        assert ours.fileno() > 1023
        assert not _dropped(ours)  # idle, open: kept
        theirs.close()
        assert _dropped(ours)  # the peer closed it: replaced
    finally:
        ours.close()
        theirs.close()
