"""What the tests of nymph's supervised job lifecycle share (tests/unit/test_nymph_lifecycle.py,
tests/unit/test_nymph_handback.py): a recording outbox, runners that fail to start, a job's
context, an agent before its first poll, and the fixtures that catch a thread's crash."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import nymph.lifecycle
from nymph.agent import Agent
from nymph.client import ControlPlaneClient
from nymph.config import NymphConfig
from nymph.execjob import ExecJob
from nymph.job import Job
from nymph.lifecycle import JobContext
from nymph.runner import Capabilities, Handle, Task
from nymph.slots import Slots
from tests.unit.dispatch_kit import FakeRunner

ID = "01HZZZZZZZZZZZZZZZZZZZZZZZ"
ID2 = "01HZZZZZZZZZZZZZZZZZZZZZZY"


class _NoWatcher:
    def add(self, path: Path, callback: Any, names: Any = None) -> object:
        return object()

    def remove(self, watch: object) -> None:
        pass


class _Outbox:
    """Records acks, result publishes and stream chunks."""

    def __init__(self) -> None:
        self.acks: list[dict[str, Any]] = []
        self.results: list[tuple[str, dict[str, Any]]] = []
        self.chunks: list[dict[str, Any]] = []

    def ack(self, body: dict[str, Any]) -> None:
        self.acks.append(body)

    def put(self, route: str, body: dict[str, Any]) -> None:
        self.results.append((route, body))

    def chunk(self, body: dict[str, Any]) -> None:
        self.chunks.append(body)

    def pending(self) -> int:
        return 0

    # the stream side: a pump's frames are "delivered" at once, whenever it wakes the outbox
    watcher = _NoWatcher()

    def open_stream(self, pump: Any, *, wake: bool = True) -> None:
        self.streams = [*getattr(self, "streams", []), pump]
        if wake:
            self.wake()

    def close_stream(self, pump: Any) -> None:
        pass

    def wake(self) -> None:
        for pump in getattr(self, "streams", []):
            while (batch := pump.take()) is not None:
                self.chunks.extend({"invocation_id": pump.invocation_id, "bytes": f} for f in batch.frames)
                pump.confirm(batch)

    def note_undelivered(self, nbytes: int) -> None:
        pass

    def pending_entries(self) -> list[dict[str, Any]]:
        return []

    def has_room(self) -> bool:
        return True


class _FlakyRunner(FakeRunner):
    """``start`` raises each of ``failures`` in turn, then starts."""

    def __init__(self, *failures: BaseException) -> None:
        super().__init__()
        self.failures = list(failures)

    def start(self, task: Task) -> Handle:
        if self.failures:
            raise self.failures.pop(0)
        return super().start(task)


@pytest.fixture
def thread_crashes(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Exceptions that escaped a thread (there must be none)."""
    crashes: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    return crashes


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nymph.lifecycle, "backoff_s", lambda tries, cap=10.0: 0.0)


def _config(tmp_path: Path) -> NymphConfig:
    """A nymph's config over ``tmp_path`` (its workdir made), every gate open."""
    cfg = NymphConfig(
        server="http://cp",
        token="t",
        workdir=tmp_path / "w",
        state_dir=tmp_path / "s",
        allow_root_tasks=True,
        allow_script=True,
        allow_exec=True,
    )
    (tmp_path / "w").mkdir(exist_ok=True)
    return cfg


def _ctx(tmp_path: Path, runner: Any, outbox: _Outbox, **kwargs: Any) -> JobContext:
    cfg = _config(tmp_path)
    slots = Slots(2)
    slots.take()
    return JobContext(cfg, runner, outbox, slots, "W1", **kwargs)  # type: ignore[arg-type]


def _agent(tmp_path: Path, runner: Any) -> tuple[Agent, _Outbox]:
    """An agent between start-up and its first poll: outbox and worker id set, nothing running."""
    cfg = _config(tmp_path)
    client = ControlPlaneClient(
        "http://cp", "t", transport=httpx.MockTransport(lambda r: httpx.Response(500))
    )
    agent = Agent(cfg, runner, client=client)
    outbox = _Outbox()
    agent.outbox = outbox  # type: ignore[assignment]
    agent.worker_id = "W1"
    return agent, outbox


def _run_in_thread(job: Job | ExecJob) -> None:
    job.start_thread()
    job.join(60)


class _WithdrawingRunner(_FlakyRunner):
    """A runner whose start is never answered (it may have started the task) and that can withdraw."""

    capabilities = Capabilities(withdraw=True)

    def __init__(
        self,
        *failures: BaseException,
        withdraw_raises: BaseException | None = None,
        on_withdraw: Any = None,
    ) -> None:
        super().__init__(*failures)
        self.withdrawn: list[Task] = []
        self.withdraw_raises = withdraw_raises
        self.on_withdraw = on_withdraw  # called with the task, as withdraw begins

    def withdraw(self, task: Task) -> None:
        self.withdrawn.append(task)
        if self.on_withdraw is not None:
            self.on_withdraw(task)
        if self.withdraw_raises is not None:
            raise self.withdraw_raises
