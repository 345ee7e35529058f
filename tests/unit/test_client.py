"""The one control-plane client, faked at the httpx transport seam (httpx.MockTransport).

What its users rely on: which failures are retried (connection errors, timeouts, 5xx, 429) and which
never are (every other 4xx); which error class each HTTP status becomes; retries that back off with
jitter and outwait a Retry-After; the exact request a call sends.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import pytest

import nymph.client
from dreamlake.lakeshore import errors
from dreamlake.lakeshore.client import RETRY_AFTER_CAP_S, PlaneClient, error_for, is_retryable, retrying

Handler = Callable[[httpx.Request], httpx.Response]


def _answer(status: int, body: Any = None, **headers: str) -> httpx.Response:
    content = msgpack.packb(body if body is not None else {"ok": status < 400})
    return httpx.Response(
        status, content=content, headers={"content-type": "application/x-msgpack", **headers}
    )


def _client(handler: Handler, attempts: int = 1) -> PlaneClient:
    return PlaneClient(
        "http://cp.test/", "lsk_tok", attempts=attempts, transport=httpx.MockTransport(handler)
    )


def _raising(exc: type[httpx.TransportError]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc("boom", request=request)

    return handler


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, errors.BadRequest),
        (401, errors.Unauthorized),
        (403, errors.Forbidden),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (413, errors.BadRequest),
        (422, errors.BadRequest),
        (429, errors.Unavailable),
        (500, errors.Unavailable),
        (502, errors.Unavailable),
        (503, errors.Unavailable),
    ],
)
def test_each_status_maps_to_one_error_class(status: int, error: type[errors.PlaneError]) -> None:
    with pytest.raises(error) as info:
        _client(lambda r: _answer(status, {"error": "the server's reason"})).request("POST", "/v1/x", {})
    assert type(info.value) is error
    assert info.value.status == status
    assert "POST /v1/x" in str(info.value) and "the server's reason" in str(info.value)
    assert type(error_for(status, "m")) is error  # the same table, without a request
    if status in (401, 403):
        assert isinstance(info.value, errors.AuthError)
        assert "refused the token" in str(info.value) and "lakeshore token create" in str(info.value)


@pytest.mark.parametrize(
    ("make", "retryable"),
    [
        (lambda: _client(_raising(httpx.ConnectError)).request("GET", "/x"), True),
        (lambda: _client(_raising(httpx.ReadTimeout)).request("GET", "/x"), True),
        (lambda: _client(_raising(httpx.RemoteProtocolError)).request("GET", "/x"), True),
        (lambda: _client(lambda r: _answer(503)).request("GET", "/x"), True),
        (lambda: _client(lambda r: _answer(429)).request("GET", "/x"), True),
        (
            lambda: _client(lambda r: httpx.Response(200, text="<html>proxy</html>")).request("GET", "/x"),
            True,
        ),
        (lambda: _client(lambda r: _answer(401)).request("GET", "/x"), False),
        (lambda: _client(lambda r: _answer(404)).request("GET", "/x"), False),
        (lambda: _client(lambda r: _answer(409)).request("GET", "/x"), False),
        (lambda: _client(lambda r: _answer(413)).request("GET", "/x"), False),
        (lambda: _client(lambda r: _answer(200)).request("GET", "/a\x00b"), False),  # not a URL
    ],
)
def test_retry_classification(make: Callable[[], Any], retryable: bool) -> None:
    with pytest.raises(errors.PlaneError) as info:
        make()
    assert is_retryable(info.value) is retryable
    assert isinstance(info.value, errors.Unavailable if retryable else errors.Refused)


def test_a_connection_error_says_where_and_keeps_its_cause() -> None:
    with pytest.raises(
        errors.Unavailable, match=r"cannot reach the control plane at http://cp\.test"
    ) as info:
        _client(_raising(httpx.ConnectError)).request("POST", "/v1/daemon/ack", {})
    assert info.value.status is None
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_only_plane_errors_are_retryable() -> None:
    assert not is_retryable(ValueError("a bug"))
    assert not is_retryable(httpx.ConnectError("untranslated"))
    assert not is_retryable(errors.PlaneError("no status"))


def test_retries_back_off_with_jitter_then_succeed() -> None:
    script: list[Any] = [503, httpx.ConnectError, 429, 200]
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        step = script.pop(0)
        if step is httpx.ConnectError:
            raise httpx.ConnectError("refused", request=request)
        return _answer(step, {"seq": 7} if step == 200 else {"error": "busy"})

    waits: list[float] = []
    policy = retrying(attempts=5, initial_s=0.1, max_s=5.0, jitter_s=0.2, sleep=waits.append)
    answer = policy(_client(handler).request, "POST", "/v1/producer/topics/t/post", {"body": b""})
    assert answer == {"seq": 7}
    assert seen == ["/v1/producer/topics/t/post"] * 4
    assert len(waits) == 3
    for n, wait in enumerate(waits):
        base = 0.1 * 2**n
        assert base < wait <= base + 0.2  # exponential, plus a random share of the jitter


def test_the_client_retries_its_own_requests_up_to_attempts() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return _answer(200, {"ok": True}) if len(calls) == 3 else _answer(500, {"error": "down"})

    assert _client(handler, attempts=3).request("GET", "/x") == {"ok": True}
    calls.clear()
    with pytest.raises(errors.Unavailable, match="down"):
        _client(handler, attempts=2).request("GET", "/x")
    assert len(calls) == 2  # every attempt used, then the last failure


def test_the_clients_window_counts_its_first_try() -> None:
    """A client that retries for ``window_s`` counts the time its first try took: a try that used
    the whole window is not followed by another; within the window, failures are retried with the
    backoff until one succeeds."""
    calls: list[float] = []

    def slow(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        time.sleep(0.3)
        return _answer(503, {"error": "down"})

    window = PlaneClient(
        "http://cp.test/", "lsk_tok", attempts=None, window_s=0.25, transport=httpx.MockTransport(slow)
    )
    with pytest.raises(errors.Unavailable, match="down"):
        window.request("GET", "/x")
    assert len(calls) == 1

    calls.clear()

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        return _answer(200, {"ok": True}) if len(calls) == 3 else _answer(503, {"error": "down"})

    window = PlaneClient(
        "http://cp.test/", "lsk_tok", attempts=None, window_s=30, transport=httpx.MockTransport(flaky)
    )
    assert window.request("GET", "/x") == {"ok": True}
    assert len(calls) == 3
    assert calls[1] - calls[0] >= 0.1 and calls[2] - calls[1] >= 0.2  # the backoff between tries


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413])
def test_a_refusal_is_raised_at_once(status: int) -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return _answer(status, {"error": "no"})

    waits: list[float] = []
    with pytest.raises(errors.Refused):
        retrying(attempts=5, sleep=waits.append)(_client(handler, attempts=5).request, "GET", "/x")
    assert calls == [1] and waits == []


@pytest.mark.parametrize("form", ["delta-seconds", "http-date"])
def test_a_retry_after_is_waited_out(form: str) -> None:
    header = "30" if form == "delta-seconds" else email.utils.formatdate(time.time() + 30, usegmt=True)
    script = [_answer(429, {"error": "slow down"}, **{"Retry-After": header}), _answer(200, {"ok": 1})]
    waits: list[float] = []
    answer = retrying(attempts=2, sleep=waits.append)(_client(lambda r: script.pop(0)).request, "GET", "/x")
    assert answer == {"ok": 1}
    assert 20.0 <= waits[0] <= 30.0  # not the 0.1 s backoff: the server's wait (a date: to the second)


def test_a_retry_after_beyond_the_cap_is_capped() -> None:
    script = [_answer(503, {"error": "maintenance"}, **{"Retry-After": "86400"}), _answer(200, {"ok": 1})]
    waits: list[float] = []
    retrying(attempts=2, sleep=waits.append)(_client(lambda r: script.pop(0)).request, "GET", "/x")
    assert waits == [RETRY_AFTER_CAP_S]


def test_an_unreadable_retry_after_falls_back_to_the_backoff() -> None:
    with pytest.raises(errors.Unavailable) as info:
        _client(lambda r: _answer(429, **{"Retry-After": "soon"})).request("GET", "/x")
    assert info.value.retry_after is None


def test_requests_are_sent_exactly() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.headers.get("accept") == "application/json":
            return httpx.Response(200, json={"ok": "json"})
        return _answer(200, {"ok": "msgpack"})

    client = _client(handler)
    assert client.request("POST", "/v1/daemon/ack", {"blob": b"\x00\xff", "n": 1}) == {"ok": "msgpack"}
    assert client.request("POST", "/v1/namespaces/ns/jobs", {"a": [1]}, as_json=True) == {"ok": "json"}
    assert client.request("GET", "/v1/producer/invocations/x", params={"since": 3}) == {"ok": "msgpack"}
    packed, as_json, get = seen
    assert str(packed.url) == "http://cp.test/v1/daemon/ack"
    assert packed.headers["authorization"] == "Bearer lsk_tok"
    assert packed.headers["content-type"] == "application/x-msgpack"
    assert packed.headers["accept"] == "application/x-msgpack"
    assert msgpack.unpackb(packed.content) == {"blob": b"\x00\xff", "n": 1}
    assert as_json.headers["content-type"] == "application/json"
    assert as_json.headers["authorization"] == "Bearer lsk_tok"
    assert as_json.content == b'{"a":[1]}'
    assert get.content == b"" and "content-type" not in get.headers
    assert get.url.params["since"] == "3"


def test_download_sends_no_token_and_stops_at_the_limit() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"x" * 100)

    client = _client(handler)
    assert client.download("https://s3.test/b/k?X-Amz-Signature=s") == b"x" * 100
    assert "authorization" not in seen[0].headers
    with pytest.raises(errors.BadRequest, match="over 10 bytes"):
        client.download("https://s3.test/b/k?X-Amz-Signature=s", limit=10)
    with pytest.raises(errors.Forbidden) as info:
        _client(lambda r: httpx.Response(403, text="expired")).download("https://s3.test/b/k?sig=1")
    assert "expired" in str(info.value) and "sig=1" not in str(info.value)  # the signature stays out


def test_a_stream_translates_its_refusal_and_a_dropped_body() -> None:
    with pytest.raises(errors.NotFound), _client(lambda r: _answer(404, {"error": "unknown"})).stream("/s"):
        pass

    class Dropping(httpx.SyncByteStream):
        def __iter__(self) -> Any:
            yield b"part"
            raise httpx.ReadError("connection reset")

    client = _client(lambda r: httpx.Response(200, stream=Dropping()))
    got: list[bytes] = []
    with pytest.raises(errors.Unavailable) as info, client.stream("/s", params={"since": 1}) as resp:
        got.extend(resp.iter_bytes())
    assert got == [b"part"]
    assert isinstance(info.value.__cause__, httpx.ReadError)


def test_healthz_reads_json_and_is_tried_once() -> None:
    assert _client(lambda r: httpx.Response(200, json={"store": "sqlite"})).healthz() == {"store": "sqlite"}
    assert _client(lambda r: httpx.Response(200, text="ok")).healthz() == {}
    calls: list[int] = []

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(errors.Unavailable):
        _client(down, attempts=5).healthz()
    assert calls == [1]


def test_one_name_per_error_in_one_process() -> None:
    """nymph raises the lakeshore errors under their own names (no aliases such as ``FatalError``),
    and its gate refusal is ``GateRefused``: one ``Refused`` class in the process."""
    import nymph.errors

    for alias in ("ClientError", "TransientError", "FatalError", "AuthRejected", "Superseded"):
        assert not hasattr(nymph.client, alias), alias
    assert not hasattr(nymph.errors, "Refused")
    assert issubclass(nymph.errors.GateRefused, nymph.errors.JobRefused)
    assert not issubclass(nymph.errors.GateRefused, errors.PlaneError)
    assert nymph.client.is_retryable is is_retryable


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (
            'store unavailable: cannot reach PostgreSQL (Connection refused at "db", port 5432); retry later',
            True,
        ),
        ("store full: the SQLite store's disk is full (database or disk is full); retry later", True),
        ("the control plane is serving its limit of 5000 concurrent long polls; retry after 7 s", False),
    ],
)
def test_nymph_counts_a_store_outage_503_as_the_control_plane_gone(error: str, outage: bool) -> None:
    """A 503 with Retry-After is a server asking for patience (poll admission), unless it says its
    store is down: then nymph's link goes down (one "went away" line naming the cause, claims stop)."""
    client = nymph.client.ControlPlaneClient(
        "http://cp.test/",
        "t",
        transport=httpx.MockTransport(lambda r: _answer(503, {"error": error}, **{"Retry-After": "1"})),
    )
    with pytest.raises(errors.Unavailable) as raised:
        client.heartbeat({"worker_id": "w", "running": []})
    assert error in str(raised.value)
    assert client.link.up is (not outage)


def test_a_wait_retries_a_failure_only_while_its_caller_waits() -> None:
    """A submit that waits and an await retry a failure within the caller's wait (at least
    ``RETRY_AT_LEAST_S``), not the client's whole window: ``f.call(timeout=1)`` against a control
    plane answering 503 took the window (60 s by default) before it raised."""
    from dreamlake.lakeshore.ids import new_ulid
    from dreamlake.lakeshore.protocol.producer import RETRY_AT_LEAST_S, ProducerClient

    calls: list[float] = []

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        return _answer(503, {"error": "the store is down"})

    client = ProducerClient(
        "http://cp.test/", "lsk_tok", attempts=None, window_s=30, transport=httpx.MockTransport(down)
    )
    for wait in (
        lambda: client.await_result(new_ulid(), 0.5),
        lambda: client.submit({"invocation_id": new_ulid(), "queue": "q"}, wait_s=0.5),
    ):
        calls.clear()
        started = time.monotonic()
        with pytest.raises(errors.Unavailable, match="the store is down"):
            wait()
        took = time.monotonic() - started
        assert len(calls) > 1 and RETRY_AT_LEAST_S <= took < RETRY_AT_LEAST_S + 3, (took, len(calls))
