"""``http.read_body``: a body from its ASGI messages, bounded, and a client gone mid-body."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import ClientDisconnect, Request

from dreamlake.lakeshore.server import http
from dreamlake.lakeshore.server.http import HTTPError


def _request(messages: list[dict[str, Any]], length: int | None = None) -> tuple[Request, list[int]]:
    """A request whose ``receive`` hands out ``messages`` in turn; the count of reads made."""
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}
    reads = [0]

    async def receive() -> dict[str, Any]:
        reads[0] += 1
        return messages.pop(0)

    return Request(scope, receive), reads


def _read(request: Request, limit: int = 10) -> bytes:
    return asyncio.run(http.read_body(request, limit))


def test_a_body_in_one_message_or_several_is_read_whole() -> None:
    one, _ = _request([{"type": "http.request", "body": b"abc"}])
    assert _read(one) == b"abc"
    parts = [b"ab", b"", b"cde", b"f"]
    more = [{"type": "http.request", "body": p, "more_body": True} for p in parts]
    several, reads = _request([*more, {"type": "http.request", "body": b"", "more_body": False}])
    assert _read(several) == b"abcdef" and reads[0] == 5
    empty, _ = _request([{"type": "http.request"}])
    assert _read(empty) == b""


def test_a_body_over_the_limit_is_refused_before_it_is_all_read() -> None:
    declared, reads = _request([{"type": "http.request", "body": b"x" * 11}], length=11)
    with pytest.raises(HTTPError, match="request body of 11 bytes is over the limit of 10") as err:
        _read(declared)
    assert err.value.status == 413 and reads[0] == 0  # refused by its header, nothing read
    chunks = [{"type": "http.request", "body": b"x" * 6, "more_body": True} for _ in range(5)]
    chunked, reads = _request(chunks)  # no Content-Length: counted as it comes
    with pytest.raises(HTTPError, match="request body is over the limit of 10 bytes") as err:
        _read(chunked)
    assert err.value.status == 413 and reads[0] == 2
    bad, _ = _request([{"type": "http.request", "body": b""}], length=None)
    bad.scope["headers"] = [(b"content-length", b"ten")]
    with pytest.raises(HTTPError, match="invalid Content-Length") as err:
        _read(bad)
    assert err.value.status == 400


def test_a_client_gone_mid_body_raises_client_disconnect() -> None:
    gone, _ = _request(
        [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}]
    )
    with pytest.raises(ClientDisconnect):
        _read(gone)
