"""An idle fleet costs no transactions (``server/idle.py``), and misses nothing for it.

A daemon whose long poll ended empty polls again at once: that renewal waits without a store
pass, and a heartbeat with nothing running, sent while its poll waits, is answered from memory.
What a pass would have found still arrives: work submitted between the two polls, a version
pinned meanwhile, a cancel for the work it runs. Counted with the server's own metrics
(``lakeshore_poll_passes``, ``lakeshore_idle_answers``, ``lakeshore_write_seconds``), over real
HTTP, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import ControlPlane, running_control_plane

NO_RECHECK = ServerConfig(recheck_s=600.0, poll_recheck_s=600.0)
SETTLE_S = 30.0  # a deadline for conditions the tests wait for, never a measured bound


@pytest.fixture
def cp(store_url: str) -> Iterator[ControlPlane]:
    with running_control_plane(store_url, config=NO_RECHECK) as plane:
        # on PostgreSQL the memo stands in for a pass only while the wake-up relay listens (it
        # connects in the background after start-up; a loaded machine can take a while)
        deadline = time.monotonic() + SETTLE_S
        while not plane.app.state.ctx.polls.reliable:
            assert time.monotonic() < deadline, "the wake-up relay never started listening"
            time.sleep(0.01)
        yield plane


def _metric(cp: ControlPlane, name: str, **labels: str) -> float:
    resp = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    assert resp.status_code == 200
    total = 0.0
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _counts(cp: ControlPlane) -> tuple[float, float, float, float]:
    """Poll passes, renewals and heartbeats answered from memory, heartbeats written."""
    return (
        _metric(cp, "lakeshore_poll_passes_total"),
        _metric(cp, "lakeshore_idle_answers_total", kind="renewal"),
        _metric(cp, "lakeshore_idle_answers_total", kind="heartbeat"),
        _metric(cp, "lakeshore_write_seconds_count", kind="heartbeat"),
    )


def _poll(cp: ControlPlane, worker: str, timeout_s: float, most: int = 1) -> dict[str, Any]:
    body = {"worker_id": worker, "queues": ["default"], "max": most, "timeout_s": timeout_s}
    status, out = cp.daemon("/v1/daemon/poll", body)
    assert status == 200, out
    return dict(out)


def _heartbeat(
    cp: ControlPlane, worker: str, running: list[dict[str, Any]] | None = None, *, exec_leases: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {"worker_id": worker, "running": running or []}
    if exec_leases:  # as nymph sends it; without it, the heartbeat renews every exec job the worker holds
        body["running_exec"] = []
    status, out = cp.daemon("/v1/daemon/heartbeat", body)
    assert status == 200, out
    return dict(out)


def _waiting(cp: ControlPlane, n: int = 1) -> None:
    deadline = time.monotonic() + SETTLE_S
    while cp.app.state.ctx.polls.waiting < n:
        assert time.monotonic() < deadline, "the poll never started waiting"
        time.sleep(0.01)


def _registered(cp: ControlPlane, namespace: str | None = None) -> str:
    worker = new_ulid()
    body: dict[str, Any] = {"worker_id": worker, "queues": ["default"]}
    if namespace is not None:
        body["namespace"] = namespace
    assert cp.daemon("/v1/daemon/register", body)[0] == 200
    return worker


def test_an_idle_daemons_renewal_and_heartbeats_run_no_transaction(cp: ControlPlane) -> None:
    worker = _registered(cp)
    assert _poll(cp, worker, 0.3)["commands"] == []  # its opening pass, then a wait that ended empty
    passes, renewals, quiet, written = _counts(cp)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        renewal = pool.submit(_poll, cp, worker, 2.0)
        _waiting(cp)
        beats = [_heartbeat(cp, worker) for _ in range(3)]
        # a daemon from before exec leases: written (its heartbeat renews every exec job it holds)
        _heartbeat(cp, worker, exec_leases=False)
        assert renewal.result(timeout=SETTLE_S)["commands"] == []
    assert all(b == {"ok": True, "lease_s": 30.0, "commands": [], "lost": []} for b in beats), beats
    after = _counts(cp)
    assert after == (passes, renewals + 1, quiet + 3, written + 1), (after, passes, renewals, quiet, written)

    # with nothing of its poll waiting, a heartbeat is written as before
    _heartbeat(cp, worker)
    assert _counts(cp)[3] == written + 2


def test_a_renewal_gets_the_work_submitted_between_its_polls(cp: ControlPlane) -> None:
    worker = _registered(cp)
    assert _poll(cp, worker, 0.3)["commands"] == []
    inv = cp.submit()  # no poll waits: the hub keeps the wake-up
    passes, renewals, _, _ = _counts(cp)
    started = time.monotonic()
    out = _poll(cp, worker, 20.0)
    assert [c["body"]["invocation_id"] for c in out["commands"]] == [inv]
    assert time.monotonic() - started < 10.0  # handed over at once, not at the poll's end
    after = _counts(cp)
    assert after[1] == renewals + 1 and after[0] == passes + 1  # it waited, was woken, then claimed


def test_a_poll_that_took_all_there_was_is_renewed_and_one_that_filled_its_max_passes_again(
    cp: ControlPlane,
) -> None:
    """A pass that claimed fewer than its ``max`` left nothing for its daemon, so the daemon's
    next poll waits without a pass, and still gets the next submit. A pass that filled its
    ``max`` may have left work: the next poll passes and claims it at once."""
    worker = _registered(cp)
    _heartbeat(cp, worker)
    first = cp.submit()
    assert [c["body"]["invocation_id"] for c in _poll(cp, worker, 5.0, most=2)["commands"]] == [first]
    passes, renewals, _, _ = _counts(cp)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        renewal = pool.submit(_poll, cp, worker, 20.0, 2)
        _waiting(cp)
        assert _counts(cp)[:2] == (passes, renewals + 1)  # waiting, and no pass ran
        nxt = cp.submit()
        out = renewal.result(timeout=SETTLE_S)
    assert [c["body"]["invocation_id"] for c in out["commands"]] == [nxt]

    a, b = cp.submit(), cp.submit()
    (got,) = _poll(cp, worker, 5.0, most=1)["commands"]  # its max: the other is still queued
    passes, renewals, _, _ = _counts(cp)
    started = time.monotonic()
    (then,) = _poll(cp, worker, 20.0, most=1)["commands"]
    assert time.monotonic() - started < 10.0  # claimed by its opening pass, not at the poll's end
    assert sorted([got["body"]["invocation_id"], then["body"]["invocation_id"]]) == sorted([a, b])
    assert _counts(cp)[:2] == (passes + 1, renewals)


def _acking(
    cp: ControlPlane, worker: str, inv: str, state: str, attempt: int, most: int = 2
) -> tuple[int, dict[str, Any]]:
    ack = {"invocation_id": inv, "state": state, "attempt": attempt, "result_blob": b"\xc0"}
    body = {"worker_id": worker, "queues": ["default"], "max": most, "timeout_s": 20.0, "acks": [ack]}
    status, out = cp.daemon("/v1/daemon/poll", body)
    return status, dict(out)


def test_a_poll_carrying_acks_after_one_that_took_all_there_was_writes_them_without_a_pass(
    cp: ControlPlane,
) -> None:
    """``lakeshore worker``'s warm path: its next poll carries the ack of the call its last poll
    took, and that poll had room to spare, so this one writes the acks alone and waits at once (no
    claim pass in their transaction). The ack is committed and answered all the same, the next
    submit reaches it, and what an ack puts back (a preempted call, queued again at once) wakes it."""
    worker = _registered(cp)
    _heartbeat(cp, worker)
    first = cp.submit()
    (cmd,) = _poll(cp, worker, 5.0, most=2)["commands"]  # fewer than its max: it took all there was
    assert cmd["body"]["invocation_id"] == first
    passes, renewals, _, _ = _counts(cp)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        polled = pool.submit(_acking, cp, worker, first, "succeeded", cmd["body"]["attempt"])
        _waiting(cp)
        assert _counts(cp)[:2] == (passes, renewals + 1)  # waiting, and no pass ran
        status, got = cp.producer("/v1/producer/await", {"invocation_id": first, "timeout_s": 0})
        assert status == 200 and got["state"] == "succeeded", got  # the ack is committed already
        nxt = cp.submit()
        status, out = polled.result(timeout=SETTLE_S)
    assert status == 200, out
    assert out["acked"] == [{"invocation_id": first, "status": 200, "ok": True}]
    (then,) = out["commands"]
    assert then["body"]["invocation_id"] == nxt

    # a preempted ack queues its call again at once: the waiting poll is woken and claims it
    passes, renewals, _, _ = _counts(cp)
    status, out = _acking(cp, worker, nxt, "preempted", then["body"]["attempt"])
    assert status == 200, out
    assert out["acked"] == [{"invocation_id": nxt, "status": 200, "ok": True}]
    (again,) = out["commands"]
    assert (again["body"]["invocation_id"], again["body"]["attempt"]) == (nxt, then["body"]["attempt"] + 1)
    assert _counts(cp)[:2] == (passes + 1, renewals + 1)  # it waited, was woken, then claimed


def test_a_version_pinned_meanwhile_reaches_the_idle_daemon_at_once(cp: ControlPlane) -> None:
    worker = _registered(cp, namespace="team-a")
    assert "target_nymph_version" not in _poll(cp, worker, 0.3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        renewal = pool.submit(_poll, cp, worker, 1.0)
        _waiting(cp)
        assert "target_nymph_version" not in _heartbeat(cp, worker)  # answered from memory
        status, _ = cp.json("PUT", "/v1/namespaces/team-a/pin", {"nymph_version": "0.1.4"}, cp.admin_token)
        assert status == 200
        assert _heartbeat(cp, worker)["target_nymph_version"] == "0.1.4"
        renewal.result(timeout=SETTLE_S)
    assert _poll(cp, worker, 0.3)["target_nymph_version"] == "0.1.4"
    # a re-register (another namespace) is seen by the next heartbeat, not remembered past it
    again = {"worker_id": worker, "queues": ["default"], "namespace": "team-b"}
    assert cp.daemon("/v1/daemon/register", again)[0] == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        renewal = pool.submit(_poll, cp, worker, 1.0)
        _waiting(cp)
        assert "target_nymph_version" not in _heartbeat(cp, worker)
        renewal.result(timeout=SETTLE_S)


def test_a_cancel_reaches_a_daemon_whose_passes_only_claim(cp: ControlPlane) -> None:
    worker = _registered(cp)
    _heartbeat(cp, worker)  # a full write: from here its passes only claim
    inv = cp.submit()
    (run,) = _poll(cp, worker, 5.0)["commands"]
    assert run["body"]["invocation_id"] == inv
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_poll, cp, worker, 20.0)
        _waiting(cp)
        status, out = cp.producer(f"/v1/producer/invocations/{inv}/cancel", {})
        assert status == 200, out
        out = waiting.result(timeout=SETTLE_S)
    assert [(c["kind"], c["body"]["invocation_id"]) for c in out["commands"]] == [("cancel", inv)]
    # a heartbeat that reports the work running is written, and is asked again (until the ack)
    beat = _heartbeat(cp, worker, [{"invocation_id": inv, "attempt": 1}])
    assert [(c["kind"], c["body"]["invocation_id"]) for c in beat["commands"]] == [("cancel", inv)]
    assert beat["commands"][0]["id"] != out["commands"][0]["id"]
