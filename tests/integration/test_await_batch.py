"""``POST /v1/producer/await-batch`` and the SDK's bulk reads over HTTP: a sweep's results come in
batches (``Calls.results()``, ``dls.wait``, ``dls.as_completed``), the wait ends when any call
ends, and another namespace's ids are answered exactly as ids that do not exist."""

from __future__ import annotations

from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.errors import DispatchError, NotFound
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.api import SubmitRequest
from tests.integration.conftest import ControlPlane
from tests.integration.map_kit import Worker, odd_fails, square


class CountingHttp(HttpDispatch):
    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, token)
        self.batches: list[int] = []
        self.awaits = 0

    def await_batch(self, invocation_ids: Any, timeout: float) -> dict[str, Any]:
        self.batches.append(len(invocation_ids))
        return super().await_batch(invocation_ids, timeout)

    def await_result(self, invocation_id: str, timeout: float) -> dict[str, Any]:
        self.awaits += 1
        return super().await_result(invocation_id, timeout)


def test_a_sweep_reads_its_results_in_batches(control_plane: ControlPlane) -> None:
    plane = CountingHttp(control_plane.url, control_plane.producer_token)
    calls = square.map(range(2100), _dispatch=plane)
    with Worker(control_plane, "sweep"):
        done, not_done = dls.wait(calls, timeout=120)
        assert len(done) == 2100 and not not_done
        before = len(plane.batches)
        assert list(calls.results()) == [x * x for x in range(2100)]
        assert len(plane.batches) == before and plane.awaits == 0  # outcomes kept on the handles

        fresh = odd_fails.map(range(2100), _dispatch=plane)
        values = list(fresh.results(60, return_exceptions=True))
    assert values[::2] == list(range(0, 2100, 2))
    assert all(isinstance(v, DispatchError) and "odd" in str(v) for v in values[1::2])
    assert max(plane.batches) == 1000 and len(plane.batches) - before < 2100 // 4
    assert plane.awaits == 0
    plane.close()


def test_the_wait_ends_when_any_call_ends(control_plane: ControlPlane) -> None:
    plane = HttpDispatch(control_plane.url, control_plane.producer_token)
    never = square.submit(1, _dispatch=plane, _queue="nobody")
    with Worker(control_plane, "sweep"):
        ran = square.submit(3, _dispatch=plane)
        done, not_done = dls.wait([never, ran], timeout=30, return_when=dls.FIRST_COMPLETED)
        assert done == {ran} and not_done == {never} and ran.result() == 9
    first = next(dls.as_completed([never, ran], timeout=5))
    assert first == ran
    assert never.cancel() == "cancelled"
    assert [i for i in dls.as_completed([never], timeout=10)] == [never]
    with pytest.raises(DispatchError):
        never.result()
    plane.close()


def _submit_in(cp: ControlPlane, namespace: str) -> str:
    inv = new_ulid()
    cp.store.submit(
        SubmitRequest(inv, "q", {"module": "m", "qualname": "f"}, b"\x90", {}, namespace=namespace)
    )
    return inv


def test_another_namespaces_ids_are_answered_as_unknown_ones(control_plane: ControlPlane) -> None:
    """The attacker's side: team-b's producer asks about team-a's ids."""
    cp = control_plane
    a_token = cp.store.create_token("producer", "team-a", "team-a")
    b_token = cp.store.create_token("producer", "team-b", "team-b")
    theirs = _submit_in(cp, "team-a")
    cp.store.cancel(theirs)  # terminal: a result an answer could carry
    queued = _submit_in(cp, "team-a")
    nobody = new_ulid()
    mine = _submit_in(cp, "team-b")

    status, out = cp.call(
        "/v1/producer/await-batch",
        {"invocation_ids": [theirs, queued, nobody, mine], "timeout_s": 0},
        b_token,
    )
    assert status == 200, out
    assert out == {"results": [], "states": {mine: "queued"}, "unknown": [theirs, queued, nobody]}

    status, out = cp.call(
        "/v1/producer/await-batch", {"invocation_ids": [theirs, queued], "timeout_s": 0}, a_token
    )
    assert status == 200 and [r["invocation_id"] for r in out["results"]] == [theirs]
    assert out["results"][0]["state"] == "cancelled" and out["states"] == {queued: "queued"}

    # through the SDK: the handle of an id the token may not see is not found, as a bad id is
    plane = HttpDispatch(cp.url, b_token)
    (got,) = dls.as_completed([dls.Invocation(theirs, plane)], timeout=5)
    with pytest.raises(NotFound):
        got.result()
    plane.close()


