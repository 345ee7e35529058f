"""The agent's command handling and the exec job's edges, at the seams (no control plane, no runner)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nymph.config import NymphConfig
from nymph.execjob import ExecJob
from nymph.runner import Capabilities
from nymph.slots import Slots
from tests.unit.dispatch_kit import FakeOutbox, FakeRunner, exec_ctx, make_agent

ID = "01HZZZZZZZZZZZZZZZZZZZZZZZ"


class _Job:
    kind = "invocation"
    id_field = "invocation_id"

    def __init__(self, attempt: int) -> None:
        self.invocation_id = self.job_id = ID
        self.attempt = attempt
        self.lost = False

    def lose(self) -> None:
        self.lost = True


def _exec(tmp_path: Path, runner: FakeRunner, outbox: FakeOutbox, **body: Any) -> ExecJob:
    return ExecJob(
        exec_ctx(tmp_path, runner, outbox), {"exec_id": ID, "namespace": "ns", "command": "true", **body}
    )


def test_lost_names_the_reported_attempt_not_a_newer_one_claimed_since(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    newer = _Job(attempt=2)
    agent.jobs._table[("invocation", ID)] = newer  # type: ignore[assignment]
    agent._on_heartbeat({"lost": [ID]}, [{"invocation_id": ID, "attempt": 1}])
    assert not newer.lost  # attempt 2 started after the beat that reported attempt 1
    agent._on_heartbeat({"lost": [ID]}, [{"invocation_id": ID, "attempt": 2}])
    assert newer.lost


@pytest.mark.parametrize(
    "command",
    [
        "not a map",
        {"kind": "run", "body": {"invocation_id": ID, "attempt": "two"}},
        {"kind": "exec", "body": ["not", "a", "map"]},  # used to leak the slot it took first
        {"kind": "cancel", "body": None},
    ],
)
def test_a_malformed_command_is_logged_not_fatal_and_takes_no_slot(tmp_path: Path, command: Any) -> None:
    agent = make_agent(tmp_path)
    agent.jobs.dispatch(command)
    assert agent.slots.free() == 1
    assert not agent.jobs.busy()


def test_exec_with_a_bad_namespace_or_timeout_never_runs(tmp_path: Path) -> None:
    runner, outbox = FakeRunner(), FakeOutbox()
    _exec(tmp_path, runner, outbox, namespace="../admin").run()
    _exec(tmp_path, runner, outbox, timeout_s="soon").run()
    assert runner.started == []
    assert len(outbox.put_calls) == 1  # the bad timeout is reported; the bad namespace has nowhere to go
    route, body = outbox.put_calls[0]
    assert route == f"/v1/namespaces/ns/jobs/{ID}/result" and "timeout_s" in body["stderr"]


def test_exec_destroys_its_task_even_when_the_wait_fails(tmp_path: Path) -> None:
    runner, outbox = FakeRunner(wait_raises=True), FakeOutbox()
    _exec(tmp_path, runner, outbox).run()
    assert len(runner.destroyed) == 1  # before the fix the container outlived the exec job
    assert outbox.put_calls[0][1]["exit_code"] == -1


class _AckOutbox(FakeOutbox):
    def ack(self, body: dict[str, Any]) -> None:
        self.put("/v1/daemon/ack", body)


def _run_job(tmp_path: Path, body: dict[str, Any], **config: Any) -> tuple[FakeRunner, dict[str, Any]]:
    from nymph.job import Job, JobContext

    config = {"allow_script": True, "allow_root_tasks": True, **config}  # a script task, run as root
    cfg = NymphConfig(
        server="http://cp", token="t", workdir=tmp_path / "w", state_dir=tmp_path / "s", **config
    )
    runner, outbox = FakeRunner(), _AckOutbox()
    slots = Slots(1)
    slots.take()
    ctx = JobContext(cfg, runner, outbox, slots, "worker")  # type: ignore[arg-type]
    Job(ctx, ID, 1, {"script": "true", **body}).run()
    assert slots.free() == 1
    return runner, outbox.put_calls[-1][1]


def test_a_bad_timeout_is_acked_failed_before_anything_runs(tmp_path: Path) -> None:
    # before: float("soon") raised in the poll thread, and the invocation was never acked
    runner, ack = _run_job(tmp_path, {"timeout_s": "soon"})
    assert runner.started == [] and ack["state"] == "failed"
    assert ack["error"]["type"] == "InvalidRunConfig" and "'soon'" in ack["error"]["message"]


@pytest.mark.parametrize("run_config", ["garbage", [1, 2, 3]])
def test_a_run_config_that_is_not_a_map_is_acked_failed_before_anything_runs(
    tmp_path: Path, run_config: Any
) -> None:
    # before: dict(run_config) raised while the job was made, outside the lifecycle that acks: the
    # command was logged and dropped, and the call waited out its lease as running
    runner, ack = _run_job(tmp_path, {"run_config": run_config})
    assert runner.started == [] and ack["state"] == "failed"
    assert (
        ack["error"]["type"] == "InvalidRunConfig" and "run_config must be a map" in ack["error"]["message"]
    )


def test_a_calls_pythonpath_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # a run command from a client that skipped the control plane's check: the container runners
    # mount the task's PYTHONPATH (the operator's), so a call's own would bind any host directory
    runner, ack = _run_job(tmp_path, {"run_config": {"env": {"PYTHONPATH": "/srv/other-tenant"}}})
    assert runner.started == [] and ack["state"] == "failed"
    assert ack["error"]["type"] == "InvalidRunConfig" and "PYTHONPATH" in ack["error"]["message"]


@pytest.mark.parametrize(
    "run_config",
    [
        {"env": {"LD_PRELOAD": "/tmp/x.so"}},
        {"env": {"PYTHONHOME": "/nonexistent"}},  # once: every zygote died and prefork went off
        {"secrets": ["PYTHONUSERBASE"]},
        {"secrets": ["PYTHONPATH"]},
    ],
)
def test_a_calls_loader_or_interpreter_start_up_variable_is_refused_before_anything_runs(
    tmp_path: Path, run_config: dict[str, Any]
) -> None:
    # nymph's own processes start the task with its environment (the process runner's zygote and
    # runuser, as root on a root nymph): a call's LD_PRELOAD ran a library of its choosing there
    runner, ack = _run_job(tmp_path, {"run_config": run_config})
    assert runner.started == [] and ack["state"] == "failed"
    assert ack["error"]["type"] == "InvalidRunConfig", ack
    name = next(iter(run_config.get("env") or run_config.get("secrets") or ()))
    assert name in ack["error"]["message"]


def test_an_allowed_user_that_does_not_exist_is_refused_clearly(tmp_path: Path) -> None:
    FakeRunner.capabilities = Capabilities(as_user=True)
    try:
        runner, ack = _run_job(tmp_path, {"as_user": "no-such-user-x"}, allow_users=("no-such-user-x",))
    finally:
        FakeRunner.capabilities = Capabilities()
    assert runner.started == [] and ack["error"]["type"] == "UserNotAllowed"
    assert "not a user on this host" in ack["error"]["message"]
