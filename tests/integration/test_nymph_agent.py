"""nymph end to end: a real control plane over HTTP, ``nymph start`` as a real subprocess, real entries.

Every test drives nymph the way an operator does (the console script, signals) and a producer does
(submit, await, stream, cancel over HTTP). Timings are shortened through nymph's own settings
(heartbeat, poll timeout, grace); no assertion is about speed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from dreamlake.lakeshore import wire
from tests import nymph_fns
from tests.host_users import ensure_user
from tests.integration.conftest import ControlPlane
from tests.stack.nymph import NYMPH, ROOT_TASKS, Nymph
from tests.stack.ports import free_port
from tests.stack.procs import alive, child_env
from tests.stack.producer import (
    await_result,
    call,
    envelope,
    frames_of,
    preempted_back_in_queue,
    state_of,
    submit,
)
from tests.stack.server import Server
from tests.stack.wait import until

pytestmark = pytest.mark.slow  # real nymph and server processes


# --- the basic outcomes ----------------------------------------------------------------------------


def test_plain_function_succeeds_and_its_workdir_is_removed(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.add, 2, 3))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert wire.unpack(out["result_blob"]) == 5
    until(lambda: not (n.workdir / inv).exists(), "the workdir to be removed")
    assert (n.state_dir / "worker_id").read_text().strip() != ""


def test_async_bodies_run_through_nymph(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    """An ``async def`` runs to completion and an async generator streams, on nymph's process
    runner (the warm fork; every runner runs the same entry)."""
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.async_add, 2, 3))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert wire.unpack(out["result_blob"]) == 5
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.async_count, 3))
    assert await_result(cp.url, cp.producer_token, inv)["state"] == "succeeded"
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE] * 3 + [wire.FRAME_END]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 2]  # type: ignore[arg-type]


def test_running_invocations_hold_no_thread_of_nymphs(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    """Running tasks of the process runner wait in the one supervisor loop, not in a thread each;
    they still end as they would (released, cancelled, timed out)."""
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--concurrency", "4")
    assert n.proc is not None
    nymph = psutil.Process(n.proc.pid)
    # the warm-up: four tasks at once that outlast PARK_AFTER_S (a shorter one ends on the thread
    # that started it), so the zygote, the watcher, the loop and the job threads are all there
    warm = [submit(cp.url, cp.producer_token, envelope(nymph_fns.sleep_for, 0.5)) for _ in range(4)]
    assert all(await_result(cp.url, cp.producer_token, w)["state"] == "succeeded" for w in warm)
    time.sleep(1.0)  # the warm-up's threads wind down
    idle = nymph.num_threads()
    gate = tmp_path / "release"
    invs = [submit(cp.url, cp.producer_token, envelope(nymph_fns.wait_for_file, str(gate))) for _ in range(3)]
    slow = submit(cp.url, cp.producer_token, envelope(nymph_fns.sleep_for, 120), timeout_s=4)
    until(lambda: all((n.workdir / i / "handle.json").exists() for i in [*invs, slow]), "four tasks running")
    # the threads that started them end once they are parked; four waiting tasks add none
    until(lambda: nymph.num_threads() <= idle, f"no thread per running task (idle: {idle})")
    call(cp.url, cp.producer_token, f"/v1/producer/invocations/{invs[0]}/cancel", {})
    assert await_result(cp.url, cp.producer_token, invs[0])["error"]["type"] == "Cancelled"
    gate.write_text("go")
    for inv in invs[1:]:
        out = await_result(cp.url, cp.producer_token, inv)
        assert out["state"] == "succeeded" and wire.unpack(out["result_blob"]) == "released", out
    out = await_result(cp.url, cp.producer_token, slow)
    assert out["state"] == "timeout" and out["error"]["type"] == "Timeout", out


def test_generator_frames_arrive_before_the_job_ends(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.slow_count, 3, 0.0, "release"))
    # the body holds its last value until the release file appears in its workdir
    seen = until(lambda: len(frames_of(cp.url, cp.producer_token, inv, 0.5)) >= 2 or None, "two frames")
    assert seen
    assert state_of(cp.url, cp.producer_token, inv) == "running"
    (n.workdir / inv / "release").touch()
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded"
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE] * 3 + [wire.FRAME_END]
    assert [f.seq for f in frames] == [0, 1, 2, 3]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 2]  # type: ignore[arg-type]


def test_failure_is_acked_with_traceback_and_the_workdir_is_kept(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.boom, "no luck"))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "failed"
    assert out["error"]["type"] == "ValueError" and out["error"]["message"] == "no luck"
    assert "boom" in out["error"]["traceback"]
    kept = n.workdir / inv
    until(lambda: (kept / "outcome.json").exists(), "the failed workdir to be settled")
    assert {"args.msgpack", "error.json", "stdout.log", "stderr.log"} <= {p.name for p in kept.iterdir()}
    assert kept.stat().st_mode & 0o777 == 0o700


def test_pickled_function_is_refused_without_allow_pickled_and_nothing_runs(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(lambda: 1, transport="pickle"))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "failed"
    assert out["error"]["type"] == "PickleRefused"
    assert "--allow-pickled" in out["error"]["message"]
    assert not (n.workdir / inv).exists()


def test_pickled_function_runs_with_allow_pickled(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    nymph_factory(cp.url, cp.daemon_token, "--allow-pickled")
    inv = submit(cp.url, cp.producer_token, envelope(lambda x: x * 2, 21, transport="pickle"))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", out
    assert wire.unpack(out["result_blob"]) == 42


def test_as_user_not_in_the_allow_list_is_refused(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--allow-user", "someoneelse")
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.add, 1), as_user="nobody")
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "failed" and out["error"]["type"] == "UserNotAllowed"
    assert "nobody" in out["error"]["message"]
    assert not (n.workdir / inv).exists()


def _ensure_user(name: str) -> bool:
    return ensure_user(name, "--no-create-home")


def test_script_as_an_allowed_user_streams_logs_and_runs_as_that_user(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    if not _ensure_user("nymphtest"):
        pytest.skip("needs root (or an existing user nymphtest) to run as another user")
    cp = sqlite_control_plane
    base = Path(tempfile.mkdtemp(prefix="nymph-as-user-"))
    os.chmod(base, 0o711)  # the user must be able to reach its own workdir
    try:
        n = nymph_factory(cp.url, cp.daemon_token, "--allow-user", "nymphtest", "--allow-script", base=base)
        inv = submit(cp.url, cp.producer_token, script="id -un; echo oops >&2", as_user="nymphtest")
        out = await_result(cp.url, cp.producer_token, inv)
        assert out["state"] == "succeeded", (out, n.output()[-3000:])
        assert wire.unpack(out["result_blob"]) == {"exit_code": 0}
        frames = frames_of(cp.url, cp.producer_token, inv)
        logs = {(f.meta or {}).get("stream"): f.body for f in frames if f.kind == wire.FRAME_LOG}
        assert logs == {"stdout": b"nymphtest\n", "stderr": b"oops\n"}
        assert frames[-1].kind == wire.FRAME_END
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_failing_script_is_failed_with_its_exit_code(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    nymph_factory(cp.url, cp.daemon_token, "--allow-script")
    inv = submit(cp.url, cp.producer_token, script="echo partial; exit 4")
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "failed"
    assert out["error"]["type"] == "ScriptFailed" and "code 4" in out["error"]["message"]
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert frames[0].kind == wire.FRAME_LOG and frames[0].body == b"partial\n"
    assert frames[-1].kind == wire.FRAME_ERROR


# --- cancel, timeout, shutdown ---------------------------------------------------------------------


def test_cancel_reaches_a_job_while_every_slot_is_busy(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--concurrency", "1")
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.stubborn_tree, 2))
    pids_file = n.workdir / inv / "pids.txt"
    until(pids_file.exists, "the job to start")
    pids = [int(p) for p in pids_file.read_text().split()]
    call(cp.url, cp.producer_token, f"/v1/producer/invocations/{inv}/cancel", {})
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "killed"
    assert out["error"]["type"] == "Cancelled"
    until(lambda: not any(alive(p) for p in pids), "the whole tree to be gone")


def test_a_cancel_whose_answer_was_lost_reaches_the_job_on_a_later_heartbeat(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    """The queued cancel command goes out once; should its answer be lost on the way (a poll
    whose daemon hung up, here another caller takes it while nymph is stopped), the heartbeats
    that go on reporting the invocation running are asked again, and the job is killed."""
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--concurrency", "1")
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.sleep_for, 300.0))
    until(lambda: (n.workdir / inv / "handle.json").exists(), "the job to start")
    row = cp.store.get(inv)
    assert row is not None and row.worker_id
    n.signal(signal.SIGSTOP)
    try:
        time.sleep(1.0)  # a beat nymph sent just before it stopped is answered (without the cancel)
        call(cp.url, cp.producer_token, f"/v1/producer/invocations/{inv}/cancel", {})
        beat = {"worker_id": row.worker_id, "running": [], "free_slots": 0}
        taken = call(cp.url, cp.daemon_token, "/v1/daemon/heartbeat", beat)
        assert [(c["kind"], c["body"]["invocation_id"]) for c in taken["commands"]] == [("cancel", inv)]
    finally:
        n.signal(signal.SIGCONT)
    out = await_result(cp.url, cp.producer_token, inv)
    assert (out["state"], out["error"]["type"]) == ("killed", "Cancelled"), out


def test_timeout_stops_the_job_and_acks_timeout(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.sleep_for, 120), timeout_s=1)
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "timeout"
    assert out["error"]["type"] == "Timeout"


def test_sigterm_lets_work_finish_within_grace_then_preempts_with_the_exact_message(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--grace-s", "1", "--concurrency", "2")
    stuck = submit(cp.url, cp.producer_token, envelope(nymph_fns.wait_for_file, "never"), max_attempts=1)
    until(lambda: (n.workdir / stuck / "handle.json").exists(), "the job to start")
    n.signal(signal.SIGTERM)
    assert n.wait() == 0
    out = preempted_back_in_queue(cp.url, cp.producer_token, stuck)  # runs again elsewhere, attempt 2
    # (a long poll in flight as nymph stopped may claim it once more: handed back before it started)
    assert out["max_attempts"] == 1 and out["preemptions"] == 1  # no attempt spent
    assert out["preemptions"] + out["handbacks"] == out["attempt"]
    assert {k: v for k, v in out["error"].items() if k != "started"} == {
        "type": "Preempted",
        "message": "daemon shutdown grace expired",
        "reason": "nymph stopped (SIGTERM, grace 1s)",
    }


def test_bad_token_stops_nymph_with_a_clear_message(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    n = nymph_factory(sqlite_control_plane.url, "lsk_not-a-real-token")
    assert n.wait() == 77
    assert "rejected nymph's token" in n.output()


# --- outages and restarts --------------------------------------------------------------------------


def test_control_plane_outage_mid_run_costs_latency_not_results(
    server: Server, nymph_factory: Callable[..., Nymph]
) -> None:
    tokens = server.tokens()
    n = nymph_factory(server.url, tokens["daemon"])
    inv = submit(server.url, tokens["admin"], envelope(nymph_fns.slow_count, 3, 0.0, "release"))
    until(lambda: (n.workdir / inv / "handle.json").exists(), "the job to start")
    server.stop()
    (n.workdir / inv / "release").touch()
    # the job finishes while the control plane is away: its frames and ack wait in the outbox
    until(lambda: not (n.workdir / inv).exists(), "the job to finish")
    assert list((n.state_dir / "outbox").glob("*.msg")), "nothing waits in the outbox"
    server.start()
    out = await_result(server.url, tokens["admin"], inv)
    assert out["state"] == "succeeded", n.output()[-3000:]
    frames = frames_of(server.url, tokens["admin"], inv)
    assert [f.seq for f in frames] == [0, 1, 2, 3] and frames[-1].kind == wire.FRAME_END
    until(lambda: not list((n.state_dir / "outbox").glob("*.msg")), "the outbox to drain")


def test_nymph_killed_mid_run_reattaches_after_restart(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    first = nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.slow_count, 3, 0.0, "release"))
    handle_file = first.workdir / inv / "handle.json"
    until(handle_file.exists, "the job to start")
    pid = int(json.loads(handle_file.read_text())["data"]["pid"])
    until(lambda: len(frames_of(cp.url, cp.producer_token, inv, 0.5)) >= 2, "frames before the kill")
    first.signal(signal.SIGKILL)
    first.wait()
    assert alive(pid), "the task must survive nymph's death"
    second = nymph_factory(cp.url, cp.daemon_token)
    until(lambda: "re-attached" in second.output(), "the new nymph to re-attach")
    (second.workdir / inv / "release").touch()
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", second.output()[-3000:]
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert [f.seq for f in frames] == [0, 1, 2, 3] and frames[-1].kind == wire.FRAME_END
    until(lambda: not alive(pid), "the task process to be gone")


# --- version pinning, doctor, runners --------------------------------------------------------------


def test_pinned_version_drains_running_work_then_exits_75(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--namespace", "team", "--concurrency", "2")
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.wait_for_file, "release"))
    until(lambda: (n.workdir / inv / "handle.json").exists(), "the job to start")
    status, _ = cp.json("PUT", "/v1/namespaces/team/pin", {"nymph_version": "9.9.9"}, cp.admin_token)
    assert status == 200
    until(lambda: "pins nymph 9.9.9" in n.output(), "nymph to see the pin")
    until(lambda: "poll loop stopped" in n.output(), "the poll in flight to return")
    later = submit(cp.url, cp.producer_token, envelope(nymph_fns.add, 1, 1))
    (n.workdir / inv / "release").touch()
    assert n.wait() == 75
    assert await_result(cp.url, cp.producer_token, inv)["state"] == "succeeded"  # drained, not killed
    assert state_of(cp.url, cp.producer_token, later) == "queued"  # no claim after the pin


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*NYMPH, "doctor", *ROOT_TASKS, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=120)


def test_doctor_passes_on_a_good_setup_and_names_what_to_fix(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    dirs = ["--workdir", str(tmp_path / "w"), "--state-dir", str(tmp_path / "s")]
    good = _doctor("--server", cp.url, "--token", cp.daemon_token, *dirs)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "all checks passed" in good.stdout

    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    bad = _doctor(
        "--server", cp.url, "--token", "lsk_wrong", "--runner", "nosuch",
        "--workdir", str(open_dir), "--state-dir", str(tmp_path / "s"),
    )  # fmt: skip
    assert bad.returncode == 1
    assert "[FAIL] token" in bad.stdout and "lakeshore token create --kind daemon" in bad.stdout
    assert "[FAIL] runner" in bad.stdout and "nosuch" in bad.stdout
    # a listable workdir is a warning (0711 is right: task users must still enter it), never a
    # failure whose fix (o-rwx) would break shipped code
    assert "[warn] workdir" in bad.stdout and "chmod 711" in bad.stdout
    status, listed = cp.json("GET", "/v1/ops/workers", None, cp.admin_token)
    assert status == 200 and listed["workers"] == []  # the doctor registered no (phantom) worker

    down = _doctor("--server", f"http://127.0.0.1:{free_port()}", "--token", "t", *dirs)
    assert down.returncode == 1 and "[FAIL] server" in down.stdout


def _worker_row(cp: ControlPlane, worker_id: str) -> dict[str, Any]:
    status, listed = cp.json("GET", "/v1/ops/workers", None, cp.admin_token)
    assert status == 200, listed
    return next(w for w in listed["workers"] if w["worker_id"] == worker_id)


def test_a_cleanly_stopped_nymph_deregisters_at_once(
    control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    until(lambda: "registered as worker" in n.output(), "nymph to register")
    worker = (n.state_dir / "worker_id").read_text().strip()
    assert _worker_row(cp, worker)["live"] is True

    # another daemon token cannot take it off the list (the id is bound to nymph's token)
    other = cp.store.create_token("daemon", "intruder")
    status, out = cp.call("/v1/daemon/deregister", {"worker_id": worker}, other)
    assert status == 403 and "another daemon token" in out["error"]
    assert _worker_row(cp, worker)["live"] is True

    n.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert n.wait() == 0
    row = _worker_row(cp, worker)  # at once, not after the 5-minute live window
    assert row["live"] is False and row["stopped_at"] is not None, row
    status, queues = cp.json("GET", "/v1/ops/queues", None, cp.admin_token)
    assert all(q["workers_live"] == 0 for q in queues["queues"] if q["name"] == "default")

    again = nymph_factory(cp.url, cp.daemon_token)  # the same state dir: the same worker id
    until(lambda: again.output().count("registered as worker") >= 2, "nymph to register again")
    row = _worker_row(cp, worker)
    assert row["live"] is True and row["stopped_at"] is None


def test_runners_lists_the_process_runner_as_usable() -> None:
    out = subprocess.run([*NYMPH, "runners"], capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 0
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("process"))
    assert "dreamlake-lakeshore" in line and "usable" in line and "NOT" not in line


def test_an_idle_nymph_stopping_waits_for_its_poll_without_spinning(
    control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    """Stopping, nymph waits for its in-flight long poll (what it still claims is handed back, not
    left to lapse); idle, it spun a core meanwhile, up to --poll-timeout-s (30 s by default): the
    wait for running jobs returned at once when none ran. Its CPU while it stops is measured."""
    cp = control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    until(lambda: "registered as worker" in n.output(), "nymph to register")
    time.sleep(0.3)  # its long poll (2 s here) is in flight
    proc = psutil.Process(n.proc.pid)  # type: ignore[union-attr]
    before = proc.cpu_times()
    used = 0.0
    n.signal(signal.SIGTERM)
    while n.proc.poll() is None:  # type: ignore[union-attr]
        try:
            now = proc.cpu_times()
        except psutil.NoSuchProcess:
            break
        used = (now.user + now.system) - (before.user + before.system)
        time.sleep(0.05)
    assert n.wait() == 0
    assert used < 0.5, f"nymph used {used:.2f} CPU seconds stopping while idle (a spin)"
