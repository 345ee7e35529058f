"""The one supervised job lifecycle (nymph/lifecycle.py), at the seams: its exception guard, the
retry while the runner is unavailable (exec jobs included), and the job's id on every log line."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nymph.execjob import ExecJob
from nymph.job import Job
from nymph.lifecycle import Phase
from nymph.observability import configure_logging, log_context
from nymph.runner import Capabilities, RunnerUnavailable
from tests.unit.dispatch_kit import FakeRunner
from tests.unit.lifecycle_kit import (
    ID,
    ID2,
    _agent,
    _ctx,
    _FlakyRunner,
    _Outbox,
    _run_in_thread,
    _WithdrawingRunner,
    no_backoff,
    thread_crashes,
)

__all__ = ["no_backoff", "thread_crashes"]  # the fixtures, from the kit


# --- the one exception guard ---------------------------------------------------------------------


def test_an_unexpected_exception_in_prepare_is_acked_failed_with_its_type_and_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread_crashes: list[BaseException]
) -> None:
    def broken_gates(self: Job) -> None:
        raise KeyError("no such gate")

    monkeypatch.setattr(Job, "_gates", broken_gates)
    runner, outbox, done = FakeRunner(), _Outbox(), []
    ctx = _ctx(tmp_path, runner, outbox, on_done=done.append)
    job = Job(ctx, ID, 1, {"script": "true"})
    _run_in_thread(job)
    assert thread_crashes == []
    [ack] = outbox.acks
    assert ack["state"] == "failed" and ack["error"]["type"] == "DaemonError"
    assert ack["error"]["message"] == "nymph failed: KeyError: 'no such gate'"
    assert runner.started == [] and done == [job] and ctx.slots.free() == 2
    assert job.phase is Phase.SETTLED


def test_a_full_disk_in_prepare_is_acked_failed_saying_so_and_pauses_claims(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    thread_crashes: list[BaseException],
    caplog: pytest.LogCaptureFixture,
) -> None:
    import errno

    import nymph.workdir

    def full(directory: Path, files: Any) -> None:  # the first file fits, the next one does not
        (name, _data, _mode), (second, *_) = list(files)[:2]
        (directory / name).write_bytes(b"")
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / second))

    monkeypatch.setattr(nymph.workdir.safeio, "create_new", full)
    agent, outbox = _agent(tmp_path, FakeRunner())
    caplog.set_level(logging.ERROR, logger="nymph")
    agent.jobs.dispatch({"kind": "run", "body": {"invocation_id": ID, "attempt": 1, "script": "true"}})
    assert agent.jobs.wait_idle(60)
    assert thread_crashes == []
    [ack] = outbox.acks
    assert ack["state"] == "failed" and ack["error"]["type"] == "DaemonError"
    assert "OSError: [Errno 28] No space left on device" in ack["error"]["message"]
    assert not (tmp_path / "w" / ID).exists()  # no half-made workdir left behind
    assert not agent.disk.ok.is_set() and "No space left on device" in (agent.disk.problem or "")
    assert not any(r.exc_info for r in caplog.records)  # an outcome, one line, not a traceback
    assert agent.slots.free() == 1 and not agent.jobs.busy()


def test_an_unexpected_exception_in_start_frees_the_job_and_the_agent_keeps_working(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    agent, outbox = _agent(tmp_path, _FlakyRunner(ValueError("engine said something odd")))
    agent.jobs.dispatch({"kind": "run", "body": {"invocation_id": ID, "attempt": 1, "script": "true"}})
    assert agent.jobs.wait_idle(60)
    agent.jobs.dispatch({"kind": "run", "body": {"invocation_id": ID2, "attempt": 1, "script": "true"}})
    assert agent.jobs.wait_idle(60)
    assert thread_crashes == []
    first, second = outbox.acks
    assert (first["invocation_id"], first["state"], first["error"]["type"]) == (ID, "failed", "DaemonError")
    assert first["error"]["message"] == "nymph failed: ValueError: engine said something odd"
    assert (second["invocation_id"], second["state"]) == (ID2, "succeeded")
    assert agent.slots.free() == 1 and not agent.jobs.busy()


def test_a_cancel_that_comes_before_its_run_command_stops_the_run_before_it_starts(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    # the heartbeat's answer can carry the cancel of an invocation the poll thread was just handed
    # and has not yet entered: it is remembered, and the run starts stopped (it used to run to its end)
    runner = FakeRunner()
    agent, outbox = _agent(tmp_path, runner)
    agent.jobs.dispatch({"kind": "cancel", "body": {"invocation_id": ID, "reason": "cancelled by producer"}})
    agent.jobs.dispatch({"kind": "run", "body": {"invocation_id": ID, "attempt": 1, "script": "true"}})
    agent.jobs.dispatch({"kind": "run", "body": {"invocation_id": ID2, "attempt": 1, "script": "true"}})
    assert agent.jobs.wait_idle(60)
    assert thread_crashes == []
    acks = {a["invocation_id"]: a for a in outbox.acks}
    assert (acks[ID]["state"], acks[ID]["error"]["type"]) == ("killed", "Cancelled"), acks[ID]
    assert acks[ID2]["state"] == "succeeded"  # only the invocation it names
    assert [t.invocation_id for t in runner.started] == [ID2]


def test_a_failure_while_reporting_is_logged_not_reported_twice_nor_raised(
    tmp_path: Path, thread_crashes: list[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    class _BrokenOutbox(_Outbox):
        def ack(self, body: dict[str, Any]) -> None:
            super().ack(body)
            raise OSError(28, "No space left on device")

    outbox, done = _BrokenOutbox(), []
    ctx = _ctx(tmp_path, FakeRunner(), outbox, on_done=done.append)
    job = Job(ctx, ID, 1, {"script": "true"})
    _run_in_thread(job)
    assert thread_crashes == [] and done == [job] and ctx.slots.free() == 2
    assert [a["state"] for a in outbox.acks] == ["succeeded"]  # once: no second, "failed" ack
    assert "reporting its outcome failed" in caplog.text


def test_an_exec_job_that_crashes_publishes_exit_minus_one_with_the_exception(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    outbox = _Outbox()
    job = ExecJob(
        _ctx(tmp_path, _FlakyRunner(ValueError("odd")), outbox),
        {"exec_id": ID, "namespace": "ns", "command": "true", "attempt": 1},
    )
    _run_in_thread(job)
    assert thread_crashes == []
    [(_, body)] = outbox.results
    assert body["exit_code"] == -1 and body["stderr"] == "nymph failed: ValueError: odd"
    assert not (tmp_path / "w" / "exec" / ID).exists()


# --- an unavailable runner: retried, the agent told, the job kept claimed ------------------------------


def test_an_exec_job_tells_the_agent_when_the_runner_is_unavailable(tmp_path: Path) -> None:
    """Before, an exec job polled with sleep and never said so: the agent kept claiming."""
    told: list[RunnerUnavailable] = []
    outbox, runner = _Outbox(), _FlakyRunner(RunnerUnavailable("engine down"))

    def on_unavailable(exc: RunnerUnavailable) -> None:
        told.append(exc)
        job.cancel("shutting down", 0.0)  # the stop wakes the backoff wait at once

    job = ExecJob(
        _ctx(tmp_path, runner, outbox, on_unavailable=on_unavailable),
        {"exec_id": ID, "namespace": "ns", "command": "true", "attempt": 1},
    )
    _run_in_thread(job)
    assert [str(e) for e in told] == ["engine down"]
    assert runner.started == []
    [(_, body)] = outbox.results
    assert body["exit_code"] == -1 and "shutting down" in body["stderr"]


def test_the_agent_stops_claiming_while_an_exec_job_meets_an_unavailable_runner(
    tmp_path: Path, no_backoff: None
) -> None:
    runner = _FlakyRunner(RunnerUnavailable("engine down"))
    agent, outbox = _agent(tmp_path, runner)
    assert agent.runner_health.check()  # claiming
    agent.jobs.dispatch({"kind": "exec", "body": {"exec_id": ID, "namespace": "ns", "command": "true"}})
    assert agent.jobs.wait_idle(60)
    # no claims until runner.check() passes again; the job itself was retried and ran
    assert not agent.runner_health.ok.is_set()
    assert agent.health()["runner_problem"] == "RunnerUnavailable: engine down"
    assert [t.invocation_id for t in runner.started] == [ID]
    assert outbox.results[0][1]["exit_code"] == 0
    assert agent.runner_health.check() and agent.runner_health.ok.is_set()


def test_a_timeout_passing_while_the_runner_is_unavailable_settles_timeout_without_a_start(
    tmp_path: Path,
) -> None:
    outbox = _Outbox()
    runner = _FlakyRunner(*[RunnerUnavailable("engine down")] * 1000)
    job = Job(_ctx(tmp_path, runner, outbox), ID, 1, {"script": "true", "timeout_s": 0.01})
    _run_in_thread(job)
    assert runner.started == []
    [ack] = outbox.acks
    assert ack["state"] == "timeout" and ack["error"]["type"] == "Timeout"


@pytest.mark.parametrize("withdraw_raises", [None, RunnerUnavailable("still down")])
def test_a_cancel_while_the_start_is_tried_again_withdraws_what_an_unanswered_start_left(
    tmp_path: Path, withdraw_raises: BaseException | None
) -> None:
    """Before, the job settled and the runner was never told: a Slurm job whose sbatch answer was
    lost ran on, unsupervised. A withdraw the runner cannot do now is its to do later."""
    told: list[RunnerUnavailable] = []
    outbox = _Outbox()
    runner = _WithdrawingRunner(*[RunnerUnavailable("no answer")] * 1000, withdraw_raises=withdraw_raises)

    def on_unavailable(exc: RunnerUnavailable) -> None:
        told.append(exc)
        job.cancel("cancelled by the user", 0.0)

    job = Job(_ctx(tmp_path, runner, outbox, on_unavailable=on_unavailable), ID, 3, {"script": "true"})
    _run_in_thread(job)
    assert runner.started == []
    assert [(t.invocation_id, t.attempt) for t in runner.withdrawn] == [(ID, 3)]
    assert len(told) == (2 if withdraw_raises else 1)  # the agent re-checks the runner until it answers
    [ack] = outbox.acks
    assert ack["state"] == "killed"


def test_a_stopped_start_is_settled_before_it_is_withdrawn(tmp_path: Path) -> None:
    """The runner did not answer just now, so a withdrawal may wait out its timeout (Slurm's
    MessageTimeout, the command's 30 s) before it is deferred: the outcome does not wait for it."""
    outbox = _Outbox()
    acks_seen: list[int] = []
    runner = _WithdrawingRunner(
        *[RunnerUnavailable("no answer")] * 1000, on_withdraw=lambda task: acks_seen.append(len(outbox.acks))
    )
    job = Job(
        _ctx(tmp_path, runner, outbox, on_unavailable=lambda e: job.cancel("x", 0.0)),
        ID,
        1,
        {"script": "true"},
    )
    _run_in_thread(job)
    assert len(runner.withdrawn) == 1
    assert acks_seen == [1]  # the killed ack was in the outbox before withdraw was called
    assert outbox.acks[0]["state"] == "killed"


def test_a_runner_that_cannot_withdraw_is_not_asked(tmp_path: Path) -> None:
    outbox = _Outbox()
    runner = _WithdrawingRunner(*[RunnerUnavailable("no answer")] * 1000)
    runner.capabilities = Capabilities()  # type: ignore[misc]  # read only from the capabilities
    job = Job(
        _ctx(tmp_path, runner, outbox, on_unavailable=lambda e: job.cancel("x", 0.0)),
        ID,
        1,
        {"script": "true"},
    )
    _run_in_thread(job)
    assert runner.withdrawn == [] and outbox.acks[0]["state"] == "killed"


# --- the job's id on every log line --------------------------------------------------------------------


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    configure_logging("json", "DEBUG", stream=out)
    yield out
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def _lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_every_json_line_a_job_logs_carries_its_id(tmp_path: Path, json_log: io.StringIO) -> None:
    outbox = _Outbox()
    _run_in_thread(Job(_ctx(tmp_path, FakeRunner(), outbox), ID, 1, {"script": "true"}))
    _run_in_thread(
        ExecJob(_ctx(tmp_path, FakeRunner(), outbox), {"exec_id": ID2, "namespace": "ns", "command": "true"})
    )
    logging.getLogger("nymph.test").info("about nothing in particular")
    lines = _lines(json_log)
    about_inv = [x for x in lines if ID in x["msg"]]
    about_exec = [x for x in lines if ID2 in x["msg"]]
    assert len(about_inv) >= 2 and len(about_exec) >= 2  # started, settled, ...
    assert all(x.get("invocation_id") == ID for x in about_inv)
    assert all(x.get("exec_id") == ID2 and "invocation_id" not in x for x in about_exec)
    assert "invocation_id" not in lines[-1] and "exec_id" not in lines[-1]


def test_lines_the_agent_logs_about_a_job_from_its_own_threads_carry_the_id(
    tmp_path: Path, json_log: io.StringIO
) -> None:
    agent, _ = _agent(tmp_path, FakeRunner())
    agent.jobs.cancel(ID, "no longer wanted")  # not running here: remembered (a debug line)
    agent.jobs.dispatch({"kind": "run", "body": {"invocation_id": ID, "attempt": "two"}})
    lines = _lines(json_log)
    assert len(lines) == 2 and all(x["invocation_id"] == ID for x in lines)


def test_log_context_nests_and_an_explicit_id_wins(json_log: io.StringIO) -> None:
    log = logging.getLogger("nymph.test")
    with log_context(invocation_id=ID):
        with log_context(exec_id=ID2):
            log.info("both")
        log.info("explicit", extra={"invocation_id": "other"})
    with pytest.raises(ValueError, match="invocation_id, exec_id"), log_context(job="x"):
        pass
    both, explicit = _lines(json_log)
    assert (both["invocation_id"], both["exec_id"]) == (ID, ID2)
    assert explicit["invocation_id"] == "other" and "exec_id" not in explicit


# --- a restart between the claim and the start -----------------------------------------------------


def _claimed_workdir(tmp_path: Path) -> Path:
    import nymph.workdir as wd

    meta = {"invocation_id": ID, "attempt": 2, "started_at": 1.0}
    return wd.create(tmp_path / "w", ID, b"\x90", meta, None)


def test_a_claim_whose_task_never_started_is_left_to_its_lease_not_failed(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    outbox = _Outbox()
    ctx = _ctx(tmp_path, FakeRunner(), outbox)
    path = _claimed_workdir(tmp_path)
    job = Job.attach(ctx, path, {"invocation_id": ID, "attempt": 2}, None)
    job.start_thread(lambda: job.resume(False))
    job.join(60)
    assert thread_crashes == [] and outbox.acks == []  # nothing ran: nothing to report
    assert job.state == "released" and not path.exists()


@pytest.mark.parametrize("withdraw_raises", [None, RunnerUnavailable("still down")])
def test_a_claim_whose_start_was_never_answered_is_withdrawn_before_it_is_released(
    tmp_path: Path, thread_crashes: list[BaseException], withdraw_raises: BaseException | None
) -> None:
    """A previous life's start may have been taken after all, its answer lost (a Slurm job not yet
    running), and no handle saved: before the workdir goes and the attempt is released (the
    control plane runs it again), the runner withdraws it, from what invocation.json records.
    Before, it was never asked, and the job ran on beside the next attempt."""
    told: list[RunnerUnavailable] = []
    outbox = _Outbox()
    seen: list[bool] = []
    runner = _WithdrawingRunner(
        withdraw_raises=withdraw_raises, on_withdraw=lambda task: seen.append(task.workdir.is_dir())
    )
    ctx = _ctx(tmp_path, runner, outbox, on_unavailable=told.append)
    path = _claimed_workdir(tmp_path)
    meta = {"invocation_id": ID, "attempt": 2, "as_user": "alice", "script": "true"}
    job = Job.attach(ctx, path, meta, None)
    job.start_thread(lambda: job.resume(False))
    job.join(60)
    assert thread_crashes == [] and outbox.acks == []
    [task] = runner.withdrawn
    assert (task.invocation_id, task.attempt, task.workdir, task.as_user) == (ID, 2, path, "alice")
    assert seen == [True]  # asked while the workdir was still there
    assert job.state == "released" and not path.exists()
    assert len(told) == (1 if withdraw_raises else 0)  # the agent re-checks the runner until it answers


def test_a_task_running_without_a_saved_handle_that_outlives_its_timeout_is_withdrawn(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    """The restart waits for a task that runs with no handle saved (a Slurm job whose sbatch answer
    was lost, running on a node, its entry lock seen on the shared workdir); should the wait end
    by its timeout (or a stop), the attempt is settled ``DaemonRestart`` and the runner withdraws
    the task. Before, it was never asked: the job ran on while the call ran again."""
    import fcntl
    import os

    import nymph.workdir as wd

    outbox = _Outbox()
    runner = _WithdrawingRunner()
    ctx = _ctx(tmp_path, runner, outbox)
    path = _claimed_workdir(tmp_path)
    fd = os.open(path / wd.ENTRY_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the task's entry runs
        meta = {"invocation_id": ID, "attempt": 2, "script": None, "timeout_s": 1, "started_at": 1.0}
        job = Job.attach(ctx, path, meta, None)
        job.start_thread(lambda: job.resume(False))
        job.join(60)
    finally:
        os.close(fd)
    assert thread_crashes == []
    assert [a["error"]["type"] for a in outbox.acks] == ["DaemonRestart"]
    assert [(t.invocation_id, t.attempt) for t in runner.withdrawn] == [(ID, 2)]


def test_a_task_running_without_a_saved_handle_is_waited_for_and_its_outcome_reported(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    """nymph died between the task's start (its entry took the lock) and the handle's write: the
    restart waits for the task to end and acks what it left, instead of failing a call that ran."""
    import fcntl
    import os

    from dreamlake.lakeshore import wire

    outbox = _Outbox()
    ctx = _ctx(tmp_path, FakeRunner(), outbox)
    path = _claimed_workdir(tmp_path)
    fd = os.open(path / ".entry.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # an entry process runs there, unsupervised

    def finish() -> None:  # the task ends: its result, then the lock goes
        (path / "result.msgpack").write_bytes(wire.pack(42))
        os.close(fd)

    timer = threading.Timer(0.5, finish)
    timer.start()
    job = Job.attach(ctx, path, {"invocation_id": ID, "attempt": 2}, None)
    job.start_thread(lambda: job.resume(False))
    job.join(60)
    timer.join()
    [ack] = outbox.acks
    assert ack["state"] == "succeeded", ack
    assert wire.unpack(ack["result_blob"]) == 42


def test_a_task_running_without_a_saved_handle_and_stopped_is_reported_daemon_restart(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    import fcntl
    import os

    outbox = _Outbox()
    ctx = _ctx(tmp_path, FakeRunner(), outbox)
    path = _claimed_workdir(tmp_path)
    fd = os.open(path / ".entry.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # an entry process runs there, unsupervised, and never ends
    try:
        job = Job.attach(ctx, path, {"invocation_id": ID, "attempt": 2, "timeout_s": 0.5}, None)
        job.body["timeout_s"] = 0.5
        job.started_at = 0.0  # long past its timeout: the wait gives up
        job.start_thread(lambda: job.resume(False))
        job.join(60)
    finally:
        os.close(fd)
    [ack] = outbox.acks
    assert (ack["state"], ack["error"]["type"]) == ("failed", "DaemonRestart")
