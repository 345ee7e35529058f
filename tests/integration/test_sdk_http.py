"""HttpDispatch at the transport seam (httpx.MockTransport) and against a real control plane.

What a user relies on: transient failures (connection errors, 5xx, 429) are retried and a 4xx
never is; a bad token says so and says what to do; the Submit body is the seed's.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.envelope import Envelope
from dreamlake.lakeshore.errors import AuthError, NotFound, PlaneError


@dls.udf(queue="gpu", priority=2)
def double(x: int) -> int:
    return 2 * x


def _answer(status: int, body: Any) -> httpx.Response:
    return httpx.Response(
        status, content=msgpack.packb(body), headers={"Content-Type": "application/x-msgpack"}
    )


def _plane(handler: Any) -> HttpDispatch:
    return HttpDispatch("http://plane.test", "lsk_test", transport=httpx.MockTransport(handler), retries=4)


def test_submit_sends_the_seed_submit_body() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/producer/submit"
        assert request.headers["Authorization"] == "Bearer lsk_test"
        assert request.headers["Content-Type"] == "application/x-msgpack"
        seen.append(msgpack.unpackb(request.content, raw=False))
        return _answer(200, {"invocation_id": seen[-1]["invocation_id"], "queue": "gpu"})

    with dls.scope("scenes/0007"):
        inv = double.submit(21, _dispatch=_plane(handler), _key="k")
    body = seen[0]
    assert body["invocation_id"] == inv
    assert body["queue"] == "gpu"
    assert body["function"] == {
        "module": "_native_wire",
        "qualname": "_native_wire.envelope",
        "version": "v1",
    }
    assert body["run_config"] == {"queue": "gpu", "priority": 2.0, "key": "k", "prefix": "scenes/0007"}
    assert body["code_context"] == {}
    assert "parent_invocation_id" not in body  # omitted when absent
    env = Envelope.from_bytes(body["args_blob"])  # args_blob is the Envelope, verbatim
    assert (env.id, env.prefix, env.key) == (inv, "scenes/0007", "k")


def test_each_placement_warning_is_logged_once_not_only_the_queues_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # before: the SDK logged the first warning of a queue and then none, so a call no worker
    # could ever place (another GPU count, a selector no nymph has) waited queued without a word
    said = {
        4: "no live worker of queue 'gpu-w' offers 4 GPUs (largest: 1)",
        8: "no live worker of queue 'gpu-w' offers 8 GPUs (largest: 1)",
    }

    def handler(request: httpx.Request) -> httpx.Response:
        body = msgpack.unpackb(request.content, raw=False)
        gpus = body["run_config"]["resources"]["gpus"]
        return _answer(200, {"invocation_id": body["invocation_id"], "queue": "gpu-w", "warning": said[gpus]})

    plane = _plane(handler)
    with caplog.at_level("WARNING", logger="dreamlake.lakeshore.dispatch.http"):
        for gpus in (4, 4, 8, 8):
            dls.udf(queue="gpu-w", resources={"gpus": gpus}, dispatch=plane)(double.__wrapped__).submit(1)  # type: ignore[attr-defined]
    logged = [r.getMessage() for r in caplog.records if "no live worker" in r.getMessage()]
    assert logged == [said[4], said[8]]


@pytest.mark.parametrize("transient", [503, 500, 429])
def test_transient_failures_are_retried(transient: int) -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) < 3:
            return _answer(transient, {"error": "busy"})
        return _answer(200, {"seq": 7})

    assert _plane(handler).topic_post("t", b"\xc0") == 7
    assert len(calls) == 3


def test_connection_errors_are_retried_then_reported() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(PlaneError, match=r"cannot reach the control plane at http://plane\.test"):
        _plane(handler).topic_post("t", b"\xc0")
    assert len(calls) == 4  # every attempt used


@pytest.mark.parametrize(
    ("status", "error"),
    [(400, PlaneError), (404, NotFound), (409, PlaneError), (401, AuthError), (403, AuthError)],
)
def test_client_errors_are_not_retried(status: int, error: type[Exception]) -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return _answer(status, {"error": "the server's reason"})

    with pytest.raises(error, match="the server's reason") as info:
        _plane(handler).topic_post("t", b"\xc0")
    assert len(calls) == 1
    if status in (401, 403):
        assert "lakeshore token create" in str(info.value)


def test_bad_url_and_missing_token_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="http://"):
        HttpDispatch("plane.test:8470", "lsk_x")
    with pytest.raises(ValueError, match="lakeshore token create"):
        HttpDispatch("http://plane.test", "")


def test_real_control_plane_refuses_a_bad_token(sqlite_control_plane: Any) -> None:
    plane = HttpDispatch(sqlite_control_plane.url, "lsk_" + "x" * 43)
    with pytest.raises(AuthError, match="refused the token"):
        double.submit(1, _dispatch=plane)
    plane.close()


def test_real_control_plane_unknown_invocation_is_not_found(sqlite_control_plane: Any) -> None:
    plane = HttpDispatch(sqlite_control_plane.url, sqlite_control_plane.admin_token)
    q = dls.SyncQueue("gpu", dispatch=plane)
    unknown = "01" + "A" * 24
    with pytest.raises(NotFound):
        q.status(unknown)
    with pytest.raises(ValueError, match="ULID"):
        q.status("../etc/passwd")
    plane.close()


def test_stream_resumes_after_a_transient_failure_and_stops_at_a_refusal() -> None:
    from dreamlake.lakeshore import wire

    inv = "01" + "B" * 24
    opened: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/result/stream"):
            return _answer(200, {"invocation_id": inv, "state": "running"})
        opened.append(request.url.params["since"])
        if len(opened) == 1:
            return _answer(503, {"error": "restarting"})
        if len(opened) == 2:  # one frame, then the long poll ends before the next one
            return httpx.Response(200, content=wire.encode_frame(wire.FRAME_VALUE, 0, wire.pack(1)))
        return httpx.Response(200, content=wire.encode_frame(wire.FRAME_END, 1, {}))

    frames = list(_plane(handler).frames(inv, timeout=10.0))
    assert [(f.kind, f.seq) for f in frames] == [(wire.FRAME_VALUE, 0), (wire.FRAME_END, 1)]
    assert opened == ["-1", "-1", "0"]  # each reopen resumes after the last seq seen

    refused: list[int] = []

    def unknown(request: httpx.Request) -> httpx.Response:
        refused.append(1)
        return _answer(404, {"error": "unknown invocation"})

    with pytest.raises(NotFound, match="unknown invocation"):
        list(_plane(unknown).frames(inv, timeout=10.0))
    assert refused == [1]
