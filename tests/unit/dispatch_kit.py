"""Fakes of nymph's runner and outbox, and an agent and job context over them, for the dispatch tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from nymph.agent import Agent
from nymph.client import ControlPlaneClient
from nymph.config import NymphConfig
from nymph.lifecycle import JobContext
from nymph.runner import Capabilities, ExitStatus, Handle, RunnerError, Task
from nymph.slots import Slots


class FakeRunner:
    name = "fake"
    capabilities = Capabilities()

    def __init__(self, wait_raises: bool = False) -> None:
        self.wait_raises = wait_raises
        self.started: list[Task] = []
        self.destroyed: list[Handle] = []

    def check(self) -> None:
        pass

    def start(self, task: Task) -> Handle:
        self.started.append(task)
        return Handle(self.name, task.invocation_id, task.attempt, {})

    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None:
        if self.wait_raises:  # a failure, not an unavailable runner (that is retried)
            raise RunnerError("engine broke")
        return ExitStatus(0)

    def stop(self, handle: Handle, grace_s: float) -> None:
        pass

    def destroy(self, handle: Handle) -> None:
        self.destroyed.append(handle)

    def inspect(self, handle: Handle) -> str:
        return "gone"

    def recover(self, handle: Handle) -> bool:
        return False


class FakeOutbox:
    def __init__(self) -> None:
        self.put_calls: list[tuple[str, dict[str, Any]]] = []

    def put(self, route: str, body: dict[str, Any]) -> None:
        self.put_calls.append((route, body))


def make_agent(tmp_path: Path) -> Agent:
    cfg = NymphConfig(
        server="http://cp", token="t", workdir=tmp_path / "w", state_dir=tmp_path / "s", allow_root_tasks=True
    )
    client = ControlPlaneClient(
        "http://cp", "t", transport=httpx.MockTransport(lambda r: httpx.Response(500))
    )
    return Agent(cfg, FakeRunner(), client=client)  # type: ignore[arg-type]


def exec_ctx(tmp_path: Path, runner: Any, outbox: Any, worker_id: str = "", **config: Any) -> JobContext:
    """What an exec job shares with the agent: its workdir root is ``tmp_path``, no client."""
    config.setdefault(
        "allow_root_tasks", True
    )  # the tests run as root in CI: tasks as root, not as a task user
    config.setdefault("allow_exec", True)  # exec jobs are an opt-in (--allow-exec)
    cfg = NymphConfig(
        server="http://cp", token="t", workdir=tmp_path, state_dir=tmp_path / "s", stop_grace_s=0.1, **config
    )
    return JobContext(cfg, runner, outbox, Slots(1), worker_id)
