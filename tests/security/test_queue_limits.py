"""A queue's fleet-wide limit (``PUT``/``DELETE /v1/ops/queues/:name/limit``) from the attacker's side.

A queue's limit holds back every namespace's calls of that queue, so only an admin may set or
clear it: a producer or namespace token (of any namespace), a daemon, a metrics token and a task
credential are refused 403 and nothing changes; bad values are 400s that say what to send, and
change nothing either. Everyone who may list queues sees the limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import ControlPlane, running_control_plane

QUEUE = "batch"


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlPlane]:
    with running_control_plane(str(tmp_path / "limits.db")) as plane:
        yield plane


def _put(cp: ControlPlane, token: str, body: Any, queue: str = QUEUE) -> httpx.Response:
    return cp.client(token).put(f"/v1/ops/queues/{queue}/limit", json=body)


def _delete(cp: ControlPlane, token: str, queue: str = QUEUE) -> httpx.Response:
    return cp.client(token).delete(f"/v1/ops/queues/{queue}/limit")


def test_only_an_admin_sets_or_clears_a_queue_limit(cp: ControlPlane) -> None:
    store = cp.store
    assert _put(cp, cp.admin_token, {"max_running": 2}).json() == {"queue": QUEUE, "max_running": 2}
    others = {
        "producer": cp.producer_token,
        "producer of a namespace": store.create_token("producer", "p-b", "team-b"),
        "namespace": store.create_token("namespace", "n-b", "team-b"),
        "daemon": cp.daemon_token,
        "metrics": store.create_token("metrics", "m"),
    }
    for kind, token in others.items():
        assert _put(cp, token, {"max_running": 1000}).status_code == 403, kind
        assert _delete(cp, token).status_code == 403, kind
    assert _put(cp, "lsk_not-a-token", {"max_running": 1000}).status_code == 401
    assert store.limits()["queues"] == {QUEUE: 2}  # nothing any of them sent changed it
    # a namespace's operator sees the limit of a queue its calls use
    seen = cp.client(others["namespace"]).get("/v1/ops/queues").json()["queues"]
    assert all(q["max_running"] in (None, 2) for q in seen)
    assert _delete(cp, cp.admin_token).json() == {"queue": QUEUE, "max_running": None}
    assert store.limits()["queues"] == {}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_running": -1}, "max_running must be a whole number from 0"),
        ({"max_running": "2"}, "max_running must be a whole number from 0"),
        ({"max_running": True}, "max_running must be a whole number from 0"),
        ({"max_running": 1.5}, "max_running must be a whole number from 0"),
        ({"max_running": 2**40}, "max_running must be a whole number from 0"),
        ({}, "missing field 'max_running'"),
    ],
)
def test_a_bad_limit_is_refused_and_changes_nothing(cp: ControlPlane, body: Any, message: str) -> None:
    assert _put(cp, cp.admin_token, {"max_running": 3}).status_code == 200
    resp = _put(cp, cp.admin_token, body)
    assert resp.status_code == 400 and message in resp.text, resp.text
    assert cp.store.limits()["queues"] == {QUEUE: 3}


def test_a_bad_queue_name_or_body_is_a_400(cp: ControlPlane) -> None:
    assert _put(cp, cp.admin_token, {"max_running": 1}, queue="a%20b").status_code == 400
    resp = cp.client(cp.admin_token).put(f"/v1/ops/queues/{QUEUE}/limit", content=b"\xff{")
    assert resp.status_code == 400
    assert cp.store.limits()["queues"] == {}