def test_bad_requests_say_what_to_send(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    status, out = cp.producer("/v1/producer/await-batch", {"invocation_ids": [new_ulid()] * 1001})
    assert status == 413 and "chunks of at most 1000" in out["error"]
    status, out = cp.producer("/v1/producer/await-batch", {"invocation_ids": ["../etc"]})
    assert status == 400 and "invocation_ids[0]" in out["error"]
    status, out = cp.producer("/v1/producer/await-batch", {"invocation_ids": []})
    assert status == 400 and "empty" in out["error"]
    status, out = cp.call("/v1/producer/await-batch", {"invocation_ids": [new_ulid()]}, cp.daemon_token)
    assert status == 403


def test_a_pickled_submit_warns_when_every_live_worker_refuses_pickles(
    sqlite_control_plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    cp = sqlite_control_plane
    for queue, says in (("refuse", [False]), ("mixed", [False, True]), ("silent", [None]), ("idle", [])):
        for allow in says:
            body: dict[str, Any] = {"worker_id": new_ulid(), "queues": [queue]}
            if allow is not None:
                body["allow_pickled"] = allow
            status, out = cp.daemon("/v1/daemon/register", body)
            assert status == 200, out
    status, out = cp.json("GET", "/v1/ops/workers", None, cp.producer_token)
    assert sorted(str(w["allow_pickled"]) for w in out["workers"]) == ["False", "False", "None", "True"]

    def local(x: int) -> int:  # a closure: not importable by module, so it travels pickled
        return x

    plane = HttpDispatch(cp.url, cp.producer_token)
    for queue in ("refuse", "mixed", "silent", "idle"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dreamlake.lakeshore.dispatch.http"):
            dls.udf(queue=queue, code=None)(local).submit(1, _dispatch=plane)
            dls.udf(queue=queue, code=None)(local).map([1, 2], _dispatch=plane)
        warned = [r.getMessage() for r in caplog.records if "refuses pickled functions" in r.getMessage()]
        if queue == "refuse":  # once per queue, with the flag that fixes it
            assert len(warned) == 1 and "--allow-pickled" in warned[0] and "local" in warned[0], warned
        else:
            assert warned == [], (queue, warned)
    plane.close()


def test_a_task_token_reads_only_its_descendants(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    parent = _submit_in(cp, "default")
    body = {"worker_id": new_ulid(), "queues": ["q"], "timeout_s": 0, "kinds": ["run"]}
    status, out = cp.daemon("/v1/daemon/poll", body)
    assert status == 200 and out["commands"][0]["body"]["invocation_id"] == parent, out
    task_token = out["commands"][0]["body"]["task_token"]
    child = new_ulid()
    cp.store.submit(
        SubmitRequest(child, "q", {"module": "m", "qualname": "f"}, b"\x90", {}, parent_invocation_id=parent)
    )
    stranger = _submit_in(cp, "default")  # same namespace, not the task's descendant
    ids = [child, stranger, parent]
    status, out = cp.call("/v1/producer/await-batch", {"invocation_ids": ids, "timeout_s": 0}, task_token)
    assert status == 200, out
    assert out == {"results": [], "states": {child: "queued"}, "unknown": [stranger, parent]}
