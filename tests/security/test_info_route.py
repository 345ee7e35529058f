"""``GET /v1/ops/info`` from the attacker's side: who may read it, what it discloses, and that the
limits it states are the ones the control plane enforces (a client sizing its requests by it is
never refused for size, and one that ignores it is).

The route is in the one auth table (every token kind, ``any``); the auth matrix covers each kind.
Here: no credential and a forged one get 401 and no limits; another method gets no limits; the
answer is the version and the limits, nothing of the store, the tokens or the namespaces.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dreamlake.lakeshore.dispatch.http import HttpDispatch
from dreamlake.lakeshore.envelope import Envelope, fn_for
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.protocol.limits import ServerLimits
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.version import __version__
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body

INFO = "/v1/ops/info"


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlPlane]:
    with running_control_plane(str(tmp_path / "lakeshore.db"), config=ServerConfig(submit_batch_max=3)) as cp:
        yield cp


def test_without_a_valid_token_the_route_answers_401_and_no_limits(cp: ControlPlane) -> None:
    for token in (None, "", "lk_forged_0123456789abcdef", cp.admin_token + "x"):
        status, out = cp.json("GET", INFO, None, token)
        assert status == 401, (token, status, out)
        assert "limits" not in (out or {}), out


def test_another_method_gets_no_limits(cp: ControlPlane) -> None:
    for method in ("POST", "PUT", "DELETE"):
        status, out = cp.json(method, INFO, {}, cp.producer_token)
        assert status in (404, 405), (method, status, out)
        assert "limits" not in (out or {}), out


def test_every_kind_reads_the_version_and_the_limits_and_nothing_else(cp: ControlPlane) -> None:
    for token in (cp.admin_token, cp.producer_token, cp.daemon_token):
        status, out = cp.json("GET", INFO, None, token)
        assert status == 200, out
        assert set(out) == {"version", "limits"}, out
        assert out["version"] == __version__
        assert set(out["limits"]) == {f for f in ServerLimits().to_dict()}, out["limits"]
        assert all(v is None or isinstance(v, int) for v in out["limits"].values()), out["limits"]


def test_the_stated_limits_are_the_enforced_ones(cp: ControlPlane) -> None:
    status, out = cp.json("GET", INFO, None, cp.producer_token)
    assert status == 200, out
    limits = ServerLimits.from_answer(out)
    assert limits.submit_batch_max == 3  # the server's setting, not the client's default

    def batch(n: int) -> tuple[int, object]:
        items = [submit_body(new_ulid(), "q") for _ in range(n)]
        for item in items:
            item.pop("function", None)
        common = {"function": {"module": "m", "qualname": "f"}, "code_context": {}}
        return cp.producer("/v1/producer/submit-batch", {"common": common, "submits": items})

    assert batch(limits.submit_batch_max)[0] == 200
    assert batch(limits.submit_batch_max + 1)[0] == 413  # one past the stated limit is refused

    worker = new_ulid()
    status, registered = cp.daemon("/v1/daemon/register", {"worker_id": worker, "queues": ["q"]})
    assert status == 200, registered
    assert ServerLimits.from_answer(registered) == limits  # the register answer says the same
    acks = [
        {"invocation_id": new_ulid(), "state": "succeeded", "attempt": 1, "result_blob": b""}
        for _ in range(limits.acks_per_poll + 1)
    ]
    body = {"worker_id": worker, "queues": ["q"], "timeout_s": 0, "acks": acks}
    status, out = cp.daemon("/v1/daemon/poll", body)
    assert status == 400 and str(limits.acks_per_poll) in str(out), (status, out)


def test_the_sdk_sizes_its_submit_batches_by_the_stated_limit(cp: ControlPlane) -> None:
    with HttpDispatch(cp.url, cp.producer_token) as plane:
        calls = [(Envelope.create(fn_for(len), ("abc",)), "q", {}, None) for _ in range(7)]
        got = plane.submit_batch(calls)
    assert got == [envelope.id for envelope, *_ in calls]  # 3 + 3 + 1: none refused for size
    assert plane.server_limits().submit_batch_max == 3
