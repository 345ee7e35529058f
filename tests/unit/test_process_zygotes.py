"""The process runner's zygotes by namespace (:class:`nymph_process.forking.Zygotes`), with a fake
zygote: a namespace's tasks fork only from its own, at most ``limit`` live at once, the least
recently used idle one closed for a new key, and a task spawned when every zygote is busy."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import nymph_process.forking as forking
from nymph.runner import Task
from nymph_process.prefork import ForkedChild

ENV = {"PATH": "/usr/bin", "LAKESHORE_INVOCATION_ID": "x"}


class FakeZygote:
    started: list[FakeZygote] = []

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.pid = 1000 + len(self.started)
        self.alive = True
        self.closed = False
        self.running: list[ForkedChild] = []
        self.started.append(self)

    @property
    def idle(self) -> bool:
        return not [c for c in self.running if not c.done.is_set()]

    def fork(
        self, workdir: Path, env: Mapping[str, str], timeout: float, **_: Any
    ) -> tuple[ForkedChild, float]:
        child = ForkedChild(self.pid * 10 + len(self.running))
        self.running.append(child)
        return child, 0.0

    def close(self) -> None:
        self.closed = True
        self.alive = False


@pytest.fixture
def zygotes(monkeypatch: pytest.MonkeyPatch) -> Iterator[forking.Zygotes]:
    FakeZygote.started = []
    monkeypatch.setattr(forking, "ZygoteClient", FakeZygote)
    pool = forking.Zygotes("python", limit=2)
    yield pool
    pool.close()


def _fork(pool: forking.Zygotes, namespace: str | None, env: Mapping[str, str] = ENV) -> Any:
    task = Task(invocation_id="x", attempt=1, workdir=Path("/nonexistent"), env={}, namespace=namespace)
    forked = pool.fork(task, dict(env), None)
    return None if forked is None else forked[0]


def test_a_namespace_forks_only_from_its_own_zygote(zygotes: forking.Zygotes) -> None:
    a1, b1, a2 = _fork(zygotes, "team-a"), _fork(zygotes, "team-b"), _fork(zygotes, "team-a")
    assert a1 is a2 and a1 is not b1 and len(FakeZygote.started) == 2
    # per-task variables are not part of the key; the rest of the environment is
    assert _fork(zygotes, "team-a", {**ENV, "LAKESHORE_INVOCATION_ID": "y"}) is a1
    assert a1.env == b1.env == {"PATH": "/usr/bin"}  # a zygote's own environment: no per-task variable


def test_the_least_recently_used_idle_zygote_makes_room(zygotes: forking.Zygotes) -> None:
    a = _fork(zygotes, "team-a")
    b = _fork(zygotes, "team-b")
    for child in a.running + b.running:
        child.finish(0)
    assert _fork(zygotes, "team-a") is a  # used again: team-b's is now the least recently used
    a.running[-1].finish(0)
    c = _fork(zygotes, "team-c")
    assert b.closed and not a.closed and c not in (a, b)
    assert set(zygotes.live.values()) == {a, c}  # never more than the limit


def test_a_busy_zygote_is_never_closed_the_task_is_spawned_instead(zygotes: forking.Zygotes) -> None:
    a = _fork(zygotes, "team-a")
    b = _fork(zygotes, "team-b")  # both still running a child
    assert _fork(zygotes, "team-c") is None  # spawned: no zygote of another namespace serves it
    assert not a.closed and not b.closed and len(FakeZygote.started) == 2
    b.running[0].finish(0)
    c = _fork(zygotes, "team-c")
    assert b.closed and c is not None and c not in (a, b)


def test_a_dead_zygote_is_replaced_and_makes_room(zygotes: forking.Zygotes) -> None:
    a = _fork(zygotes, "team-a")
    b = _fork(zygotes, "team-b")
    a.alive = False  # died (its children are watched without it)
    assert _fork(zygotes, "team-c") not in (None, a, b)
    assert a.closed and not b.closed and len(zygotes.live) == 2
