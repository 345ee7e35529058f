"""The HTTP surface's gates: tokens (401/403), ids (400), malformed bodies (400), size (413), health."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body


def test_healthz_needs_no_token(sqlite_control_plane: ControlPlane) -> None:
    r = httpx.get(sqlite_control_plane.url + "/healthz")
    assert r.status_code == 200 and r.json() == {"ok": True, "store": "sqlite"}


@pytest.mark.parametrize("token", [None, "lsk_not-a-real-token", "garbage"])
def test_missing_or_unknown_token_is_401(sqlite_control_plane: ControlPlane, token: str | None) -> None:
    status, out = sqlite_control_plane.call("/v1/producer/submit", submit_body(new_ulid()), token)
    assert status == 401 and "token" in out["error"]
    status, out = sqlite_control_plane.json("POST", "/v1/namespaces/ns1/exec", {"command": "true"}, token)
    assert status == 401 and "token" in out["error"]


def test_wrong_kind_is_403(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    status, out = cp.call("/v1/producer/submit", submit_body(new_ulid()), cp.daemon_token)
    assert status == 403 and "producer" in out["error"]
    status, out = cp.call("/v1/daemon/poll", {"worker_id": new_ulid(), "queues": ["q"]}, cp.producer_token)
    assert status == 403
    status, _ = cp.json("PUT", "/v1/namespaces/ns1/pin", {"nymph_version": "1"}, cp.daemon_token)
    assert status == 403
    status, _ = cp.json("POST", "/v1/namespaces/ns1/exec", {"command": "true"}, cp.producer_token)
    assert status == 403
    status, _ = cp.json("POST", "/v1/namespaces/ns1/exec", {"command": "true"}, cp.daemon_token)
    assert status == 403  # daemons publish results and presign; they do not enqueue
    r = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.producer_token}"})
    assert r.status_code == 403


def test_admin_may_call_everything(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    status, _ = cp.call("/v1/producer/submit", submit_body(new_ulid()), cp.admin_token)
    assert status == 200
    status, _ = cp.call(
        "/v1/daemon/poll", {"worker_id": new_ulid(), "queues": ["default"], "timeout_s": 0}, cp.admin_token
    )
    assert status == 200
    r = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    assert r.status_code == 200 and "lakeshore_submits_total" in r.text


def test_namespace_token_is_bound_to_its_namespace(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    token = cp.store.create_token("namespace", "team-a", "team-a")
    status, _ = cp.json("POST", "/v1/namespaces/team-a/exec", {"command": "true"}, token)
    assert status == 202
    status, out = cp.json("POST", "/v1/namespaces/team-b/exec", {"command": "true"}, token)
    assert status == 403 and "team-a" in out["error"]
    status, _ = cp.call("/v1/producer/submit", submit_body(new_ulid()), token)
    assert status == 403


@pytest.mark.parametrize(
    "path,method",
    [
        ("/v1/producer/invocations/{bad}", "GET"),
        ("/v1/producer/invocations/{bad}/cancel", "POST"),
        ("/v1/producer/invocations/{bad}/result/stream", "GET"),
    ],
)
def test_invalid_id_in_path_is_400(sqlite_control_plane: ControlPlane, path: str, method: str) -> None:
    status, out = sqlite_control_plane.producer(path.format(bad="not-a-ulid"), {}, method=method)
    assert status == 400
    assert out["error"].startswith("invalid invocation_id 'not-a-ulid': expected a 26-character ULID")


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/producer/submit", lambda: submit_body("01ARZ3NDEKTSV4RRFFQ69G5FA")),  # 25 chars
        ("/v1/producer/await", lambda: {"invocation_id": "../../etc/passwd"}),
        ("/v1/daemon/ack", lambda: {"invocation_id": "x", "state": "succeeded"}),
        ("/v1/daemon/poll", lambda: {"worker_id": 7, "queues": ["q"]}),
    ],
)
def test_invalid_id_in_body_is_400(sqlite_control_plane: ControlPlane, route: str, body: Any) -> None:
    cp = sqlite_control_plane
    token = cp.daemon_token if route.startswith("/v1/daemon") else cp.producer_token
    status, out = cp.call(route, body(), token)
    assert status == 400 and "expected a 26-character ULID" in out["error"]


def test_unknown_invocation_is_404(sqlite_control_plane: ControlPlane) -> None:
    status, out = sqlite_control_plane.producer(f"/v1/producer/invocations/{new_ulid()}", None, method="GET")
    assert status == 404 and "unknown invocation" in out["error"]


@pytest.mark.parametrize(
    "raw", [b"", b"\xc1", b"\x92\x01", msgpack.packb([1, 2]), b"\x81\xa1a\x01extra", b"\xdb\xff\xff\xff\xff"]
)
def test_malformed_msgpack_is_400(sqlite_control_plane: ControlPlane, raw: bytes) -> None:
    status, out = sqlite_control_plane.producer("/v1/producer/submit", None, raw=raw)
    assert status == 400 and out["error"]


def test_wrong_field_types_are_400_naming_the_field(sqlite_control_plane: ControlPlane) -> None:
    body = submit_body(new_ulid())
    body["args_blob"] = "not bytes"
    status, out = sqlite_control_plane.producer("/v1/producer/submit", body)
    assert status == 400 and "'args_blob'" in out["error"]
    del body["function"]
    body["args_blob"] = b""
    status, out = sqlite_control_plane.producer("/v1/producer/submit", body)
    assert status == 400 and "missing field 'function'" in out["error"]


def test_body_over_limit_is_413(tmp_path: Any) -> None:
    with running_control_plane(str(tmp_path / "s.db"), config=ServerConfig(max_body_bytes=4096)) as cp:
        status, out = cp.producer("/v1/producer/submit", submit_body(new_ulid(), args_blob=b"x" * 5000))
        assert status == 413 and "LAKESHORE_MAX_BODY_BYTES" in out["error"]

        def chunks() -> Any:  # no Content-Length: the limit holds on a streamed body too
            for _ in range(10):
                yield b"\x00" * 1000

        r = httpx.post(
            cp.url + "/v1/producer/submit",
            content=chunks(),
            headers={"Authorization": f"Bearer {cp.producer_token}"},
        )
        assert r.status_code == 413


def test_unknown_route_is_404_with_error_body(sqlite_control_plane: ControlPlane) -> None:
    status, out = sqlite_control_plane.producer("/v1/producer/nope", {})
    assert status == 404 and "no route" in out["error"]
