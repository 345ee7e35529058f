"""Flow control as the stream tests watch it: nymph's metrics, a live follower of a result stream,
nymph's memory peak, and the ``stack`` fixture (``lakeshore server`` and a maker of nymphs), and ``runner_for``
(nymph's flags per runner)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.errors import Unavailable
from tests import docker_fns, nymph_fns
from tests.conftest import ROOT, require
from tests.integration.kube_fake import KubeFake
from tests.runner_kit import docker_runtimes, slurm_answers
from tests.stack.nymph import Nymph
from tests.stack.ports import free_port
from tests.stack.server import Server
from tests.stack.wait import until

MiB = 1024 * 1024


def nymph_metrics(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def start_with_metrics(factory: Callable[..., Nymph], srv: Server, *flags: str) -> tuple[Nymph, int]:
    port = free_port()
    n = factory(srv.url, srv.tokens()["daemon"], "--metrics-port", str(port), *flags)
    until(lambda: _up(port), "nymph's metrics")
    return n, port


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Follower:
    """A live consumer of one result stream (``HttpDispatch.frames``), resuming after drops,
    checking order as it goes and keeping only what the test needs."""

    def __init__(self, url: str, token: str, inv: str, check: Callable[[wire.Frame], None]) -> None:
        self.plane = HttpDispatch(url, token, retries=2)
        self.inv = inv
        self.check = check
        self.last = -1
        self.count = 0
        self.final: wire.Frame | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self.final is None:
                try:
                    for frame in self.plane.frames(self.inv, since=self.last, timeout=120):
                        assert frame.seq == self.last + 1, f"seq {frame.seq} after {self.last}"
                        self.last = frame.seq
                        self.count += 1
                        if frame.kind in (wire.FRAME_END, wire.FRAME_ERROR):
                            self.final = frame
                        else:
                            self.check(frame)
                except Unavailable:  # the control plane is away: resume from the last seq
                    time.sleep(0.5)
        except BaseException as exc:
            self.error = exc
        finally:
            self.plane.close()

    def result(self, limit_s: float = 120) -> wire.Frame:
        self.thread.join(limit_s)
        assert not self.thread.is_alive(), f"the follower is stuck at seq {self.last}"
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final


class RssPeak:
    """Nymph's resident memory, sampled every 50 ms (its own process, not its tasks)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def values(expect: Callable[[int], Any]) -> Callable[[wire.Frame], None]:
    def check(frame: wire.Frame) -> None:
        assert frame.kind == wire.FRAME_VALUE
        value = wire.unpack(frame.body)  # type: ignore[arg-type]
        assert value == expect(frame.seq), f"frame {frame.seq} carries the wrong value"

    return check


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Server, Callable[..., Nymph]]]:
    """``lakeshore server`` (stoppable, restartable) and a maker of nymphs pointed at it."""
    data = tmp_path / "cp"
    data.mkdir()
    srv = Server(data)
    srv.start()
    started: list[Nymph] = []

    def make(url: str, token: str, *extra: str) -> Nymph:
        n = Nymph(url, token, tmp_path, *extra)
        started.append(n)
        return n.start()

    try:
        yield srv, make
    finally:
        for n in started:
            n.stop()
        srv.stop()


KUBE_NS = "lakeshore"


TASK_USER = "nobody"  # pods run as non-root: the kube runner maps as_user to a uid


@pytest.fixture
def runner_for(tmp_path: Path) -> Iterator[Callable[[str], tuple[list[str], Any, dict[str, Any]]]]:
    """nymph's flags for a runner, the module its tasks import and the run_config to submit with."""
    with contextlib.ExitStack() as exits:

        def make(name: str) -> tuple[list[str], Any, dict[str, Any]]:
            if name == "process-spawn":
                return ["--runner-opt", "prefork=false"], nymph_fns, {}
            if name == "slurm":
                require(slurm_answers(), 'needs a Slurm controller: eval "$(scripts/services/slurm.sh)"')
                return ["--runner", "slurm"], nymph_fns, {}
            if name == "kube":
                return _kube(exits, tmp_path), nymph_fns, {"as_user": TASK_USER}
            runtimes = docker_runtimes()
            require(runtimes is not None, "needs a reachable Docker engine")
            if name == "gvisor":
                require("runsc" in (runtimes or ""), "needs the runsc runtime registered with Docker")
            image = os.environ.get("LAKESHORE_TEST_IMAGE", "")
            require(bool(image), "needs LAKESHORE_TEST_IMAGE (an image with python3 and msgpack)")
            flags = ["--runner", name, "--runner-opt", f"image={image}", "--runner-opt", "pull=never"]
            return flags, docker_fns, {}

        yield make


def _kube(exits: contextlib.ExitStack, tmp_path: Path) -> list[str]:
    """A fake Kubernetes API whose kubelet runs pods as local processes of this interpreter, with
    the repository importable (the "image"), and nymph's flags for it."""
    python = tmp_path / "image-python3"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH}}:{ROOT}" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    scratch = tmp_path / "kubelet"
    scratch.mkdir()
    fake = exits.enter_context(KubeFake(namespaces={KUBE_NS}, python=str(python), scratch=scratch))
    config = fake.kubeconfig(tmp_path / "kubeconfig")
    return [
        "--runner", "kube", "--runner-opt", f"namespace={KUBE_NS}", "--runner-opt", "node_name=node-1",
        "--runner-opt", f"kubeconfig={config}", "--allow-user", TASK_USER,
        "--runner-opt", f'users={{{TASK_USER}="65534:65534"}}',
    ]  # fmt: skip
