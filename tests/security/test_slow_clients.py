"""Slow and half-open clients cannot hold the control plane's connections (issue 11).

Every test runs against both HTTP parsers the server can serve with (``LAKESHORE_HTTP_PARSER``):
httptools, its default, and h11; the guard of ``server/guard.py`` is written once per parser.

``lakeshore server`` runs with a 1 s header deadline, a 1 s body pause limit and a cap of 150
connections. The attacker opens 200 sockets on loopback: some send half a request line and
headers and stop, some trickle a byte every 0.2 s (a trickle must not extend the deadline), some
send complete (authenticated) headers and never the body they announce. A normal request is still served while
they hang, the sockets past the cap are closed on accept, and the server closes every one of them;
the wait for that is bounded (30 s) so a regression fails instead of hanging.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import ids
from tests.security.conftest import Stack

PARSERS = ["httptools", "h11"]

HALF_HEADERS = (
    b"POST /v1/producer/submit HTTP/1.1\r\nHost: lakeshore\r\nContent-Type: application/x-msgpack\r\n"
)


def no_body(token: str) -> bytes:
    """Complete, authenticated headers announcing a body of which one byte ever comes."""
    head = f"POST /v1/producer/submit HTTP/1.1\r\nHost: lakeshore\r\nAuthorization: Bearer {token}\r\n"
    return head.encode() + b"Content-Length: 1000\r\n\r\n{"


BOUND_S = 30.0


def _open(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    s.setblocking(False)
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (EOF or reset); False while it is held open."""
    try:
        return s.recv(65536) == b""  # an answer then EOF comes as data first: read on
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.parametrize("parser", PARSERS)
def test_half_open_and_slow_connections_are_dropped_and_others_still_served(
    tmp_path: Path, parser: str
) -> None:
    stack = Stack(
        tmp_path / "data",
        LAKESHORE_HTTP_PARSER=parser,
        LAKESHORE_HEADER_TIMEOUT_S="1",
        LAKESHORE_BODY_TIMEOUT_S="1",
        LAKESHORE_MAX_CONNECTIONS="150",
    ).start()
    held: list[socket.socket] = []
    try:
        held += [_open(stack.port, HALF_HEADERS) for _ in range(100)]
        trickle = [_open(stack.port, b"G") for _ in range(10)]
        held += trickle
        held += [_open(stack.port, no_body(stack.admin)) for _ in range(20)]
        # 130 connections hang; an honest request is still served
        assert httpx.get(stack.url + "/healthz", timeout=10).status_code == 200
        held += [_open(stack.port, HALF_HEADERS) for _ in range(70)]  # past the cap of 150
        assert len(held) == 200

        open_ = list(held)
        deadline = time.monotonic() + BOUND_S
        while open_ and time.monotonic() < deadline:
            for s in trickle:
                try:
                    s.send(b"E")  # one byte every 0.2 s: it must not keep the connection alive
                except OSError:
                    pass
            open_ = [s for s in open_ if not _closed(s)]
            time.sleep(0.2)
        assert open_ == [], f"{len(open_)} of 200 slow connections still open after {BOUND_S} s"
        assert httpx.get(stack.url + "/healthz", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
        stack.stop()
    log = stack.log.read_text()
    assert "connection cap reached (150 open)" in log
    assert f"guarded {parser} HTTP" in log


def _get_healthz(s: socket.socket) -> bytes:
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: lakeshore\r\n\r\n")
    s.settimeout(10)
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = s.recv(65536)
        assert chunk, "the server closed the connection instead of answering"
        answer += chunk
    return answer


@pytest.mark.parametrize("parser", PARSERS)
def test_a_kept_alive_connection_outlives_the_header_deadline_but_a_trickle_does_not(
    tmp_path: Path, parser: str
) -> None:
    """Between requests a connection may be silent for the keep-alive window (30 s, above
    nymph's heartbeat period), not just the header deadline: a fleet's heartbeats reuse their
    connections. Once a request's first byte arrives the header deadline holds again."""
    stack = Stack(tmp_path / "data", LAKESHORE_HEADER_TIMEOUT_S="1", LAKESHORE_HTTP_PARSER=parser).start()
    try:
        with socket.create_connection(("127.0.0.1", stack.port), timeout=5) as s:
            assert _get_healthz(s).startswith(b"HTTP/1.1 200")
            time.sleep(2.5)  # silent past the 1 s header deadline, inside the keep-alive window
            assert _get_healthz(s).startswith(b"HTTP/1.1 200")
            s.sendall(b"G")  # the next request begins, and trickles
            s.setblocking(False)
            deadline = time.monotonic() + BOUND_S
            while not _closed(s):
                assert time.monotonic() < deadline, "a trickling request outlived the header deadline"
                try:
                    s.send(b"E")
                except OSError:
                    break
                time.sleep(0.2)
    finally:
        stack.stop()


def _answer_then_close(s: socket.socket) -> bytes:
    """Everything the server sends on ``s`` until it closes it (bounded)."""
    s.settimeout(BOUND_S)
    answer = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return answer
        if not chunk:
            return answer
        answer += chunk


@pytest.mark.parametrize("parser", PARSERS)
def test_headers_that_pile_up_past_the_bound_are_refused_and_the_connection_closed(
    tmp_path: Path, parser: str
) -> None:
    """``LAKESHORE_MAX_HEADER_BYTES`` bounds what a request's unfinished headers may hold in the
    server's memory: a client that keeps sending headers and never ends them is refused (431 from
    httptools, 400 from h11) and closed as soon as they pass the bound, long before the header
    deadline (60 s here); a request under the bound, and the next connection, are served."""
    stack = Stack(
        tmp_path / "data",
        LAKESHORE_MAX_HEADER_BYTES="4096",
        LAKESHORE_HEADER_TIMEOUT_S="60",
        LAKESHORE_HTTP_PARSER=parser,
    ).start()
    try:
        with socket.create_connection(("127.0.0.1", stack.port), timeout=5) as s:
            began = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: lakeshore\r\n")
            for _ in range(40):  # 40 headers of 200 bytes (8,000 in all), and never the blank line
                try:
                    s.sendall(b"X-More: " + b"b" * 190 + b"\r\n")
                except OSError:
                    break  # closed under us: what the bound is for
                time.sleep(0.01)
            answer = _answer_then_close(s)
            assert time.monotonic() - began < 30, "the connection was closed by the deadline, not the bound"
        assert answer.split(b"\r\n", 1)[0] in (
            b"HTTP/1.1 431 Request Header Fields Too Large",
            b"HTTP/1.1 400 Bad Request",
        ), answer[:200]

        with socket.create_connection(("127.0.0.1", stack.port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: lakeshore\r\nX-Pad: " + b"c" * 3000 + b"\r\n\r\n")
            s.settimeout(10)
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(65536)
                assert chunk, "a request under the bound was not answered"
                got += chunk
            assert got.startswith(b"HTTP/1.1 200")
        assert httpx.get(stack.url + "/healthz", timeout=10).status_code == 200
    finally:
        stack.stop()


def _first_answer(s: socket.socket, limit_s: float) -> bytes:
    """The first whole answer on ``s`` (head and Content-Length body); what came if it closed."""
    s.settimeout(limit_s)
    got = b""
    while True:
        head, sep, rest = got.partition(b"\r\n\r\n")
        if sep:
            length = next(
                (
                    int(v)
                    for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                    if k.strip().lower() == b"content-length"
                ),
                0,
            )
            if len(rest) >= length:
                return head + sep + rest[:length]
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return got
        if not chunk:
            return got
        got += chunk


@pytest.mark.parametrize("parser", PARSERS)
def test_a_long_poll_is_not_cut_by_a_request_pipelined_behind_it(tmp_path: Path, parser: str) -> None:
    """The deadlines are for the request being read: a request pipelined behind a 4 s long poll,
    its body never complete, waits its turn (the server reads it only once the poll is answered),
    so the 1 s body and header limits cannot close the connection under the poll."""
    stack = Stack(
        tmp_path / "data",
        LAKESHORE_HEADER_TIMEOUT_S="1",
        LAKESHORE_BODY_TIMEOUT_S="1",
        LAKESHORE_HTTP_PARSER=parser,
    ).start()
    try:
        poll = msgpack.packb(
            {"worker_id": ids.new_ulid(), "queues": ["nothing-here"], "max": 1, "timeout_s": 4}
        )
        head = (
            f"POST /v1/daemon/poll HTTP/1.1\r\nHost: lakeshore\r\nAuthorization: Bearer {stack.daemon}\r\n"
            f"Content-Type: application/x-msgpack\r\nContent-Length: {len(poll)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", stack.port), timeout=5) as s:
            began = time.monotonic()
            s.sendall(head + poll)
            time.sleep(0.3)
            s.sendall(b"POST /v1/producer/submit HTTP/1.1\r\nHost: lakeshore\r\nContent-Length: 100\r\n\r\n{")
            answer = _first_answer(s, 20)
            waited = time.monotonic() - began
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert waited >= 3.0  # the poll ran its course
    finally:
        stack.stop()


@pytest.mark.parametrize("parser", PARSERS)
def test_a_connection_answered_before_its_body_came_still_times_out(tmp_path: Path, parser: str) -> None:
    """A request refused before its body was read (401 here) leaves the connection to the
    keep-alive timeout (2 s) once the body is in: it is not held open for ever."""
    stack = Stack(
        tmp_path / "data",
        LAKESHORE_HEADER_TIMEOUT_S="1",
        LAKESHORE_BODY_TIMEOUT_S="1",
        LAKESHORE_KEEP_ALIVE_S="2",
        LAKESHORE_HTTP_PARSER=parser,
    ).start()
    try:
        with socket.create_connection(("127.0.0.1", stack.port), timeout=5) as s:
            s.sendall(b"POST /v1/producer/submit HTTP/1.1\r\nHost: lakeshore\r\nContent-Length: 5\r\n\r\n")
            assert _first_answer(s, 10).startswith(b"HTTP/1.1 401")
            s.sendall(b"abcde")
            s.setblocking(False)
            deadline = time.monotonic() + BOUND_S
            while not _closed(s):
                assert time.monotonic() < deadline, "the connection outlived its keep-alive timeout"
                time.sleep(0.2)
    finally:
        stack.stop()
