"""Start-up reconcile (what a previous life left in the workdir root) and GPU slots."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest

from dreamlake.lakeshore import ids
from nymph import workdir as wd
from nymph.config import resolve
from nymph.gpus import Gpu, GpuPool
from nymph.job import Job, JobContext
from nymph.reconcile import recover_all
from nymph.runner import Capabilities, Handle, RunnerUnavailable
from nymph.slots import Slots


class _Runner:
    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = Capabilities(gpus=True)

    def __init__(self, alive: set[str]) -> None:
        self.alive = alive

    def recover(self, handle: Handle) -> bool:
        return handle.invocation_id in self.alive


class _Outbox:
    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def pending_for(self, invocation_id: str) -> bool:
        return invocation_id in self.pending


def _ctx(tmp_path: Path, alive: set[str], pending: set[str], slots: Slots | None = None) -> JobContext:
    config = resolve({"server": "http://x", "token": "t", "workdir": tmp_path}, {})
    return JobContext(config, _Runner(alive), _Outbox(pending), slots or Slots(2), ids.new_ulid())  # type: ignore[arg-type]


def _leftover(
    tmp_path: Path, *, meta: bool = True, handle: bool = True, gpus: list[str] | None = None
) -> str:
    inv = ids.new_ulid()
    m: dict[str, Any] = {"invocation_id": inv, "attempt": 2, "started_at": 1.0, "gpus": gpus or []}
    path = wd.create(tmp_path, inv, b"", m, None) if meta else tmp_path / inv
    path.mkdir(exist_ok=True)
    if handle:
        Handle("fake", inv, 2, {"pid": 1}).save(path)
    return inv


def test_reconcile_sorts_leftovers(tmp_path: Path) -> None:
    alive = _leftover(tmp_path)
    finished = _leftover(tmp_path)
    never_started = _leftover(tmp_path, handle=False)
    orphan = _leftover(tmp_path, meta=False, handle=False)
    orphan_with_ack = _leftover(tmp_path, meta=False, handle=False)
    settled = _leftover(tmp_path)
    wd.mark_settled(tmp_path / settled, wd.Outcome.failed("ValueError", "kept for inspection"))
    (tmp_path / "not-a-ulid").mkdir()

    found = recover_all(_ctx(tmp_path, {alive}, {orphan_with_ack}))

    by_id = {job.invocation_id: (job, is_alive) for job, is_alive in found}
    assert set(by_id) == {alive, finished, never_started}
    assert by_id[alive][1] is True and by_id[finished][1] is False
    assert by_id[never_started][0].handle is None
    assert all(job.attempt == 2 for job, _ in found)
    assert not (tmp_path / orphan).exists()  # reported and removed
    assert (tmp_path / orphan_with_ack).exists()  # its ack still waits in the outbox
    assert (tmp_path / settled).exists() and (tmp_path / "not-a-ulid").exists()


def test_reattached_task_keeps_its_gpus(tmp_path: Path) -> None:
    slots = Slots(2, GpuPool([Gpu(0, "u0", "H200", 1), Gpu(1, "u1", "H200", 1)]), gpu_total=2)
    inv = _leftover(tmp_path, gpus=["1"])
    [(job, _)] = recover_all(_ctx(tmp_path, {inv}, set(), slots))
    assert isinstance(job, Job) and job._gpus == ["1"]
    assert job._env()["CUDA_VISIBLE_DEVICES"] == "1"
    assert slots.acquire_gpus(1) == ["0"]  # device 1 stays with the re-attached task


def test_a_task_running_without_a_saved_handle_keeps_its_gpus_until_it_ends(tmp_path: Path) -> None:
    """nymph died between the task's start and the handle's write: the entry still holds its lock,
    so the task runs on its recorded devices, and the next life must not offer them to another call
    (it did: a second gpus=1 call ran on the same device)."""
    slots = Slots(2, GpuPool([Gpu(0, "u0", "H200", 1), Gpu(1, "u1", "H200", 1)]), gpu_total=2)
    inv = _leftover(tmp_path, handle=False, gpus=["1"])
    idle = _leftover(tmp_path, handle=False, gpus=["0"])  # never started: nothing holds its lock
    fd = os.open(tmp_path / inv / wd.ENTRY_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the running task's entry
        found = {job.invocation_id: job for job, _ in recover_all(_ctx(tmp_path, set(), set(), slots))}
        assert found[inv].handle is None and found[inv]._gpus == ["1"]
        assert found[idle]._gpus == []
        assert slots.free_gpus() == 1 and slots.acquire_gpus(1) == ["0"]
        slots.release_gpus(["0"])
    finally:
        os.close(fd)  # the task ended (with no outcome: its attempt is released)
    found[inv].resume(False)
    assert found[inv]._gpus == [] and slots.free_gpus() == 2


class _LabellingRunner(_Runner):
    """A runner that labels its tasks (like docker): list_labelled, destroy, and an engine switch."""

    capabilities: ClassVar[Capabilities] = Capabilities(gpus=True, list_labelled=True)

    def __init__(self, alive: set[str], labelled: list[Handle], up: bool = True) -> None:
        super().__init__(alive)
        self.labelled = labelled
        self.destroyed: list[Handle] = []
        self.up = up
        self.listed_for: list[str | None] = []

    def _engine(self) -> None:
        if not self.up:
            raise RunnerUnavailable("engine down")

    def recover(self, handle: Handle) -> bool:
        self._engine()
        return super().recover(handle)

    def list_labelled(self, worker_id: str | None = None) -> list[Handle]:
        self._engine()
        self.listed_for.append(worker_id)
        return list(self.labelled)

    def destroy(self, handle: Handle) -> None:
        self._engine()
        self.destroyed.append(handle)


def _labelled_ctx(tmp_path: Path, runner: _LabellingRunner) -> JobContext:
    config = resolve({"server": "http://x", "token": "t", "workdir": tmp_path}, {})
    return JobContext(config, runner, _Outbox(set()), Slots(2), "W1")  # type: ignore[arg-type]


def test_labelled_tasks_without_an_unsettled_workdir_are_destroyed_others_kept(tmp_path: Path) -> None:
    running = _leftover(tmp_path)
    settled = _leftover(tmp_path)
    wd.mark_settled(tmp_path / settled, wd.Outcome.failed("X", "kept"))
    gone = ids.new_ulid()  # its workdir is gone
    handles = [Handle("fake", i, 2, {"container_id": f"c-{i}"}) for i in (running, settled, gone)]
    for inv in (running, settled):
        Handle("fake", inv, 2, {"container_id": f"c-{inv}"}).save(tmp_path / inv)
    runner = _LabellingRunner({running}, handles)
    found = recover_all(_labelled_ctx(tmp_path, runner))
    assert [(j.invocation_id, alive) for j, alive in found] == [(running, True)]
    assert runner.listed_for == ["W1"]  # only this worker's labelled tasks
    assert sorted(h.invocation_id for h in runner.destroyed) == sorted([settled, gone])


def test_a_workdir_without_a_handle_adopts_its_labelled_task(tmp_path: Path) -> None:
    inv = _leftover(tmp_path, handle=False)  # died between runner.start and saving the handle
    labelled = Handle("fake", inv, 2, {"container_id": "c-1"})
    runner = _LabellingRunner({inv}, [labelled])
    [(job, alive)] = recover_all(_labelled_ctx(tmp_path, runner))
    assert alive is True and job.handle is not None and job.handle.data == {"container_id": "c-1"}
    assert Handle.load(tmp_path / inv) is not None and not runner.destroyed


def test_an_unavailable_runner_defers_instead_of_acking(tmp_path: Path) -> None:
    inv = _leftover(tmp_path)
    runner = _LabellingRunner({inv}, [], up=False)
    with pytest.raises(RunnerUnavailable):  # the agent calls again once check() passes
        recover_all(_labelled_ctx(tmp_path, runner))
    assert (tmp_path / inv / "handle.json").exists() and not wd.is_settled(tmp_path / inv)


def test_recover_raising_unavailable_resumes_with_alive_unknown_then_retries(tmp_path: Path) -> None:
    inv = _leftover(tmp_path)
    runner = _LabellingRunner({inv}, [])
    calls = {"n": 0}
    real = runner.recover

    def flaky(handle: Handle) -> bool:
        calls["n"] += 1
        if calls["n"] <= 2:  # once in reconcile, once in the job (which backs off and asks again)
            raise RunnerUnavailable("engine down")
        return real(handle)

    runner.recover = flaky  # type: ignore[method-assign]
    [(job, alive)] = recover_all(_labelled_ctx(tmp_path, runner))
    assert alive is None  # unknown: not acked on a guess
    assert job._recover_when_available(job.handle) is True  # type: ignore[arg-type]
    assert calls["n"] == 3


# --- optional features are read from Capabilities only --------------------------------------------


class _UndeclaredLabelling(_LabellingRunner):
    """Has list_labelled() but does not declare it: never listed, so nothing is swept or adopted."""

    capabilities: ClassVar[Capabilities] = Capabilities(gpus=True)


def test_a_runner_without_the_list_labelled_capability_is_not_listed(tmp_path: Path) -> None:
    running = _leftover(tmp_path)
    never_started = _leftover(tmp_path, handle=False)
    gone = ids.new_ulid()
    handles = [Handle("fake", i, 2, {"container_id": f"c-{i}"}) for i in (never_started, gone)]
    runner = _UndeclaredLabelling({running}, handles)
    found = recover_all(_labelled_ctx(tmp_path, runner))
    assert runner.listed_for == [] and runner.destroyed == []
    by_id = {job.invocation_id: (job, alive) for job, alive in found}
    assert by_id[running][1] is True
    assert by_id[never_started][0].handle is None  # not adopted: acked DaemonRestart


class _Unrecoverable(_LabellingRunner):
    """Cannot re-attach (recover=False): reconcile never calls recover()."""

    capabilities: ClassVar[Capabilities] = Capabilities(gpus=True, list_labelled=True, recover=False)

    asked: ClassVar[list[Handle]] = []

    def recover(self, handle: Handle) -> bool:
        self.asked.append(handle)
        return True


def test_a_runner_that_cannot_recover_gets_its_leftovers_destroyed_and_reported(tmp_path: Path) -> None:
    inv = _leftover(tmp_path)
    handle = Handle.load(tmp_path / inv)
    runner = _Unrecoverable({inv}, [])
    [(job, alive)] = recover_all(_labelled_ctx(tmp_path, runner))
    assert alive is False and job.handle == handle  # collected and acked from what it left
    assert runner.asked == [] and runner.destroyed == [handle]


# --- a broken list_labelled, and the agent's reconcile call sites ---------------------------------


class _BrokenListing(_LabellingRunner):
    def __init__(self, alive: set[str], labelled: list[Handle]) -> None:
        super().__init__(alive, labelled)
        self.broken = True

    def list_labelled(self, worker_id: str | None = None) -> list[Handle]:
        if self.broken:
            raise ValueError("malformed answer from the engine")
        return super().list_labelled(worker_id)


def test_a_broken_list_labelled_still_reconciles_workdirs_and_leaves_the_sweep_pending(
    tmp_path: Path,
) -> None:
    from nymph.reconcile import sweep_labelled

    running = _leftover(tmp_path)
    orphan, live_new = ids.new_ulid(), ids.new_ulid()  # no workdir: a previous life's; a job's of now
    handles = [Handle("fake", i, 2, {"container_id": f"c-{i}"}) for i in (running, orphan, live_new)]
    Handle("fake", running, 2, {"container_id": f"c-{running}"}).save(tmp_path / running)
    runner = _BrokenListing({running}, handles)
    ctx = _labelled_ctx(tmp_path, runner)
    found = recover_all(ctx)
    assert [(j.invocation_id, alive) for j, alive in found] == [(running, True)]
    assert found.sweep_pending and runner.destroyed == []
    assert sweep_labelled(ctx, lambda: {live_new}) is False  # still broken: tried again later
    runner.broken = False
    assert sweep_labelled(ctx, lambda: {live_new}) is True
    # the previous life's task goes; the running job's and the unsettled workdir's stay
    assert [h.invocation_id for h in runner.destroyed] == [orphan]


class _NullOutbox(_Outbox):
    def put(self, *args: Any, **kwargs: Any) -> None:
        pass


def _agent(tmp_path: Path, runner: Any) -> Any:
    from nymph.agent import Agent

    config = resolve({"server": "http://x", "token": "t", "workdir": tmp_path / "w"}, {})
    (tmp_path / "w").mkdir()
    agent = Agent(config, runner, client=object())  # type: ignore[arg-type]
    agent.worker_id = "W1"
    agent.outbox = _NullOutbox(set())  # type: ignore[assignment]
    return agent


def test_agent_reconcile_survives_any_failure_and_succeeds_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import nymph.recovery

    agent = _agent(tmp_path, _LabellingRunner(set(), []))
    real = nymph.recovery.recover_all
    monkeypatch.setattr(nymph.recovery, "recover_all", lambda ctx: (_ for _ in ()).throw(KeyError("bug")))
    recovery = agent.recovery
    assert recovery.reconcile() is False  # logged, not raised: nymph keeps running
    assert recovery.failures == 1 and not recovery.done
    assert "reconciling the previous run's work failed (KeyError" in caplog.text
    monkeypatch.setattr(nymph.recovery, "recover_all", real)
    assert recovery.reconcile() is True and recovery.done and recovery.failures == 0


def test_agent_with_a_broken_list_labelled_reconciles_then_sweeps_later(tmp_path: Path) -> None:
    orphan = ids.new_ulid()
    runner = _BrokenListing(set(), [Handle("fake", orphan, 1, {"container_id": "c-orphan"})])
    recovery = _agent(tmp_path, runner).recovery
    assert recovery.reconcile() is True  # claims go on
    assert recovery.sweep_pending and runner.destroyed == []
    recovery.sweep()  # still broken: backs off
    assert recovery.sweep_pending and recovery.sweep_next > 0
    runner.broken = False
    recovery.sweep_next = 0.0
    recovery.sweep()
    assert not recovery.sweep_pending and [h.invocation_id for h in runner.destroyed] == [orphan]


# --- the end of a job: destroy happens whatever fails while the stream is closed ------------------


class _EndingRunner(_Runner):
    def __init__(self) -> None:
        super().__init__(set())
        self.destroyed: list[Handle] = []

    def wait(self, handle: Handle, timeout: float | None = None) -> Any:
        from nymph.runner import ExitStatus

        return ExitStatus(1)

    def stop(self, handle: Handle, grace_s: float) -> None:
        pass

    def destroy(self, handle: Handle) -> None:
        self.destroyed.append(handle)


class _AckingOutbox(_Outbox):
    def __init__(self) -> None:
        super().__init__(set())
        self.acks: list[dict[str, Any]] = []

    def ack(self, body: dict[str, Any]) -> None:
        self.acks.append(body)


@pytest.mark.parametrize("failing", ["stop", "finish"])
def test_a_pump_write_error_at_the_end_still_destroys_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    from nymph.pump import Pump

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Pump, failing, disk_full)
    inv = ids.new_ulid()
    meta = {"invocation_id": inv, "attempt": 1, "started_at": 1.0, "script": "exit 1"}
    path = wd.create(tmp_path, inv, b"", meta, None)
    handle = Handle("fake", inv, 1, {"pid": 1})
    handle.save(path)
    runner, outbox = _EndingRunner(), _AckingOutbox()
    config = resolve({"server": "http://x", "token": "t", "workdir": tmp_path}, {})
    ctx = JobContext(config, runner, outbox, Slots(2), "W1")  # type: ignore[arg-type]
    job = Job.attach(ctx, path, meta, handle)
    job.resume(True)  # supervised: the script "exited 1", closing its stream fails
    assert runner.destroyed == [handle]
    assert [a["error"]["type"] for a in outbox.acks] == ["DaemonError"]
