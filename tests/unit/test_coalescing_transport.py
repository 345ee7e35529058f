"""``guard.CoalescingTransport`` over a real socket pair: a response's pieces written in one turn of
the loop arrive whole and in order, a piece written in a later turn leaves at the end of that turn
(a streamed body is not held back), ``close`` writes what is pending first, ``abort`` drops it."""

from __future__ import annotations

import asyncio
import socket

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
