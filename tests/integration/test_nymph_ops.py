"""nymph end to end, continued: namespace exec jobs, a lost lease, double SIGINT, health/metrics.

Same rules as test_nymph_agent.py: a real control plane over HTTP, ``nymph start`` as a real
subprocess, real entries; timings shortened through settings, no assertion about speed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgpack

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.server.config import ServerConfig
from tests import nymph_fns
from tests.integration.conftest import ControlPlane, running_control_plane
from tests.stack.nymph import Nymph
from tests.stack.ports import free_port
from tests.stack.procs import alive
from tests.stack.producer import await_result, envelope, preempted_back_in_queue, state_of, submit
from tests.stack.wait import until

# --- namespace exec jobs (seed 003, flows 1-4) ------------------------------------------------------


def _exec(cp: ControlPlane, body: dict[str, object]) -> str:
    status, out = cp.json("POST", "/v1/namespaces/team/exec", body, cp.admin_token)
    assert status == 202, out
    return str(out["exec_id"])


def _exec_result(cp: ControlPlane, exec_id: str) -> dict[str, object]:
    status, out = cp.json(
        "GET", f"/v1/namespaces/team/jobs/{exec_id}/result?wait=60", None, cp.admin_token, timeout=90
    )
    assert status == 200, out
    return dict(out)


def test_exec_job_runs_its_command_with_the_inline_payload_and_publishes_the_result(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--allow-exec")
    payload = msgpack.packb({"x": [1, 2, 3]})
    exec_id = _exec(
        cp,
        {
            "command": 'sha256sum "$LAKESHORE_PAYLOAD" | cut -d" " -f1; echo "to stderr $LAKESHORE_EXEC_ID" >&2; exit 3',
            "payloadInline": base64.b64encode(payload).decode(),
        },
    )
    out = _exec_result(cp, exec_id)
    assert out["exit_code"] == 3, n.output()[-3000:]
    assert out["stdout"] == hashlib.sha256(payload).hexdigest() + "\n"  # the very bytes sent
    assert out["stderr"] == f"to stderr {exec_id}\n"
    assert out["resultInline"] is None and out["resultRef"] is None
    until(lambda: not (n.workdir / "exec" / exec_id).exists(), "the exec workdir to be removed")


def test_exec_job_whose_payload_ref_cannot_be_fetched_is_minus_one_and_never_spawns(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane  # no payload store configured: presign answers 501
    n = nymph_factory(cp.url, cp.daemon_token, "--allow-exec")
    marker = tmp_path / "spawned"
    ref = {"bucket": "b", "key": "payloads/2024/01/01/x/args", "size": 3, "sha256": "0" * 64}
    exec_id = _exec(cp, {"command": f"touch {marker}", "payloadRef": ref})
    out = _exec_result(cp, exec_id)
    assert out["exit_code"] == -1, n.output()[-3000:]
    assert "could not be fetched" in str(out["stderr"]) and "payload store not configured" in str(
        out["stderr"]
    )
    assert not marker.exists()


def test_exec_job_past_its_timeout_is_stopped_and_reported_124(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    nymph_factory(cp.url, cp.daemon_token, "--allow-exec")
    exec_id = _exec(cp, {"command": "echo started; exec sleep 120", "timeout_s": 1})
    out = _exec_result(cp, exec_id)
    assert out["exit_code"] == 124
    assert out["stdout"] == "started\n"
    assert "timed out after 1s" in str(out["stderr"])


def test_the_heartbeat_keeps_a_long_exec_job_leased_and_a_lost_one_is_stopped_unpublished(
    tmp_path: Path, nymph_factory: Callable[..., Nymph]
) -> None:
    """Exec jobs lease like invocations: nymph's heartbeat (``running_exec``) renews the lease of
    one that outlives it many times over; when another claim takes the job, nymph stops its copy
    and publishes nothing, and only the new claimer's result counts."""
    config = ServerConfig(lease_s=1.0, expire_every_s=0.1, recheck_s=0.2)
    with running_control_plane(str(tmp_path / "cp.db"), config=config) as cp:
        n = nymph_factory(cp.url, cp.daemon_token, "--concurrency", "1", "--allow-exec")
        long_one = _exec(cp, {"command": "sleep 3; echo finished", "max_attempts": 1})
        out = _exec_result(cp, long_one)
        assert (out["exit_code"], out["stdout"]) == (0, "finished\n"), n.output()[-3000:]
        assert cp.store.get_exec("team", long_one)["attempt"] == 1  # type: ignore[index]

        marker = tmp_path / "still-running"
        stolen = _exec(cp, {"command": f"sleep 1; while true; do touch {marker}; sleep 0.2; done"})
        until(marker.exists, "the exec command to start under nymph")
        # its lease lapses (as if the heartbeats had not arrived) and another daemon claims it first
        # (a heartbeat in between takes a job nobody claimed yet back: then try again)
        other = ids.new_ulid()

        def steal() -> list[dict[str, object]]:
            cp.store.expire_leases(now=time.time() + 3600)
            return cp.store.claim_exec(other, ["default"])

        (claimed,) = until(steal, "another daemon to claim the exec job")
        assert claimed["exec_id"] == stolen and claimed["attempt"] == 2
        until(lambda: "lease lost to another claim" in n.output(), "nymph to hear its exec lease is lost")
        until(lambda: time.time() - marker.stat().st_mtime > 2, "nymph to stop its copy")
        route = f"/v1/namespaces/team/jobs/{stolen}/result"
        mine = {"exit_code": 0, "stdout": "other", "stderr": "", "worker_id": other, "attempt": 2}
        assert cp.json("POST", route, mine, cp.daemon_token) == (200, {"ok": True})
        assert _exec_result(cp, stolen)["stdout"] == "other"
        assert "is not published" in n.output()


