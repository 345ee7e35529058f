"""The slurm runner against a real single-node Slurm (``eval "$(scripts/services/slurm.sh)"``).

The node is this machine, so the tests also look at the processes a job left behind. The first
tests need no cluster: they pin the pure rules of :mod:`nymph_slurm.jobs` (the scontrol record, the
ExitCode mapping, resources as sbatch options) and ``check()`` on a host without Slurm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from nymph import workdir as wd
from nymph.config import NymphConfig
from nymph.job import Job
from nymph.lifecycle import JobContext
from nymph.runner import Handle, RunnerError, RunnerUnavailable, Task
from nymph.slots import Slots
from tests import nymph_fns
from tests import runner_kit as kit
from tests.conftest import ROOT, require
from tests.host_users import ensure_user
from tests.runner_kit import TaskFactory

if str(ROOT / "runners") not in sys.path:  # until the editable install exposes runners/
    sys.path.insert(0, str(ROOT / "runners"))

from nymph_slurm import SCRIPT_FILE, SlurmRunner
from nymph_slurm.jobs import exit_status, parse_record, resource_args

LIMIT_S = 60.0
AS_USER = "nymphtest"


# --- no cluster needed ---------------------------------------------------------------------------


def test_parse_record_keeps_values_with_spaces() -> None:
    line = (
        "JobId=42 JobName=nymph-X UserId=alice(1000) JobState=FAILED Reason=NonZeroExitCode "
        "Dependency=(null) ExitCode=3:0 Comment=nymph:X with spaces WorkDir=/tmp/a b Command=/x"
    )
    record = parse_record(line)
    assert (record.job_id, record.name, record.state, record.exit_code, record.signal) == (
        "42",
        "nymph-X",
        "FAILED",
        3,
        0,
    )
    assert record.fields["Comment"] == "nymph:X with spaces" and record.fields["WorkDir"] == "/tmp/a b"
    assert not record.active
    with pytest.raises(RunnerError):
        parse_record("garbage")


@pytest.mark.parametrize(
    ("state", "code", "reason_in", "want_code", "want_reason"),
    [
        ("COMPLETED", "0:0", "None", 0, None),
        ("FAILED", "3:0", "NonZeroExitCode", 3, None),
        ("FAILED", "0:9", "JobLaunchFailure", -9, "signal 9"),
        ("CANCELLED", "0:0", "None", -15, "cancelled (scancel)"),
        ("CANCELLED", "0:9", "None", -9, "cancelled (scancel)"),
        (
            "TIMEOUT",
            "0:15",
            "TimeLimit",
            -15,
            "Slurm time limit reached (signal 15); Slurm reason: TimeLimit",
        ),
        ("OUT_OF_MEMORY", "0:125", "OutOfMemory", -125, "OOMKilled; Slurm reason: OutOfMemory"),
        ("NODE_FAIL", "0:0", "None", -1, "NodeFail"),
    ],
)
def test_exit_status_maps_state_and_exit_code(
    state: str, code: str, reason_in: str, want_code: int, want_reason: str | None
) -> None:
    record = parse_record(f"JobId=1 JobName=n JobState={state} Reason={reason_in} ExitCode={code}")
    status = exit_status(record)
    assert (status.exit_code, status.reason) == (want_code, want_reason)


def test_launch_failure_0_53_says_what_to_fix() -> None:
    status = exit_status(
        parse_record("JobId=1 JobName=n JobState=FAILED Reason=JobLaunchFailure ExitCode=0:53")
    )
    assert status.exit_code == -53 and status.reason is not None and "failed to launch" in status.reason


def test_resources_become_sbatch_options() -> None:
    assert resource_args({"cpus": 1.5, "memory": "256m"}, 0) == ["--cpus-per-task=2", "--mem=256M"]
    assert resource_args({"memory": 3 * 1024**3}, 0) == ["--mem=3072M"]
    assert resource_args(None, 2) == ["--gres=gpu:2"]  # the GPUs nymph assigned
    assert resource_args({"gpus": 1}, 0) == ["--gres=gpu:1"]
    for bad in ({"pids": 10}, {"cpus": 0}, {"memory": "lots"}, {"gpus": -1}, {"gpus": True}):
        with pytest.raises(RunnerError):
            resource_args(bad, 0)


def test_check_without_slurm_tools_is_unavailable_and_says_what_to_do() -> None:
    with pytest.raises(RunnerUnavailable, match="not found"):
        SlurmRunner(sbatch="/nonexistent/sbatch").check()
    with pytest.raises(RunnerUnavailable, match="not found"):
        SlurmRunner(scontrol="/nonexistent/scontrol").check()


# --- a real cluster ------------------------------------------------------------------------------


def _slurm_problem() -> str | None:
    try:
        SlurmRunner().check()
    except RunnerUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def slurm_ok() -> None:
    problem = _slurm_problem()
    require(problem is None, f'needs Slurm (eval "$(scripts/services/slurm.sh)"): {problem}')


@pytest.fixture
def runner(slurm_ok: None) -> SlurmRunner:
    return SlurmRunner(poll_interval_s=0.1)


@pytest.fixture
def tasks(slurm_ok: None) -> Iterator[TaskFactory]:
    """Prepares workdirs the way nymph does (as_user's own); destroys every started job at teardown."""
    # reachable by another user (as_user): the root is 0711, each workdir 0700 and its user's own
    root = Path(tempfile.mkdtemp(prefix="nymph-slurm-"))
    os.chmod(root, 0o711)
    made = TaskFactory(
        root, env_extra={"LAKESHORE_RUNTIME_POLICY": "minor", "PYTHONPATH": str(ROOT)}, own_as_user=True
    )
    try:
        yield made
    finally:
        made.destroy_all()
        shutil.rmtree(root, ignore_errors=True)


def _scontrol(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout


def _jobs_in(workdir: Path) -> list[tuple[str, str]]:
    """``(job id, state)`` of every job Slurm knows in ``workdir``, whatever its name."""
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-o", "%i|%T|%Z"], capture_output=True, text=True, check=True
    ).stdout
    rows = [line.strip().split("|", 2) for line in out.splitlines() if line.strip()]
    return sorted(
        ((r[0], r[1]) for r in rows if len(r) == 3 and r[2] == str(workdir)), key=lambda r: int(r[0])
    )


@pytest.fixture
def cancel_leftovers() -> Iterator[list[Path]]:
    """Workdirs whose jobs are cancelled at teardown: one a handle never named (a double submission)."""
    workdirs: list[Path] = []
    yield workdirs
    for workdir in workdirs:
        for job_id, _ in _jobs_in(workdir):
            subprocess.run(["scancel", "--full", job_id], capture_output=True)


def _losing(tmp_path: Path, tool: str, says: str) -> tuple[Path, Path]:
    """A wrapper of the Slurm ``tool`` that runs it for real, and the flag that, while it exists,
    turns its answer into the unreachable controller's message once (the answer is "lost")."""
    lose, wrapper = tmp_path / f"lose-{tool}", tmp_path / tool
    wrapper.write_text(
        "#!/bin/sh\n"
        f'out=$({tool} "$@") || exit $?\n'
        f'if [ -e {lose} ]; then rm -f {lose}; echo "{tool}: error: {says}" >&2; exit 1; fi\n'
        'echo "$out"\n'
    )
    wrapper.chmod(0o755)
    return lose, wrapper


def _running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_plain_result_and_the_job_is_labelled(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(nymph_fns.add, 2, 3)
    handle = tasks.start(runner, task)
    assert handle.runner == "slurm" and handle.data["job_id"].isdigit()
    assert Handle.load(task.workdir) == handle
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == 5
    record = _scontrol(handle.data["job_id"])
    # the attempt is in the job's identity (a start tried again finds this attempt's job, only it)
    assert f"JobName=nymph-{task.invocation_id.lower()}-a1 " in record
    assert f"Comment=nymph:{task.invocation_id}:a1 " in record
    assert f"WorkDir={task.workdir} " in record
    assert (task.workdir / SCRIPT_FILE).exists()
    assert runner.inspect(handle) == "exited"
    runner.destroy(handle)


def test_env_reaches_the_task(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(nymph_fns.env_value, "LAKESHORE_INVOCATION_ID")
    handle = tasks.start(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == task.invocation_id


def test_generator_frames_appear_while_running(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(nymph_fns.slow_count, 3, 0.0, "release")
    handle = tasks.start(runner, task)
    kit.until(lambda: len(kit.frames(task.workdir)) >= 2, "two frames in the journal")
    assert runner.inspect(handle) == "running"  # the body waits for the release: frames came first
    assert runner.wait(handle, 0.1) is None
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    frames = kit.frames(task.workdir)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE] * 3 + [wire.FRAME_END]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 2]  # type: ignore[arg-type]


def test_failure_leaves_error_json(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(nymph_fns.boom, "no luck")
    handle = tasks.start(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 1, status
    err = json.loads((task.workdir / "error.json").read_text())
    assert err["type"] == "ValueError" and err["message"] == "no luck" and "boom" in err["traceback"]
    assert status.logs is not None and "ValueError" in status.logs  # the entry's stderr tail


def test_script_runs_bash_with_logs_and_exit_code(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(None, script="echo to-out; echo to-err >&2; exit 3")
    handle = tasks.start(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 3 and status.reason is None, status
    assert (task.workdir / "stdout.log").read_text() == "to-out\n"
    assert (task.workdir / "stderr.log").read_text() == "to-err\n"


def test_a_signal_is_a_negative_exit_code(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(None, script="kill -9 $$")
    handle = tasks.start(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and (status.exit_code, status.reason) == (-9, "signal 9"), status


def test_stop_ladder_kills_a_sigterm_ignoring_tree(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(nymph_fns.stubborn_tree, 2)
    handle = tasks.start(runner, task)
    kit.until(lambda: (task.workdir / "pids.txt").exists(), "the tree to start")
    pids = [int(p) for p in (task.workdir / "pids.txt").read_text().split()]
    assert runner.wait(handle, 0.2) is None  # still running: wait gives up, nothing is killed
    assert runner.inspect(handle) == "running"
    runner.stop(handle, 0.3)
    assert runner.inspect(handle) == "exited"  # stop returns once Slurm has ended the job
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code < 0 and status.reason is not None, status
    assert "cancelled" in status.reason
    assert _running(pids) == [], "processes of the job outlived stop()"
    runner.destroy(handle)
    runner.destroy(handle)  # idempotent


def test_timeout_via_stop_ends_a_cooperative_task_with_sigterm(
    runner: SlurmRunner, tasks: TaskFactory
) -> None:
    task = tasks.task(nymph_fns.sleep_for, 60)
    handle = tasks.start(runner, task)
    assert runner.wait(handle, 0.5) is None  # nymph's timeout fired: the ladder, not Slurm's --time
    runner.stop(handle, 10.0)  # SIGTERM ends it long before the grace
    status = runner.wait(handle, LIMIT_S)
    # Not -9: SIGTERM ended it inside the grace. The entry turns it into dls.Interrupted in the
    # function (issue 30), which ends the task with exit 1 and error.json saying so; one that lands
    # before the entry's handler is up ends it by signal 15 (or, while the step is still starting,
    # Slurm books it CANCELLED): each says SIGTERM did it.
    assert status is not None and status.reason != "signal 9", status
    if status.exit_code == 1:
        assert json.loads((task.workdir / "error.json").read_text())["type"] == "Interrupted", status
    else:
        assert status.exit_code == -15 and status.reason in ("signal 15", "cancelled (scancel)"), status


def test_stop_of_a_pending_job_cancels_it(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(nymph_fns.add, 1)
    handle = tasks.start(runner, task)
    hold = subprocess.run(["scontrol", "hold", handle.data["job_id"]], capture_output=True, text=True)
    if hold.returncode != 0:  # it started already: nothing pending to test on this run
        pytest.skip(f"job started before it could be held: {hold.stderr.strip()}")
    # a hold that lands while the scheduler is launching the job succeeds, and the job runs anyway
    # (seen once under a full parallel run): only a job still pending after it is one to test
    record = runner._record(handle)
    if record is None or record.state != "PENDING":
        pytest.skip(f"job left PENDING before its hold took: {record.state if record else 'gone'}")
    assert runner.inspect(handle) == "running"  # pending counts as running: it will run
    runner.stop(handle, 1.0)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == -15 and status.reason == "cancelled (scancel)"
    assert not (task.workdir / "result.msgpack").exists()


def test_recover_after_restart_reattaches_to_the_same_job(tasks: TaskFactory, slurm_ok: None) -> None:
    first = SlurmRunner(poll_interval_s=0.1)
    task = tasks.task(nymph_fns.wait_for_file, "release")
    tasks.start(first, task)
    del first  # "nymph restarted": a new runner instance, only the persisted handle survives
    second = SlurmRunner(poll_interval_s=0.1)
    handle = Handle.load(task.workdir)
    assert handle is not None
    assert second.recover(handle) is True
    assert second.inspect(handle) == "running"
    assert second.wait(handle, 0.1) is None
    (task.workdir / "release").touch()
    status = second.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == "released"
    third = SlurmRunner()  # a restart after the job finished: Slurm still knows its exit code
    assert third.recover(handle) is True and third.inspect(handle) == "exited"
    second.destroy(handle)
    assert second.recover(handle) is False  # destroyed: nothing to re-attach to


def test_a_job_slurm_no_longer_knows_is_gone_and_its_outcome_comes_from_the_workdir(
    runner: SlurmRunner, tasks: TaskFactory
) -> None:
    task = tasks.task(nymph_fns.add, 2, 3)
    done = tasks.start(runner, task)
    assert runner.wait(done, LIMIT_S) is not None
    # aged out of scontrol (MinJobAge): an id Slurm never handed out
    aged = Handle("slurm", task.invocation_id, 1, {**done.data, "job_id": "987654321"})
    assert runner.inspect(aged) == "gone" and runner.recover(aged) is False
    status = runner.wait(aged, 1.0)
    assert status is not None and status.exit_code == 0
    # a recycled id (fresh StateSaveLocation): the job name does not match, so it is not ours
    recycled = Handle("slurm", task.invocation_id, 1, {**done.data, "job_name": "nymph-someone-else"})
    assert runner.inspect(recycled) == "gone"
    (task.workdir / "result.msgpack").unlink()
    status = runner.wait(recycled, 1.0)
    assert status is not None and status.exit_code == -1 and "no longer known" in (status.reason or "")


def test_missing_workdir_is_refused_before_anything_is_submitted(
    runner: SlurmRunner, tasks: TaskFactory
) -> None:
    task = tasks.task(nymph_fns.add, 1)
    shutil.rmtree(task.workdir)
    with pytest.raises(RunnerError, match="does not exist"):
        runner.start(task)
    assert _jobs_in(task.workdir) == []


def test_start_tried_again_after_a_lost_sbatch_answer_adopts_the_job(
    tasks: TaskFactory, slurm_ok: None, tmp_path: Path
) -> None:
    lose, wrapper = _losing(tmp_path, "sbatch", "Socket timed out on send/recv operation")
    runner = SlurmRunner(sbatch=str(wrapper), poll_interval_s=0.1)
    task = tasks.task(nymph_fns.add, 2, 3)
    lose.touch()
    with pytest.raises(RunnerUnavailable, match="cannot be reached"):
        runner.start(task)  # submitted, but nymph never heard the job id
    handle = tasks.start(runner, task)  # what the job does after RunnerUnavailable: start again
    assert [j for j, _ in _jobs_in(task.workdir)] == [handle.data["job_id"]]  # adopted: one job, not two
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == 5


def test_a_later_attempt_never_adopts_an_earlier_attempts_job_and_cancels_it(
    tasks: TaskFactory, slurm_ok: None, cancel_leftovers: list[Path]
) -> None:
    """Attempt 2 in the workdir of an attempt 1 whose job is still there (its nymph restarted and
    the control plane ran the invocation again): a job of its own, and attempt 1's cancelled, not
    left to run the invocation a second time in the same workdir."""
    first = tasks.task(nymph_fns.wait_for_file, "release")
    cancel_leftovers.append(first.workdir)
    old = SlurmRunner(poll_interval_s=0.1).start(first)
    second = dataclasses.replace(first, attempt=2)
    runner = SlurmRunner(poll_interval_s=0.1)  # a restarted nymph's
    handle = tasks.start(runner, second)
    assert handle.data["job_id"] != old.data["job_id"]
    assert dict(_jobs_in(first.workdir))[old.data["job_id"]] == "CANCELLED"
    assert handle.data["job_name"] == f"nymph-{first.invocation_id.lower()}-a2"
    (first.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((first.workdir / "result.msgpack").read_bytes()) == "released"


def test_a_withdrawn_start_cancels_the_job_its_lost_answer_submitted(
    tasks: TaskFactory, slurm_ok: None, tmp_path: Path, cancel_leftovers: list[Path]
) -> None:
    """A cancel while the start was tried again: nymph withdraws the start (before, the job Slurm
    had accepted ran on with nobody supervising it). While the controller does not answer, the
    runner remembers it and withdraws it at the next check()."""
    lose, sbatch = _losing(tmp_path, "sbatch", "Socket timed out on send/recv operation")
    down, squeue = _losing(tmp_path, "squeue", "Unable to contact slurm controller (connect failure)")
    runner = SlurmRunner(sbatch=str(sbatch), squeue=str(squeue), poll_interval_s=0.1)
    task = tasks.task(nymph_fns.wait_for_file, "release")
    cancel_leftovers.append(task.workdir)
    lose.touch()
    with pytest.raises(RunnerUnavailable):
        runner.start(task)
    [(job_id, _)] = _jobs_in(task.workdir)
    down.touch()
    with pytest.raises(RunnerUnavailable):
        runner.withdraw(task)  # nymph's job settles "killed"; the runner still owes the cancel
    assert dict(_jobs_in(task.workdir))[job_id] != "CANCELLED"
    runner.check()  # what nymph calls until the runner answers again
    assert _jobs_in(task.workdir) == [(job_id, "CANCELLED")]
    assert not (task.workdir / "result.msgpack").exists()


@pytest.mark.parametrize("controller_down", [False, True], ids=["answering", "down"])
def test_a_restarted_nymph_withdraws_the_job_of_an_attempt_whose_sbatch_answer_was_lost(
    slurm_ok: None, tmp_path: Path, cancel_leftovers: list[Path], controller_down: bool
) -> None:
    """nymph died while the start was tried again (no handle saved), and the lost sbatch had
    submitted the job (held here: it has not begun, so nothing runs in the workdir). The restarted
    nymph never starts that attempt again: it releases it (the control plane runs it again) and
    removes the workdir; before, the job ran on beside the next attempt. It is cancelled now, or, while the controller does not
    answer, at the next check(), found by its identity alone (the workdir is gone by then)."""
    root = tmp_path / "w"
    root.mkdir()
    inv = new_ulid()
    meta = {"invocation_id": inv, "attempt": 1, "script": "true", "started_at": time.time()}
    path = wd.create(root, inv, b"", meta, None)
    cancel_leftovers.append(path)
    lose, sbatch = _losing(tmp_path, "sbatch", "Socket timed out on send/recv operation")
    lose.touch()
    with pytest.raises(RunnerUnavailable):  # the previous life's start: submitted, answer lost
        SlurmRunner(sbatch=str(sbatch), extra_args=["--hold"]).start(Task(inv, 1, path, {}, script="true"))
    [(job_id, state)] = _jobs_in(path)
    assert state == "PENDING"
    down, squeue = _losing(tmp_path, "squeue", "Unable to contact slurm controller (connect failure)")
    if controller_down:
        down.touch()
    restarted = SlurmRunner(squeue=str(squeue), poll_interval_s=0.1)  # a new life, no memory
    cfg = NymphConfig(
        server="http://cp", token="t", workdir=root, state_dir=tmp_path / "s", allow_script=True
    )
    slots = Slots(1)
    slots.take()
    told: list[RunnerUnavailable] = []
    ctx = JobContext(cfg, restarted, None, slots, "W1", on_unavailable=told.append)  # type: ignore[arg-type]
    job = Job.attach(ctx, path, wd.read_meta(path) or {}, None)  # no handle.json
    job.start_thread(lambda: job.resume(False))
    job.join(LIMIT_S)
    assert job.state == "released" and not path.exists()
    if controller_down:
        assert len(told) == 1 and dict(_jobs_in(path))[job_id] == "PENDING"  # owed, not forgotten
        restarted.check()  # what nymph calls until the runner answers again
    assert _jobs_in(path) == [(job_id, "CANCELLED")]


def test_resources_are_visible_in_scontrol(runner: SlurmRunner, tasks: TaskFactory) -> None:
    task = tasks.task(nymph_fns.add, 1, run_config={"resources": {"cpus": 2, "memory": "256m"}})
    handle = tasks.start(runner, task)
    record = _scontrol(handle.data["job_id"])
    assert " NumCPUs=2 " in record and " CPUs/Task=2 " in record, record
    assert "mem=256M" in record, record
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status


def test_gpus_on_a_cluster_without_gres_is_refused_with_slurms_message(
    runner: SlurmRunner, tasks: TaskFactory
) -> None:
    gres = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True).stdout
    if "gpu" in gres:
        pytest.skip("this cluster has GPUs configured")
    task = tasks.task(nymph_fns.add, 1, run_config={"resources": {"gpus": 1}})
    with pytest.raises(RunnerError, match="sbatch failed"):
        runner.start(task)


def _ensure_user(name: str) -> bool:
    return ensure_user(name, "--no-create-home")


def test_script_as_user_runs_as_that_user(runner: SlurmRunner, tasks: TaskFactory) -> None:
    if not _ensure_user(AS_USER):
        pytest.skip(f"needs root (or an existing user {AS_USER}) to submit as another user")
    task = tasks.task(None, script="id -un; echo oops >&2", as_user=AS_USER)
    handle = tasks.start(runner, task)
    assert f"UserId={AS_USER}(" in _scontrol(handle.data["job_id"])
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert (task.workdir / "stdout.log").read_text() == f"{AS_USER}\n"
    assert (task.workdir / "stderr.log").read_text() == "oops\n"
    assert (task.workdir / "stdout.log").stat().st_uid == pwd.getpwnam(AS_USER).pw_uid


@pytest.fixture
def readable_runtime() -> Iterator[tuple[str, str]]:
    """An interpreter and a PYTHONPATH another user can read: the system python3 and the entry bundle.

    nymph's own venv may sit under a 0700 home (/root), out of that user's reach; the entry bundle
    exists for exactly such runtimes (a python3 without the package). Copied with the module of
    the shipped test function into a 0755 directory.
    """
    from dreamlake.lakeshore.daemon.bundle import build_bundle

    python = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin") or ""
    require(bool(python), "needs a system python3 (/usr/bin/python3) another user can run")
    base = Path(tempfile.mkdtemp(prefix="nymph-slurm-runtime-"))
    try:
        os.chmod(base, 0o755)
        bundle = build_bundle(base / "lakeshore-entry.zip")
        (base / "tests").mkdir(mode=0o755)
        for name in ("__init__.py", "nymph_fns.py"):
            shutil.copyfile(ROOT / "tests" / name, base / "tests" / name)
        for path in (bundle, *(base / "tests").iterdir()):
            os.chmod(path, 0o644)
        yield python, f"{bundle}:{base}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_entry_as_user_runs_as_that_user(
    slurm_ok: None, tasks: TaskFactory, readable_runtime: tuple[str, str]
) -> None:
    if not _ensure_user(AS_USER):
        pytest.skip(f"needs root (or an existing user {AS_USER}) to submit as another user")
    python, pythonpath = readable_runtime
    runner = SlurmRunner(poll_interval_s=0.1, python=python)
    task = tasks.task(nymph_fns.whoami, as_user=AS_USER)
    task.env["PYTHONPATH"] = pythonpath  # not the repo (under a 0700 /root): the bundle and the test module
    handle = tasks.start(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == pwd.getpwnam(AS_USER).pw_uid
