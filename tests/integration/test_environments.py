"""Each call brings its environment (issue 33), end to end over real HTTP with ``nymph start``
(process runner) as a real subprocess: a pip environment built once per lock with uv from a local
find-links directory of hand-made wheels (no network), reused, built once for concurrent first
calls, a bad requirement one final ``EnvBuildFailed``; the call's ``env``; nymph's own variables
kept from tasks unless ``--pass-env`` names them; an operator's mount by name, an unknown one
refused before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import HttpDispatch
from tests import env_fns, pip_kit
from tests.integration.conftest import ControlPlane
from tests.integration.docker_kit import image, labelled, read_stripped, require_kind
from tests.integration.flow_kit import runner_for
from tests.stack.nymph import Nymph
from tests.stack.ports import free_port
from tests.stack.producer import await_result, envelope, submit
from tests.stack.wait import until

__all__ = ["image", "runner_for"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
CANARY = "LS_CANARY_SECRET_X"


def _metrics(port: int) -> dict[tuple[str, str], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("result", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _pip_nymph(
    factory: Callable[..., Nymph], cp: ControlPlane, tmp_path: Path, *extra: str
) -> tuple[Nymph, int]:
    wheels = pip_kit.wheelhouse(tmp_path / "wheels")
    (tmp_path / "no-index").mkdir()
    port = free_port()
    n = factory(
        cp.url, cp.daemon_token, "--allow-pip", "--pip-find-links", str(wheels),
        "--pip-index-url", (tmp_path / "no-index").as_uri(), "--metrics-port", str(port), *extra,
    )  # fmt: skip
    until(lambda: _up(port), "nymph's metrics")
    return n, port


def test_a_pip_environment_is_built_once_reused_and_shared_by_concurrent_first_calls(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    n, port = _pip_nymph(nymph_factory, cp, tmp_path, "--concurrency", "8")
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("default", plane)
    with pytest.raises(ImportError):
        __import__("lsdemo")  # absent from the host: only the environment has it
    first = q.result(env_fns.uses_lsdemo.submit(_dispatch=plane), timeout=180)
    assert first["value"] == 42, n.output()[-3000:]
    env_dir = Path(first["file"]).parent.parent
    assert env_dir.parent == n.workdir / ".envs"
    assert not os.access(first["file"], os.W_OK) or os.geteuid() == 0  # sealed (root ignores modes)
    assert os.stat(first["file"]).st_mode & 0o777 == 0o444
    assert "site-packages" in first["msgpack"]  # the SDK's own dependencies stay visible
    built = _metrics(port)
    assert built[("nymph_pip_envs_total", "built")] == 1

    again = q.result(env_fns.uses_lsdemo.submit(_dispatch=plane), timeout=120)
    assert again["file"] == first["file"]
    after = _metrics(port)
    assert after[("nymph_pip_envs_total", "built")] == 1  # no second build
    assert after[("nymph_pip_envs_total", "hit")] >= 1

    calls = [env_fns.uses_lsdep.submit(_dispatch=plane) for _ in range(8)]  # 8 first calls at once
    files = {q.result(inv, timeout=180) for inv in calls}
    assert len(files) == 1, files
    final = _metrics(port)
    assert final[("nymph_pip_envs_total", "built")] == 2  # one build for all eight
    assert final[("nymph_pip_envs_total", "hit")] >= 8
    assert final[("nymph_pip_env_build_seconds_count", "")] == 2


def test_a_bad_requirement_is_one_final_env_build_failed(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    n, port = _pip_nymph(nymph_factory, cp, tmp_path)
    plane = HttpDispatch(cp.url, cp.producer_token)
    inv = env_fns.needs_a_missing_package.submit(_dispatch=plane)
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "failed", out
    assert out["error"]["type"] == "EnvBuildFailed", out
    assert "nosuchpkg-lakeshore-zz" in out["error"]["message"], out  # uv's own words
    assert plane.status(inv)["attempt"] == 1  # max_attempts=3, yet never retried
    assert _metrics(port)[("nymph_pip_envs_total", "failed")] == 1
    assert "nosuchpkg-lakeshore-zz" in n.output()


def test_pip_is_refused_without_allow_pip(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    nymph_factory(cp.url, cp.daemon_token)
    out = await_result(
        cp.url,
        cp.producer_token,
        env_fns.uses_lsdemo.submit(_dispatch=HttpDispatch(cp.url, cp.producer_token)),
    )
    assert out["state"] == "failed" and out["error"]["type"] == "PipRefused", out
    assert "--allow-pip" in out["error"]["message"]


class _CanaryNymph(Nymph):
    """nymph with variables of its own that tasks must not see (and one it passes)."""

    def env(self) -> dict[str, str]:
        env = super().env()
        env[CANARY] = "nymph-only"
        env["LS_PASSED"] = "passed-on"
        env["LAKESHORE_TOKEN"] = "nymphs-own-token"  # never a task's: it gets its own or none
        return env


def test_tasks_get_a_clean_environment_the_calls_env_and_passed_variables(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "hello.txt").write_text("from the operator")
    n = _CanaryNymph(
        cp.url, cp.daemon_token, tmp_path, "--pass-env", "LS_PASSED", "--mount", f"datasets={data}:ro"
    )
    n.start()
    try:
        plane = HttpDispatch(cp.url, cp.producer_token)
        q = dls.SyncQueue("default", plane)
        names = (
            CANARY,
            "LS_PASSED",
            "OMP_NUM_THREADS",
            "LS_FROM_UDF",
            "LS_PER_CALL",
            "PATH",
            "LAKESHORE_TOKEN",
        )
        got: dict[str, Any] = q.result(
            env_fns.env_of.submit(
                *names, _dispatch=plane, _env={"LS_PER_CALL": "call", "LS_FROM_UDF": "call"}
            ),
            timeout=120,
        )
        assert got[CANARY] is None, (got, n.output()[-2000:])
        assert got["LS_PASSED"] == "passed-on"
        assert got["OMP_NUM_THREADS"] == "4" and got["LS_PER_CALL"] == "call"
        assert got["LS_FROM_UDF"] == "call"  # per call over the udf's
        assert got["PATH"]  # the documented base
        assert got["LAKESHORE_TOKEN"] != "nymphs-own-token"
        mounted = q.result(env_fns.read_mount.submit("hello.txt", _dispatch=plane), timeout=120)
        assert mounted == {"path": str(data), "text": "from the operator"}
        out = await_result(cp.url, cp.producer_token, env_fns.wants_unknown_mount.submit(_dispatch=plane))
        assert out["state"] == "failed" and out["error"]["type"] == "MountRefused", out
        assert "nosuchmount" in out["error"]["message"] and "datasets" in out["error"]["message"]
    finally:
        n.stop()


# --- the container runners: an image with python3 and nothing else ---------------------------------


@pytest.fixture
def container_nymph(image: str, tmp_path: Path) -> Iterator[Callable[..., Nymph]]:
    """``nymph start --runner docker|gvisor`` with canary variables of its own; no container left."""
    started: list[Nymph] = []

    def make(cp: ControlPlane, kind: str, *extra: str) -> Nymph:
        require_kind(kind)
        n = _CanaryNymph(
            cp.url, cp.daemon_token, tmp_path, "--runner", kind, "--runner-opt", f"image={image}",
            "--runner-opt", "pull=never", *extra,
        )  # fmt: skip
        started.append(n)
        return n.start()

    yield make
    for n in started:
        n.stop()
    for worker in {read_stripped(n.state_dir / "worker_id") for n in started} - {""}:
        leftovers = labelled(worker)
        assert not leftovers, f"containers left behind by nymph: {leftovers}"


@pytest.mark.parametrize("kind", ["docker", "gvisor"])
def test_a_pip_environment_and_a_clean_environment_in_a_bare_image(
    kind: str, sqlite_control_plane: ControlPlane, container_nymph: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    wheels = pip_kit.wheelhouse(tmp_path / "wheels")
    (tmp_path / "no-index").mkdir()
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "hello.txt").write_text("from the operator")
    port = free_port()
    n = container_nymph(
        cp, kind, "--allow-pip", "--pip-find-links", str(wheels), "--pip-index-url",
        (tmp_path / "no-index").as_uri(), "--metrics-port", str(port), "--concurrency", "4",
        "--pass-env", "LS_PASSED", "--mount", f"datasets={data}:ro",
    )  # fmt: skip
    until(lambda: _up(port), "nymph's metrics")
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("default", plane)
    first = q.result(env_fns.uses_lsdemo.submit(_dispatch=plane), timeout=180)
    assert first["value"] == 42, n.output()[-3000:]
    assert first["file"].startswith("/opt/lakeshore/code/"), first  # the env, mounted read-only
    calls = [env_fns.uses_lsdemo.submit(_dispatch=plane) for _ in range(4)]
    assert {q.result(inv, timeout=180)["file"] for inv in calls} == {first["file"]}
    counts = _metrics(port)
    assert counts[("nymph_pip_envs_total", "built")] == 1 and counts[("nymph_pip_envs_total", "hit")] >= 4

    out = await_result(cp.url, cp.producer_token, env_fns.needs_a_missing_package.submit(_dispatch=plane))
    assert out["state"] == "failed" and out["error"]["type"] == "EnvBuildFailed", out

    names = (CANARY, "LS_PASSED", "OMP_NUM_THREADS", "LAKESHORE_TOKEN")
    got = q.result(env_fns.env_of.submit(*names, _dispatch=plane), timeout=120)
    assert got.pop("LAKESHORE_TOKEN") != "nymphs-own-token"  # the task's own credential, if any
    assert got == {CANARY: None, "LS_PASSED": "passed-on", "OMP_NUM_THREADS": "4"}
    mounted = q.result(env_fns.read_mount.submit("hello.txt", _dispatch=plane), timeout=120)
    assert mounted == {"path": "/mnt/lakeshore/datasets", "text": "from the operator"}


# --- every runner: nymph's variables never reach a task ------------------------------------------


@pytest.mark.parametrize("name", ["process", "process-spawn", "slurm", "kube"])
def test_a_canary_set_for_nymph_is_absent_from_tasks_on_every_runner(
    name: str, sqlite_control_plane: ControlPlane, runner_for: Callable[[str], Any], tmp_path: Path
) -> None:
    """(docker and gvisor: test_a_pip_environment_and_a_clean_environment_in_a_bare_image)"""
    cp = sqlite_control_plane
    flags, _fns, run_config = runner_for(name) if name != "process" else ([], None, {})
    n = _CanaryNymph(cp.url, cp.daemon_token, tmp_path, *flags, "--pass-env", "LS_PASSED")
    n.start()
    try:
        names = (CANARY, "LS_PASSED", "OMP_NUM_THREADS", "LAKESHORE_TOKEN", "PATH")
        blob = envelope(env_fns.env_of, *names)
        inv = submit(cp.url, cp.producer_token, blob, env={"OMP_NUM_THREADS": "4"}, **run_config)
        out = await_result(cp.url, cp.producer_token, inv, limit_s=120)
        assert out["state"] == "succeeded", (out, n.output()[-3000:])
        got = wire.unpack(out["result_blob"])
        assert got[CANARY] is None, got
        assert got["LS_PASSED"] == "passed-on" and got["OMP_NUM_THREADS"] == "4", got
        assert got["LAKESHORE_TOKEN"] != "nymphs-own-token"
    finally:
        n.stop()


def test_example_07_builds_pyfiglet_from_pypi_with_a_secret_and_env() -> None:
    """``examples/07_environments.py`` as a user runs it (the one test that reaches PyPI: a real
    package, pyfiglet, absent from the host, resolved and built by uv on the first call)."""
    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "LAKESHORE_CODE"}  # envlib ships with the call
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "runners")])
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "07_environments.py")],
        capture_output=True, text=True, timeout=200, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "second call (cached)" in out.stdout and "OMP_NUM_THREADS=4" in out.stdout
    assert "secret length seen by the task: 17\n" in out.stdout
    assert "pyfiglet came from nymph's env cache: True" in out.stdout
    assert "not-a-real-key-42" not in out.stdout + out.stderr


def test_a_pip_environment_on_slurm_is_built_on_the_shared_workdir(
    sqlite_control_plane: ControlPlane,
    nymph_factory: Callable[..., Nymph],
    runner_for: Callable[[str], Any],
    tmp_path: Path,
) -> None:
    cp = sqlite_control_plane
    flags, _fns, _rc = runner_for("slurm")
    n, port = _pip_nymph(nymph_factory, cp, tmp_path, *flags)
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("default", plane)
    first = q.result(env_fns.uses_lsdemo.submit(_dispatch=plane), timeout=180)
    assert first["value"] == 42, n.output()[-3000:]
    assert Path(first["file"]).is_relative_to(n.workdir / ".envs")  # where the job's node sees it
    again = q.result(env_fns.uses_lsdemo.submit(_dispatch=plane), timeout=180)
    assert again["file"] == first["file"]
    counts = _metrics(port)
    assert counts[("nymph_pip_envs_total", "built")] == 1 and counts[("nymph_pip_envs_total", "hit")] == 1
