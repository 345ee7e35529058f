"""The SDK's side of a namespace quota (server/quotas.py): a 429 whose answer names a quota is a
``QuotaExceeded`` carrying the server's message, the quota, the limit and ``Retry-After``, raised
at once (no retry window spent on it); a 429 without one is still ``Unavailable`` and retried."""

from __future__ import annotations

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import errors
from dreamlake.lakeshore.client import PlaneClient, is_retryable

MESSAGE = "namespace 'team-b' is at its quota max_topics of 2 topics (2 made; 'x' would be one more)"


def _client(answers: list[httpx.Response], seen: list[httpx.Request]) -> PlaneClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return PlaneClient("http://cp.test/", "lsk_tok", attempts=5, transport=httpx.MockTransport(handler))


def _429(body: dict[str, object]) -> httpx.Response:
    return httpx.Response(
        429,
        content=msgpack.packb(body),
        headers={"Content-Type": "application/x-msgpack", "Retry-After": "3600"},
    )


def test_a_quota_429_is_quota_exceeded_with_its_message_and_is_not_retried() -> None:
    seen: list[httpx.Request] = []
    client = _client([_429({"error": MESSAGE, "quota": "max_topics", "limit": 2})], seen)
    with pytest.raises(errors.QuotaExceeded) as caught:
        client.request("POST", "/v1/producer/topics/x/post", {"body": b"1"})
    exc = caught.value
    assert MESSAGE in str(exc) and exc.status == 429
    assert (exc.quota, exc.limit, exc.retry_after) == ("max_topics", 2, 3600.0)
    assert isinstance(exc, errors.Refused) and not is_retryable(exc)
    assert len(seen) == 1


def test_a_plain_429_is_still_unavailable_and_retried() -> None:
    seen: list[httpx.Request] = []
    ok = httpx.Response(
        200, content=msgpack.packb({"ok": True}), headers={"Content-Type": "application/x-msgpack"}
    )
    slow_down = httpx.Response(
        429, content=msgpack.packb({"error": "slow down"}), headers={"Content-Type": "application/x-msgpack"}
    )
    client = _client([slow_down, ok], seen)
    assert client.request("GET", "/v1/ops/whoami") == {"ok": True}
    assert len(seen) == 2
