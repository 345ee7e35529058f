"""``guard.CoalescingTransport`` over a real socket pair: a response's pieces written in one turn of
the loop arrive whole and in order, a piece written in a later turn leaves at the end of that turn
(a streamed body is not held back), ``close`` writes what is pending first, ``abort`` drops it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

from dreamlake.lakeshore.server.guard import CoalescingTransport


async def _pair() -> tuple[CoalescingTransport, socket.socket, asyncio.AbstractEventLoop]:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _protocol = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    theirs.setblocking(False)
    return CoalescingTransport(transport, loop), theirs, loop  # type: ignore[arg-type]


async def _read(sock: socket.socket, loop: asyncio.AbstractEventLoop, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, n - len(data)), 5)
        if not chunk:
            break
        data += chunk
    return data


def test_pieces_of_one_turn_arrive_whole_and_later_ones_at_their_turns_end() -> None:
    async def scenario() -> None:
        t, peer, loop = await _pair()
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")
        t.write(b"")
        try:  # nothing sent yet: the pieces leave together at the end of this turn
            early = peer.recv(100)
        except BlockingIOError:
            early = b""
        assert early == b""
        assert await _read(peer, loop, 23) == b"HTTP/1.1 200 OK\r\n\r\nbody"
        t.write(b"streamed")  # a later turn, alone: not held back for a next write
        assert await _read(peer, loop, 8) == b"streamed"
        t.write(b"last")
        t.close()  # pending bytes go first
        assert await _read(peer, loop, 100) == b"last"
        peer.close()

    asyncio.run(scenario())


def test_abort_drops_what_is_pending() -> None:
    async def scenario() -> None:
        t, peer, loop = await _pair()
        t.write(b"never")
        t.abort()
        await asyncio.sleep(0)
        assert await _read(peer, loop, 5) == b""  # EOF, nothing of the pending write
        peer.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_complete_response_leaves_before_the_rest_of_its_loop_turn(parser: str) -> None:
    """The guarded protocols write a response the moment it is complete: what the loop runs next
    in the same turn (here an app that goes on, blocking, after its answer; in the server the
    route that handed this response its answer) does not hold it back."""
    import uvicorn

    from dreamlake.lakeshore.server.config import ServerConfig
    from dreamlake.lakeshore.server.guard import uvicorn_config

    if parser == "httptools":
        pytest.importorskip("httptools")

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        time.sleep(3)  # goes on after answering, in the same turn of the loop

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(app, ServerConfig(), parser=parser, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            began = time.monotonic()
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while not got.endswith(b"ok"):
                chunk = c.recv(1000)
                if not chunk:
                    break
                got += chunk
            took = time.monotonic() - began
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"ok")
        assert took < 2.0  # not after the 3 s the app went on for
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
