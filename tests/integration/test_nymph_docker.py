"""``nymph start --runner docker|gvisor`` end to end: a real control plane, nymph as a real process,
real containers on a real Docker engine (``scripts/services/docker.sh``; LAKESHORE_TEST_IMAGE).

The image has python3 and msgpack but no dreamlake: the entry comes from the mounted bundle and the
test functions from this repository, mounted read-only because it is on nymph's PYTHONPATH
(``mount_pythonpath``). Runner options reach nymph through ``--runner-opt KEY=VALUE``. Every docker
command here has a timeout, and every test checks that no container labelled for its worker is
left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from dreamlake.lakeshore import wire
from tests import docker_fns, nymph_fns
from tests.integration.conftest import ControlPlane
from tests.integration.docker_kit import docker, image, labelled, read_stripped, require_kind
from tests.stack.nymph import Nymph
from tests.stack.ports import free_port
from tests.stack.producer import await_result, envelope, frames_of, state_of, submit
from tests.stack.wait import until

__all__ = ["image"]  # the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KINDS = ("docker", "gvisor")


def _worker_id(n: Nymph) -> str:
    return str(until(lambda: read_stripped(n.state_dir / "worker_id"), "nymph's worker id"))


@pytest.fixture
def start_nymph(image: str, tmp_path: Path) -> Iterator[Callable[..., Nymph]]:
    started: list[Nymph] = []

    def make(cp_url: str, token: str, kind: str, *extra: str) -> Nymph:
        require_kind(kind)
        n = Nymph(
            cp_url, token, tmp_path, "--runner", kind, "--runner-opt", f"image={image}",
            "--runner-opt", "pull=never", *extra,
        )  # fmt: skip
        started.append(n)
        return n.start()

    yield make
    for n in started:
        n.stop()
        if n.proc is not None and n.proc.returncode not in (0, None, -signal.SIGKILL):
            print(n.output()[-5000:])
    for worker in {read_stripped(n.state_dir / "worker_id") for n in started} - {""}:
        leftovers = labelled(worker)
        if leftovers:
            docker("rm", "-f", *leftovers)
        assert not leftovers, f"containers left behind by nymph: {leftovers}"


# --- a plain result and a live generator through each runner ----------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_plain_result_and_live_generator_through_nymph_start(
    kind: str, sqlite_control_plane: ControlPlane, start_nymph: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = start_nymph(cp.url, cp.daemon_token, kind)
    inv = submit(cp.url, cp.producer_token, envelope(docker_fns.add, 2, 3))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert wire.unpack(out["result_blob"]) == 5

    gen = submit(cp.url, cp.producer_token, envelope(docker_fns.gated_count, 3, "release"))
    until(lambda: len(frames_of(cp.url, cp.producer_token, gen, 0.5)) >= 2, "two frames while it runs")
    assert state_of(cp.url, cp.producer_token, gen) == "running"
    (n.workdir / gen / "release").touch()
    out = await_result(cp.url, cp.producer_token, gen)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    frames = frames_of(cp.url, cp.producer_token, gen)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE] * 3 + [wire.FRAME_END]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 2]  # type: ignore[arg-type]
    until(lambda: not labelled(_worker_id(n)), "every container to be removed")


def _output(frames: list[wire.Frame], stream: str) -> str:
    return "".join(
        bytes(f.body).decode()  # type: ignore[arg-type]
        for f in frames
        if f.kind == wire.FRAME_LOG and (f.meta or {}).get("stream") == stream
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_container_s_output_streams_live_as_log_frames(
    kind: str, sqlite_control_plane: ControlPlane, start_nymph: Callable[..., Nymph]
) -> None:
    """print() inside the container reaches the control plane while the function still runs
    (the entry appends fd 1/2 to the bind-mounted workdir), stderr apart, nothing twice."""
    cp = sqlite_control_plane
    n = start_nymph(cp.url, cp.daemon_token, kind)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.chatty, "release"))
    until(
        lambda: "from a child process" in _output(frames_of(cp.url, cp.producer_token, inv, 0.5), "stdout"),
        "the output while the container runs",
    )
    assert state_of(cp.url, cp.producer_token, inv) == "running"
    (n.workdir / inv / "release").touch()
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert wire.unpack(out["result_blob"]) == "talked"
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert _output(frames, "stdout") == "hello from print\nfrom a child process\nafter the gate\n"
    assert _output(frames, "stderr") == "careful, stderr\n"
    until(lambda: not labelled(_worker_id(n)), "every container to be removed")


@pytest.mark.parametrize("kind", KINDS)
def test_a_fast_generator_is_paused_by_the_window_inside_the_container(
    kind: str, sqlite_control_plane: ControlPlane, start_nymph: Callable[..., Nymph]
) -> None:
    """Backpressure works through the workdir on this runner: the entry in the container pauses
    at the window (``frames.delivered``), and every value arrives once, in order, on attempt 1."""
    cp = sqlite_control_plane
    window, count = 300, 20_000
    metrics_port = free_port()
    n = start_nymph(
        cp.url,
        cp.daemon_token,
        kind,
        "--stream-window-frames",
        str(window),
        "--metrics-port",
        str(metrics_port),
    )
    inv = submit(cp.url, cp.producer_token, envelope(docker_fns.count_to, count))
    out = await_result(cp.url, cp.producer_token, inv, limit_s=150)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    frames = frames_of(cp.url, cp.producer_token, inv, 30.0)
    assert [f.seq for f in frames] == list(range(count + 1)) and frames[-1].kind == wire.FRAME_END
    assert [wire.unpack(f.body) for f in frames[:-1]] == list(range(count))  # type: ignore[arg-type]
    assert cp.store.get(inv).attempt == 1  # type: ignore[union-attr]
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    peak = next(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("nymph_stream_undelivered_bytes_peak ")
    )
    assert 0 < peak <= window * 64


def test_as_user_runs_as_the_uid_the_operator_mapped(
    sqlite_control_plane: ControlPlane, start_nymph: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = start_nymph(
        cp.url, cp.daemon_token, "docker", "--allow-user", "nobody", "--runner-opt", 'users={nobody="65534:65534"}'
    )  # fmt: skip
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.whoami), as_user="nobody")
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert wire.unpack(out["result_blob"]) == 65534


# --- restart: re-attach, collect, nothing left behind -------------------------------------------------


def test_sigkill_nymph_while_a_container_runs_then_restart_acks_it_and_removes_it(
    sqlite_control_plane: ControlPlane, start_nymph: Callable[..., Nymph], image: str
) -> None:
    cp = sqlite_control_plane
    first = start_nymph(cp.url, cp.daemon_token, "docker")
    inv = submit(cp.url, cp.producer_token, envelope(docker_fns.gated_count, 3, "release"))
    handle_file = first.workdir / inv / "handle.json"
    until(handle_file.exists, "the container to start")
    cid = str(json.loads(handle_file.read_text())["data"]["container_id"])
    until(lambda: len(frames_of(cp.url, cp.producer_token, inv, 0.5)) >= 2, "frames before the kill")
    first.signal(signal.SIGKILL)
    first.wait()
    assert docker("inspect", "-f", "{{.State.Running}}", cid).stdout.strip() == "true"
    # a container of a previous life whose workdir is gone: the restart must collect it too
    worker = _worker_id(first)
    stray = docker(
        "run", "-d", "--network", "none", "--label", "nymph.runner=docker", "--label", "nymph.invocation=STRAY",
        "--label", f"nymph.worker={worker}", "--entrypoint", "sleep", image, "300",
    ).stdout.strip()  # fmt: skip
    assert stray

    second = start_nymph(cp.url, cp.daemon_token, "docker")
    until(lambda: "re-attached" in second.output(), "the new nymph to re-attach")
    (second.workdir / inv / "release").touch()
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", second.output()[-3000:]
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert [f.seq for f in frames] == [0, 1, 2, 3] and frames[-1].kind == wire.FRAME_END
    until(lambda: docker("inspect", cid).returncode != 0, "the re-attached container to be removed")
    assert docker("inspect", stray).returncode != 0, "the stray labelled container was not collected"
    assert not labelled(worker)


# --- the engine down at start -------------------------------------------------------------------------


def _health(port: int) -> dict[str, object] | None:
    try:
        return dict(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json())
    except (httpx.HTTPError, ValueError):
        return None


def test_engine_down_at_start_is_reported_and_nymph_runs_the_work_once_it_is_back(
    sqlite_control_plane: ControlPlane, start_nymph: Callable[..., Nymph]
) -> None:
    from dreamlake.lakeshore.devstack import free_port

    cp = sqlite_control_plane
    sock_dir = Path(tempfile.mkdtemp(prefix="ls-dk-", dir="/tmp"))  # a short path: sun_path is 108 bytes
    sock = sock_dir / "docker.sock"
    port = free_port()
    try:
        n = start_nymph(
            cp.url, cp.daemon_token, "docker", "--runner-opt", f"docker_host=unix://{sock}",
            "--metrics-port", str(port),
        )  # fmt: skip
        health = until(lambda: (h := _health(port)) and h.get("runner_problem") and h, "not-ready health")
        assert health["ok"] is False and health["runner_ok"] is False
        assert "not reachable" in str(health["runner_problem"])
        until(lambda: "cannot work" in n.output(), "a clear log line")
        inv = submit(cp.url, cp.producer_token, envelope(docker_fns.add, 20, 22))
        assert n.proc is not None and n.proc.poll() is None  # alive, retrying
        assert state_of(cp.url, cp.producer_token, inv) == "queued"  # nothing claimed meanwhile
        os.symlink("/var/run/docker.sock", sock)  # the engine comes back
        out = await_result(cp.url, cp.producer_token, inv, 90.0)
        assert out["state"] == "succeeded", n.output()[-3000:]
        assert wire.unpack(out["result_blob"]) == 42
        until(lambda: (h := _health(port)) and h.get("ok") is True, "ready health")
        assert "available again" in n.output()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_doctor_says_what_to_fix_when_the_engine_is_down(
    sqlite_control_plane: ControlPlane, tmp_path: Path, image: str
) -> None:
    cp = sqlite_control_plane
    env = {k: v for k, v in os.environ.items() if not k.startswith("NYMPH_")}
    env["DOCKER_HOST"] = f"unix://{tmp_path}/no-engine.sock"
    cmd = [sys.executable, "-m", "nymph", "doctor", "--server", cp.url, "--token", cp.daemon_token,
           "--runner", "docker", "--workdir", str(tmp_path / "w"), "--state-dir", str(tmp_path / "s")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("[FAIL] runner"))
    assert "no-engine.sock" in line and "not reachable" in line
    assert "start the engine" in line and "DOCKER_HOST" in line
    assert "[ok] server" in out.stdout and "[ok] token" in out.stdout


# --- exec jobs are labelled like invocations ---------------------------------------------------------


def test_an_exec_container_is_labelled_with_the_worker_and_listed_for_start_up_cleanup(
    image: str, tmp_path: Path
) -> None:
    """Start-up cleanup lists this worker's labelled containers: an exec job's must be among them."""
    from typing import Any

    from dreamlake.lakeshore import ids
    from nymph.config import NymphConfig
    from nymph.execjob import ExecJob
    from nymph.lifecycle import JobContext
    from nymph.slots import Slots
    from tests.conftest import ROOT

    if str(ROOT / "runners") not in sys.path:
        sys.path.insert(0, str(ROOT / "runners"))
    from nymph_docker import DockerRunner

    class _Outbox:
        def put(self, *args: Any, **kwargs: Any) -> None:
            pass

    runner = DockerRunner(image=image, pull="never")
    worker = f"W-exec-{ids.new_ulid()}"
    config = NymphConfig(  # run as root in CI: the container as root too, not as a task user
        server="http://cp",
        token="t",
        workdir=tmp_path,
        stop_grace_s=0.5,
        allow_root_tasks=True,
        allow_exec=True,
    )
    job = ExecJob(
        JobContext(config, runner, _Outbox(), Slots(1), worker),  # type: ignore[arg-type]
        {"exec_id": ids.new_ulid(), "namespace": "ns", "command": "sleep 60"},
    )
    job.start_thread()
    try:
        listed = until(lambda: runner.list_labelled(worker_id=worker), "the exec container to be listed")
        assert [h.invocation_id for h in listed] == [job.exec_id]
        cid = str(listed[0].data["container_id"])
        inspected = docker("inspect", "--format", "{{json .Config.Labels}}", cid)
        assert inspected.returncode == 0, (  # (seen once in a full run: say what the job was doing)
            f"container {cid[:12]} was listed, then {inspected.stderr.strip()!r}; the job: state "
            f"{job.state!r}, phase {job.phase!r}"
        )
        labels = json.loads(inspected.stdout)
        assert labels["nymph.worker"] == worker and labels["nymph.exec"] == job.exec_id
    finally:
        job.cancel("test over", 0.5)
        job.join(60)
    assert labelled(worker) == []
