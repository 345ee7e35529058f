"""What an operator sees for a queued call that cannot run yet (issue 29, "nothing waits
silently"): ``lakeshore show``, ``GET /v1/ops/invocations/:id`` (``waiting``) and the dashboard say
why: not before its time, no live worker of its queue, no live worker that fits (naming the
largest offer), a fleet-wide limit that is full, or its turn on workers that fit. On SQLite and
PostgreSQL, through a real control plane over HTTP."""

from __future__ import annotations

import re
import time
from typing import Any

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import ControlPlane, submit_body
from tests.integration.ops_kit import login, run


def _register(cp: ControlPlane, queue: str, gpus: int = 0, labels: dict[str, str] | None = None) -> str:
    worker = new_ulid()
    capacity = {"cpus": 8, "memory_mb": 16384, "arch": "x86_64", "os": "linux",
                "gpus": [{"index": i, "model": "H100", "memory_mib": 81559} for i in range(gpus)]}  # fmt: skip
    body = {"worker_id": worker, "queues": [queue], "capacity": capacity, "labels": labels or {}, "slots": 2}
    status, out = cp.call("/v1/daemon/register", body, cp.daemon_token)
    assert status == 200, out
    return worker


def _submit(cp: ControlPlane, queue: str, **run_config: Any) -> str:
    inv = new_ulid()
    status, out = cp.call(
        "/v1/producer/submit",
        submit_body(inv, queue, run_config={"queue": queue, **run_config}),
        cp.admin_token,
    )
    assert status == 200, out
    return inv


def _waiting(cp: ControlPlane, inv: str) -> dict[str, Any] | None:
    resp = cp.client(cp.admin_token).get(f"/v1/ops/invocations/{inv}")
    assert resp.status_code == 200, resp.text
    return resp.json()["waiting"]


def test_show_says_why_a_queued_call_waits(control_plane: ControlPlane) -> None:
    cp = control_plane
    later = _submit(cp, "any", not_before=time.time() + 3600)
    nobody = _submit(cp, "unserved")
    _register(cp, "gpu", gpus=2)
    big = _submit(cp, "gpu", resources={"gpus": 4})
    _register(cp, "lim")
    running, held = _submit(cp, "lim"), _submit(cp, "lim")
    cp.store.set_queue_limit("lim", 1)
    assert [i.invocation_id for i in cp.store.claim("w-lim", ["lim"], limit=2)] == [running]
    keyed = [_submit(cp, "keyed", concurrency_key="db", max_concurrency=1) for _ in range(2)]
    _register(cp, "keyed")
    assert [i.invocation_id for i in cp.store.claim("w-key", ["keyed"], limit=2)] == keyed[:1]
    _register(cp, "plain")
    turn = _submit(cp, "plain")

    reasons = {inv: _waiting(cp, inv) for inv in (later, nobody, big, held, keyed[1], turn)}
    assert {k: (v or {}).get("reason") for k, v in reasons.items()} == {
        later: "not_before",
        nobody: "no_worker",
        big: "no_fit",
        held: "limit",
        keyed[1]: "limit",
        turn: "busy",
    }
    assert reasons[nobody]["message"] == "no live worker serves queue 'unserved'"  # type: ignore[index]
    assert reasons[big]["message"] == "no live worker of queue 'gpu' offers 4 GPUs (largest: 2)"  # type: ignore[index]
    assert "queue 'lim' is at its limit (lakeshore queue limit): 1 of 1 running" in reasons[held]["message"]  # type: ignore[index]
    assert "concurrency key 'db' is at its max_concurrency: 1 of 1 running" in reasons[keyed[1]]["message"]  # type: ignore[index]
    assert _waiting(cp, running) is None  # running: nothing to explain

    shown = run(cp, "show", big)
    assert shown.exit_code == 0, shown.output
    assert "waits       no live worker of queue 'gpu' offers 4 GPUs (largest: 2)" in shown.stdout
    assert "not before " in run(cp, "show", later).stdout
    assert "waits" not in run(cp, "show", running).stdout
    page = login(cp, cp.admin_token).get(f"/ui/parts/invocations/{held}").text
    assert 'data-reason="limit"' in page and "1 of 1 running" in page


def test_concurrency_limits_are_visible_in_queues_and_the_dashboard(control_plane: ControlPlane) -> None:
    """``@dls.udf(concurrency_key=, max_concurrency=)`` limits sit beside the queues' own: ``lakeshore
    queues``, ``GET /v1/ops/queues`` (``key_limits``) and the dashboard's overview list each key's
    limit and its calls running now. A key belongs to the namespace that submits it: the admin sees
    it as ``<namespace>/<key>``, a token of that namespace by its own name, another namespace not
    at all."""
    cp = control_plane
    keyed = [_submit(cp, "keyed2", concurrency_key="gpu-db", max_concurrency=2) for _ in range(3)]
    _register(cp, "keyed2")
    claimed = cp.store.claim("w-key2", ["keyed2"], limit=3)
    assert [i.invocation_id for i in claimed] == keyed[:2]

    listed = cp.client(cp.admin_token).get("/v1/ops/queues").json()["key_limits"]
    assert {"key": "default/gpu-db", "max_concurrency": 2, "running": 2} in listed
    own = cp.client(cp.store.create_token("namespace", "n-default", "default"))
    assert {"key": "gpu-db", "max_concurrency": 2, "running": 2} in own.get("/v1/ops/queues").json()[
        "key_limits"
    ]
    other = cp.client(cp.store.create_token("namespace", "n-other", "other"))
    assert other.get("/v1/ops/queues").json()["key_limits"] == []

    out = run(cp, "queues")
    assert out.exit_code == 0, out.output
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("default/gpu-db"))
    assert line.split() == ["default/gpu-db", "2", "2"], out.stdout
    assert "CONCURRENCY KEY" in out.stdout

    page = login(cp, cp.admin_token).get("/ui/parts/overview").text
    m = re.search(r'<tr data-key="default/gpu-db" class="([^"]*)">(.*?)</tr>', page, re.S)
    assert m, page
    assert m.group(1) == "warn"  # at its limit
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", m.group(2), re.S)]
    assert cells == ["default/gpu-db", "2", "2"]


def test_why_it_waits_counts_only_the_workers_that_may_claim_it(control_plane: ControlPlane) -> None:
    """A worker bound to another namespace never claims this namespace's calls: the reason a call
    waits (and the submit's placement warning) says no worker serves its queue, not that one
    fits, and tells nothing of the other tenant's worker (it said "1 live worker ... fit it" and
    "offers 16 GPUs (largest: 8)", mapping another tenant's fleet a request at a time)."""
    cp = control_plane
    other = cp.store.create_token("daemon", "daemon-b", "team-b")
    body = {
        "worker_id": new_ulid(),
        "queues": ["shared-q"],
        "capacity": {"gpus": [{"index": i, "model": "H100", "memory_mib": 81559} for i in range(8)]},
        "slots": 2,
    }
    assert cp.call("/v1/daemon/register", body, other)[0] == 200
    producer = cp.store.create_token("producer", "prod-a", "team-a")
    waits = []
    for run_config in ({}, {"resources": {"gpus": 16}}):
        inv = new_ulid()
        status, out = cp.call(
            "/v1/producer/submit", submit_body(inv, "shared-q", run_config=run_config), producer
        )
        assert status == 200 and "largest" not in str(out.get("warning")), out
        waits.append(_waiting(cp, inv))
    for waiting in waits:
        assert waiting == {"reason": "no_worker", "message": "no live worker serves queue 'shared-q'"}, (
            waiting
        )
