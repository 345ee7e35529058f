"""What nymph hands back when it stops or restarts (nymph/job.py, nymph/agent.py), at the seams of
tests/unit/test_nymph_lifecycle.py (with its kit, tests/unit/lifecycle_kit.py): an attempt that
never started is handed back ``preempted`` with ``error.started`` false (it spends nothing at the
control plane: docs/protocol.md), and a task a previous life stopped is acked as that stop after a
restart, not as the ``Interrupted`` it left."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

import pytest

import nymph.workdir as wd
from nymph.job import Job
from nymph.lifecycle import SHUTDOWN_MESSAGE
from nymph.runner import ExitStatus, Handle, RunnerUnavailable
from tests.unit.dispatch_kit import FakeRunner
from tests.unit.lifecycle_kit import (
    ID,
    _agent,
    _ctx,
    _Outbox,
    _run_in_thread,
    _WithdrawingRunner,
    thread_crashes,
)

__all__ = ["thread_crashes"]  # the fixture, from the kit


def _workdir(tmp_path: Path, worker_id: str | None) -> tuple[Path, dict[str, Any]]:
    """The workdir a previous life made for attempt 2 of ID as it claimed it (no task started)."""
    meta: dict[str, Any] = {"invocation_id": ID, "attempt": 2, "started_at": 1.0}
    if worker_id is not None:
        meta["worker_id"] = worker_id
    (tmp_path / "w").mkdir(exist_ok=True)
    return wd.create(tmp_path / "w", ID, b"\x90", meta, None), meta


def test_a_claim_this_worker_never_started_is_handed_back_at_once(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    """nymph died between the claim and the start (restoring a checkpoint, say) and restarted with
    the same worker id: the attempt is handed back ``preempted`` with ``started: false`` at once.
    Before, nothing was acked: the call waited out its lease, which spent one of its attempts
    (``LeaseExpired`` with ``max_attempts=1``, though it never ran)."""
    outbox = _Outbox()
    ctx = _ctx(tmp_path, FakeRunner(), outbox)  # worker "W1"
    path, meta = _workdir(tmp_path, "W1")
    job = Job.attach(ctx, path, meta, None)
    job.start_thread(lambda: job.resume(False))
    job.join(60)
    assert thread_crashes == []
    [ack] = outbox.acks
    assert (ack["invocation_id"], ack["attempt"], ack["worker_id"], ack["state"]) == (
        ID,
        2,
        "W1",
        "preempted",
    )
    assert ack["error"]["type"] == "Preempted" and ack["error"]["started"] is False, ack
    assert job.state == "preempted" and not path.exists()


@pytest.mark.parametrize("case", ["another worker", "no worker recorded", "an entry ran"])
def test_a_claim_that_may_not_be_handed_back_is_still_left_to_its_lease(
    tmp_path: Path, thread_crashes: list[BaseException], case: str
) -> None:
    """Only the lease holder may hand an attempt back, and only one whose task never started."""
    outbox = _Outbox()
    ctx = _ctx(tmp_path, FakeRunner(), outbox)
    path, meta = _workdir(tmp_path, {"another worker": "W2", "no worker recorded": None}.get(case, "W1"))
    if case == "an entry ran":  # its lock is there, free: the task ran and died with nymph
        os.close(os.open(path / wd.ENTRY_LOCK, os.O_RDWR | os.O_CREAT, 0o600))
    job = Job.attach(ctx, path, meta, None)
    job.start_thread(lambda: job.resume(False))
    job.join(60)
    assert thread_crashes == [] and outbox.acks == []
    assert job.state == "released" and not path.exists()


class _ExitedRunner(FakeRunner):
    """Its task is gone (``recover`` False) and exited 1, as an entry that raised Interrupted."""

    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None:
        return ExitStatus(1)


@pytest.mark.parametrize(
    ("stop", "state", "error_type"),
    [
        (("preempted", SHUTDOWN_MESSAGE, "nymph stopped (SIGTERM, grace 1s)"), "preempted", "Preempted"),
        (("timeout", "timed out after 5s (run_config.timeout_s)", ""), "timeout", "Timeout"),
        (("killed", "cancelled by producer", ""), "killed", "Cancelled"),
        (None, "failed", "Interrupted"),  # nymph never stopped it: the task's own failure
    ],
)
def test_a_task_a_previous_life_stopped_is_acked_as_that_stop_with_its_checkpoint(
    tmp_path: Path,
    thread_crashes: list[BaseException],
    monkeypatch: pytest.MonkeyPatch,
    stop: tuple[str, str, str] | None,
    state: str,
    error_type: str,
) -> None:
    """nymph stopped the task (the ladder's SIGTERM: the function raised Interrupted) and was
    killed before the ack reached the outbox (while the checkpoint uploaded, say). The restarted
    nymph acks the stop it recorded, and carries the checkpoint as the live path does. Before, it
    acked ``failed``/``Interrupted``: a preempted call with ``max_attempts=1`` ended failed."""
    import nymph.job

    carried: list[tuple[str, int]] = []
    monkeypatch.setattr(
        nymph.job.checkpoints,
        "save",
        lambda client, workdir, **kw: carried.append((kw["invocation_id"], kw["attempt"])),
    )
    outbox = _Outbox()
    ctx = _ctx(tmp_path, _ExitedRunner(), outbox)
    path, meta = _workdir(tmp_path, "W1")
    error = {"type": "Interrupted", "message": "the call is being stopped", "traceback": ""}
    (path / wd.ERROR).write_text(json.dumps(error))
    if stop is not None:
        wd.mark_stopping(path, *stop)
    handle = Handle("fake", ID, 2, {})
    handle.save(path)
    job = Job.attach(ctx, path, meta, handle)
    job.start_thread(lambda: job.resume(False))
    job.join(60)
    assert thread_crashes == []
    [ack] = outbox.acks
    assert (ack["state"], ack["error"]["type"]) == (state, error_type), ack
    assert "started" not in ack["error"]  # it ran: a preemption, not a hand-back
    if stop is not None:
        assert ack["error"]["message"] == stop[1] and ack["error"].get("reason", "") == stop[2]
    assert carried == [(ID, 2)] * (state != "killed")  # killed: final, nothing to carry


def test_a_stop_recorded_for_a_task_that_succeeded_does_not_hide_its_result(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    from dreamlake.lakeshore import wire

    outbox = _Outbox()
    ctx = _ctx(tmp_path, FakeRunner(), outbox)  # exit 0
    path, meta = _workdir(tmp_path, "W1")
    (path / wd.RESULT).write_bytes(wire.pack(7))
    wd.mark_stopping(path, "preempted", SHUTDOWN_MESSAGE)
    handle = Handle("fake", ID, 2, {})
    handle.save(path)
    job = Job.attach(ctx, path, meta, handle)
    job.start_thread(lambda: job.resume(False))
    job.join(60)
    [ack] = outbox.acks
    assert ack["state"] == "succeeded" and wire.unpack(ack["result_blob"]) == 7


def test_a_stop_record_the_task_wrote_is_not_believed(tmp_path: Path) -> None:
    """``stop.json`` is nymph's own file: one the task's user made (in its workdir) is ignored."""
    path, _ = _workdir(tmp_path, "W1")
    wd.mark_stopping(path, "preempted", SHUTDOWN_MESSAGE)
    assert wd.read_stopping(path) == ("preempted", SHUTDOWN_MESSAGE, "")
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file another user owns")
    os.chown(path / wd.STOP, 65534, 65534)
    assert wd.read_stopping(path) is None


def test_a_job_preempted_before_its_task_started_is_handed_back_with_started_false(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    """nymph stops while a claimed job prepares (before the runner started its task): the
    ``preempted`` ack says ``started: false``, so the control plane counts no preemption."""
    runner = FakeRunner()
    outbox = _Outbox()
    ctx = _ctx(tmp_path, runner, outbox)
    job = Job(ctx, ID, 1, {"script": "true"})
    job.preempt(SHUTDOWN_MESSAGE, 0.0, "nymph stopped (SIGTERM, grace 1s)")
    _run_in_thread(job)
    assert thread_crashes == [] and runner.started == []
    [ack] = outbox.acks
    assert ack["state"] == "preempted" and ack["error"]["started"] is False, ack


def test_a_job_preempted_while_an_unanswered_start_is_tried_again_is_a_preemption(
    tmp_path: Path, thread_crashes: list[BaseException]
) -> None:
    """A start the runner did not answer may have started the task after all (it is withdrawn):
    no ``started: false`` then, the attempt counts as any preemption."""
    runner = _WithdrawingRunner(*[RunnerUnavailable("no answer")] * 1000)
    outbox = _Outbox()
    job = Job(
        _ctx(tmp_path, runner, outbox, on_unavailable=lambda e: job.preempt(SHUTDOWN_MESSAGE, 0.0)),
        ID,
        1,
        {"script": "true"},
    )
    _run_in_thread(job)
    assert thread_crashes == [] and len(runner.withdrawn) == 1
    [ack] = outbox.acks
    assert ack["state"] == "preempted" and "started" not in ack["error"], ack


def test_a_claim_a_poll_in_flight_brings_as_nymph_stops_is_handed_back_with_started_false(
    tmp_path: Path,
) -> None:
    """A poll in flight when SIGTERM came claims a call submitted after it: it is handed back
    ``preempted`` with ``started: false`` (before: a plain preemption, which failed a call with
    ``max_preemptions=0`` that never ran)."""
    agent, outbox = _agent(tmp_path, FakeRunner())
    agent.stopping.request(grace_s=1.0, why="nymph stopped (SIGTERM, grace 1s)")
    agent._dispatch_claimed({"kind": "run", "body": {"invocation_id": ID, "attempt": 3, "script": "true"}})
    [ack] = outbox.acks
    assert (ack["invocation_id"], ack["attempt"], ack["state"]) == (ID, 3, "preempted")
    assert ack["error"] == {
        "type": "Preempted",
        "message": SHUTDOWN_MESSAGE,
        "reason": "nymph stopped (SIGTERM, grace 1s)",
        "started": False,
    }
    assert not (tmp_path / "w" / ID).exists()


def test_the_entry_lock_tells_a_task_that_never_started_from_one_that_did(tmp_path: Path) -> None:
    path, _ = _workdir(tmp_path, "W1")
    assert wd.entry_never_ran(path)
    fd = os.open(path / wd.ENTRY_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert not wd.entry_never_ran(path)
    finally:
        os.close(fd)
    assert not wd.entry_never_ran(path)  # free now: it ran


def test_lakeshore_show_counts_hand_backs_as_attempts_not_spent() -> None:
    from dreamlake.lakeshore.ops_cli import attempt_label

    inv = {"attempt": 3, "max_attempts": 1, "preemptions": 1, "handbacks": 1, "state": "queued"}
    assert attempt_label(inv) == "3/3"
    assert attempt_label(inv, long=True) == "3 of 3 (+1 preempted, +1 handed back, not counted)"
    done = {**inv, "state": "succeeded"}
    assert attempt_label(done, long=True) == "3 of 3, final (+1 preempted, +1 handed back, not counted)"
