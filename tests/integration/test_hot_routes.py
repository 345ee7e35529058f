"""server/hotroutes.py: the hot routes skip Starlette's routing, never the auth table or the guards.

Attacker side: each hot route, served by the shortcut, still answers 401 without a token, 403 to
a token kind the table does not grant, 413 to a body past the limit, 400 to a malformed one, a
logged 500 (no traceback to the caller) when its handler fails, and 405 to another method (that
goes to Starlette, as before). Also: the shortcut holds exactly the endpoints of the table's
routes for those paths (the same gate), and a hot route answers through it (a handler that is
not the table's endpoint would be found out).
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from starlette.routing import Route

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server import authz, daemon, hotroutes
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body

BODIES: dict[str, Any] = {
    "/v1/producer/submit": lambda: submit_body(new_ulid(), "hot"),
    "/v1/producer/await": lambda: {"invocation_id": new_ulid(), "timeout_s": 0},
    "/v1/daemon/poll": lambda: {"worker_id": new_ulid(), "queues": ["hot"], "max": 1, "timeout_s": 0},
    "/v1/daemon/ack": lambda: {"invocation_id": new_ulid(), "state": "succeeded", "attempt": 1},
    "/v1/daemon/heartbeat": lambda: {"worker_id": new_ulid(), "running": []},
    "/v1/daemon/result-chunks": lambda: {"invocation_id": new_ulid(), "attempt": 1, "chunks": []},
}
HOT_PATHS = sorted(path for _, path in hotroutes.HOT)


@pytest.fixture
def cp(store_url: str) -> Any:
    config = ServerConfig(max_body_bytes=64 * 1024)
    with running_control_plane(store_url, config=config) as plane:
        yield plane


def test_every_hot_route_is_a_table_route_and_its_own_endpoint(cp: ControlPlane) -> None:
    table = {(r.method, r.path): r for r in authz.ROUTES}
    assert set(table) >= hotroutes.HOT  # nothing hot that the table does not gate
    served = {(m, r.path): r.endpoint for r in cp.app.routes if isinstance(r, Route) for m in r.methods or ()}
    assert cp.app.hot == {key: served[key] for key in hotroutes.HOT}


@pytest.mark.parametrize("path", HOT_PATHS)
def test_no_token_is_401_and_an_ungranted_kind_403(cp: ControlPlane, path: str) -> None:
    status, out = cp.call(path, BODIES[path](), None)
    assert status == 401, out
    status, out = cp.call(path, BODIES[path](), "not-a-token")
    assert status == 401, out
    route = next(r for r in authz.ROUTES if r.path == path)
    wrong = cp.producer_token if "producer" not in route.grants else cp.daemon_token
    assert ("producer" if wrong == cp.producer_token else "daemon") not in route.grants
    status, out = cp.call(path, BODIES[path](), wrong)
    assert status == 403, out
    assert "error" in out


@pytest.mark.parametrize("path", HOT_PATHS)
def test_bodies_are_bounded_and_checked(cp: ControlPlane, path: str) -> None:
    status, out = cp.call(path, None, cp.admin_token, raw=b"\x92" + b"\xc4\x00" * 40_000)
    assert status == 413, out
    status, out = cp.call(path, None, cp.admin_token, raw=b"\xc1 not msgpack")
    assert status == 400, out
    assert "error" in out


@pytest.mark.parametrize("path", HOT_PATHS)
def test_another_method_is_starlettes_405(cp: ControlPlane, path: str) -> None:
    status, out = cp.call(path, None, cp.admin_token, method="GET")
    assert status == 405, out


def test_a_failing_handler_is_a_logged_500_without_a_traceback(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(daemon, "heartbeat", broken)
    status, out = cp.call("/v1/daemon/heartbeat", BODIES["/v1/daemon/heartbeat"](), cp.daemon_token)
    assert status == 500
    assert "secret internals" not in msgpack.packb(out).decode("latin-1")
    assert any("/v1/daemon/heartbeat failed" in r.getMessage() for r in caplog.records)


def test_a_hot_route_does_its_work_through_the_shortcut(cp: ControlPlane) -> None:
    """The hot path answers as the route does: a submit lands, a poll claims it, an ack ends it."""
    inv = cp.submit("hot")
    worker = new_ulid()
    status, out = cp.daemon("/v1/daemon/register", {"worker_id": worker, "queues": ["hot"], "slots": 1})
    assert status == 200, out
    poll = {"worker_id": worker, "queues": ["hot"], "max": 1, "timeout_s": 1}
    status, out = cp.daemon("/v1/daemon/poll", poll)
    assert status == 200, out
    (cmd,) = out["commands"]
    assert cmd["body"]["invocation_id"] == inv
    ack = {"invocation_id": inv, "state": "succeeded", "attempt": cmd["body"]["attempt"], "worker_id": worker}
    status, out = cp.daemon("/v1/daemon/ack", {**ack, "result_blob": b"\x90"})
    assert status == 200, out
    row = cp.store.get(inv)
    assert row is not None and row.state == "succeeded"
