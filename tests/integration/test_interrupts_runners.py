"""A function's ``finally`` runs, told why, when its call is cancelled, timed out or preempted, on
the process, docker and slurm runners (issue 30 item 3): real ``lakeshore server`` and ``nymph
start --runner ...``; the function writes its marker into its workdir (kept for a stopped call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests import docker_fns
from tests.integration.flow_kit import runner_for, stack
from tests.stack.nymph import Nymph
from tests.stack.producer import await_result, call, envelope, submit
from tests.stack.server import Server
from tests.stack.wait import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["runner_for", "stack"]  # the fixtures (flow_kit)


@pytest.mark.parametrize("name", ["process-spawn", "docker", "slurm"])
def test_finally_runs_on_cancel_timeout_and_preemption(
    name: str, stack: tuple[Server, Callable[..., Nymph]], runner_for: Callable[[str], Any]
) -> None:
    srv, factory = stack
    flags, _, run_config = runner_for(name)
    token = srv.tokens()["admin"]
    n = factory(
        srv.url, srv.tokens()["daemon"], *flags, "--concurrency", "2", "--stop-grace-s", "5", "--grace-s", "1"
    )

    def started(inv: str) -> None:
        until(lambda: (n.workdir / inv / "started").exists(), f"{inv} to start on {name}")

    def marker(inv: str) -> str:
        return (n.workdir / inv / "marker").read_text()

    cancelled = submit(srv.url, token, envelope(docker_fns.interrupted_marker), **run_config)
    started(cancelled)
    call(srv.url, token, f"/v1/producer/invocations/{cancelled}/cancel", {})
    assert await_result(srv.url, token, cancelled)["state"] == "killed", n.output()[-3000:]
    assert marker(cancelled) == "cancelled"

    timed = submit(srv.url, token, envelope(docker_fns.interrupted_marker), timeout_s=8, **run_config)
    assert await_result(srv.url, token, timed)["state"] == "timeout", n.output()[-3000:]
    assert marker(timed) == "timeout"

    pre = submit(srv.url, token, envelope(docker_fns.interrupted_marker), max_attempts=1, **run_config)
    started(pre)
    n.signal(15)
    assert n.wait() == 0
    assert marker(pre) == "preempted", n.output()[-3000:]