# --- a lost lease ----------------------------------------------------------------------------------


def test_lost_lease_kills_the_local_copy_without_an_ack_and_the_next_attempt_runs(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--concurrency", "1")
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.wait_for_file, "release"), max_attempts=3)
    handle = n.workdir / inv / "handle.json"
    until(handle.exists, "attempt 1 to start")
    first_pid = int(json.loads(handle.read_text())["data"]["pid"])
    # the lease lapses (as if the heartbeats had not arrived): the control plane requeues attempt 2
    assert inv in cp.store.expire_leases(now=time.time() + 3600)
    until(lambda: "lost to another attempt" in n.output(), "nymph to hear its lease is lost")
    until(lambda: not alive(first_pid), "attempt 1 to be killed")

    def attempt_two_started() -> bool:
        try:
            return int(json.loads(handle.read_text())["attempt"]) == 2
        except (OSError, ValueError):
            return False

    until(attempt_two_started, "attempt 2 to start here")
    (n.workdir / inv / "release").touch()
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", n.output()[-3000:]
    summaries = [ln for ln in n.output().splitlines() if f"invocation {inv}: " in ln and " runner=" in ln]
    assert len(summaries) == 2, summaries  # attempt 1 was never acked: only attempt 2 was
    assert ": lost runner=process attempt=1 " in summaries[0]
    assert ": succeeded runner=process attempt=2 " in summaries[1]


# --- signals, health, metrics, the summary line ---------------------------------------------------


def test_second_sigint_stops_at_once_without_waiting_for_the_grace(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    # a grace far longer than the wait below: only the immediate path can end nymph in time
    n = nymph_factory(cp.url, cp.daemon_token, "--grace-s", "3600")
    stuck = submit(cp.url, cp.producer_token, envelope(nymph_fns.wait_for_file, "never", 3600))
    until(lambda: (n.workdir / stuck / "handle.json").exists(), "the job to start")
    n.signal(signal.SIGINT)
    until(lambda: "running work has 3600s to finish" in n.output(), "the first SIGINT to be handled")
    n.signal(signal.SIGINT)
    assert n.wait() == 0
    out = preempted_back_in_queue(cp.url, cp.producer_token, stuck)
    assert out["error"]["type"] == "Preempted"
    assert out["error"]["message"] == "daemon shutdown grace expired"


def test_metrics_port_serves_healthz_and_metrics_and_each_invocation_logs_one_summary_line(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    port = free_port()
    n = nymph_factory(cp.url, cp.daemon_token, "--metrics-port", str(port))
    base = f"http://127.0.0.1:{port}"

    def healthy() -> dict[str, object] | None:
        try:
            resp = httpx.get(base + "/healthz", timeout=2)
        except httpx.HTTPError:
            return None
        return dict(resp.json()) if resp.status_code == 200 else None

    health = until(healthy, "nymph's /healthz to answer 200")
    assert health["ok"] is True and health["runner"] == "process" and health["worker_id"]
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.add, 2, 3))
    assert await_result(cp.url, cp.producer_token, inv)["state"] == "succeeded"
    bad = submit(cp.url, cp.producer_token, envelope(nymph_fns.boom, "x"))
    assert await_result(cp.url, cp.producer_token, bad)["state"] == "failed"

    def counted() -> str | None:
        text = httpx.get(base + "/metrics", timeout=2).text
        ok = 'nymph_invocations_total{runner="process",state="succeeded"} 1.0' in text
        return text if ok and 'state="failed"} 1.0' in text else None

    metrics = until(counted, "the invocations to be counted")
    assert "nymph_polls_total" in metrics and "nymph_invocation_seconds_bucket" in metrics
    until(lambda: f"invocation {bad}: failed" in n.output(), "the failure's summary line")
    lines = n.output().splitlines()
    summary = [ln for ln in lines if f"invocation {inv}: succeeded " in ln]
    assert len(summary) == 1 and "runner=process" in summary[0] and "duration=" in summary[0]
    failed = [ln for ln in lines if f"invocation {bad}: failed " in ln]
    assert len(failed) == 1 and "ValueError: x" in failed[0]
    n.signal(signal.SIGTERM)
    assert n.wait() == 0
    assert state_of(cp.url, cp.producer_token, inv) == "succeeded"
