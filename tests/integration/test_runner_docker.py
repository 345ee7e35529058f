"""The docker and gvisor runners against a real Docker engine, real containers, the real entry.

Needs a reachable engine and ``LAKESHORE_TEST_IMAGE`` (``scripts/services/docker.sh`` starts both:
a debootstrap image with python3 and msgpack but no dreamlake, so every result here also proves
the entry bundle); the gvisor cases need the runsc runtime registered. Functions come from
``tests/docker_fns.py``, mounted read-only through ``code_dirs``. Every container this module
starts carries a run label, and the module checks at the end that none is left behind.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore import ids, wire
from nymph.runner import Handle, RunnerError, RunnerUnavailable, Task
from tests import docker_fns
from tests import runner_kit as kit
from tests.conftest import ROOT, require
from tests.integration.docker_kit import docker, runtimes
from tests.runner_kit import TaskFactory

if str(ROOT / "runners") not in sys.path:  # until the editable install exposes runners/
    sys.path.insert(0, str(ROOT / "runners"))

from nymph_docker import BUNDLE_TARGET, DockerRunner
from nymph_gvisor import GVisorRunner

pytestmark = pytest.mark.timeout(120)

LIMIT_S = 60.0
RUN_ID = secrets.token_hex(4)
RUN_LABEL = "lakeshore.test.run"
KINDS: dict[str, type[DockerRunner]] = {"docker": DockerRunner, "gvisor": GVisorRunner}


def _our_containers() -> list[str]:
    out = docker(
        "ps", "-a", "-q", "--filter", f"label={RUN_LABEL}={RUN_ID}", "--filter", "label=nymph.invocation"
    )
    return out.stdout.split()


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    require(runtimes() is not None, "needs a reachable Docker engine (scripts/services/docker.sh)")
    name = os.environ.get("LAKESHORE_TEST_IMAGE", "")
    require(bool(name), "needs LAKESHORE_TEST_IMAGE (scripts/services/docker.sh builds one)")
    require(docker("image", "inspect", name).returncode == 0, f"image {name} is not on the engine")
    yield name
    leftovers = _our_containers()
    if leftovers:
        docker("rm", "-f", *leftovers)
    assert not leftovers, f"containers left behind by the runner tests: {leftovers}"


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest, image: str) -> str:
    if request.param == "gvisor":
        require("runsc" in (runtimes() or {}), "needs the runsc runtime registered with Docker")
    return str(request.param)


@pytest.fixture
def make_runner(kind: str, image: str) -> Callable[..., DockerRunner]:
    def _make(**options: Any) -> DockerRunner:
        base: dict[str, Any] = {
            "image": image,
            "pull": "never",
            "code_dirs": [str(ROOT)],
            "mount_pythonpath": False,
        }
        return KINDS[kind](**{**base, **options})

    return _make


@pytest.fixture
def runner(make_runner: Callable[..., DockerRunner]) -> DockerRunner:
    return make_runner()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[TaskFactory]:
    """Starts tasks in fresh workdirs (run-labelled) and destroys every container at teardown."""
    s = TaskFactory(tmp_path, labels_extra={RUN_LABEL: RUN_ID})
    yield s
    s.destroy_all()


def _run_script(runner: DockerRunner, started: TaskFactory, script: str, **fields: Any) -> tuple[int, str]:
    task = started.task(None, script=script, **fields)
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None
    return status.exit_code, (task.workdir / "stdout.log").read_text()


# --- results through the entry bundle -------------------------------------------------------------


def test_plain_result_in_an_image_without_dreamlake(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.add, 2, 3)
    handle = started.start(runner, task)
    assert handle.runner == runner.name and Handle.load(task.workdir) == handle
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task) == 5
    assert runner.inspect(handle) == "exited"


def test_the_entry_comes_from_the_mounted_bundle(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.where_is_the_entry)
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task).startswith(BUNDLE_TARGET + "/")
    bare = "env -u PYTHONPATH python3 -c 'import dreamlake' 2>/dev/null && echo has || echo none"
    assert _run_script(runner, started, bare) == (0, "none\n")  # the image itself has no dreamlake


def test_generator_frames_appear_while_running(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.gated_count, 3, "release")
    handle = started.start(runner, task)
    kit.until(lambda: len(kit.frames(task.workdir)) >= 2, "two frames in the journal")
    assert runner.inspect(handle) == "running"  # frames arrive before the body finishes
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0
    frames = kit.frames(task.workdir)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE] * 3 + [wire.FRAME_END]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 2]  # type: ignore[arg-type]


def test_failure_leaves_error_json(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.boom, "no luck")
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code == 1 and status.reason is None
    err = json.loads((task.workdir / "error.json").read_text())
    assert err["type"] == "ValueError" and err["message"] == "no luck" and "boom" in err["traceback"]


# --- cancellation, timeout, limits ----------------------------------------------------------------


def test_wait_times_out_then_the_stop_ladder_kills_a_sigterm_ignoring_task(
    runner: DockerRunner, started: TaskFactory
) -> None:
    task = started.task(docker_fns.hang, True)
    handle = started.start(runner, task)
    kit.until(lambda: (task.workdir / "started").exists(), "the task to start")
    assert runner.wait(handle, 0.3) is None  # nymph's timeout: wait gives up, nothing is killed
    assert runner.inspect(handle) == "running"
    runner.stop(handle, 0.5)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 137 and status.reason == "signal 9", status
    runner.stop(handle, 0.5)  # stopping a stopped container is harmless


def test_stop_delivers_sigterm_to_the_entry(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.hang, False)
    handle = started.start(runner, task)
    kit.until(lambda: (task.workdir / "started").exists(), "the task to start")
    runner.stop(handle, LIMIT_S)
    status = runner.wait(handle, LIMIT_S)
    # Ended by SIGTERM itself, not by the SIGKILL after the grace: the init process forwarded it,
    # and the entry turned it into dls.Interrupted in the function (issue 30), which ended it.
    assert status is not None and status.reason != "signal 9", status
    err = json.loads((task.workdir / "error.json").read_text())
    assert err["type"] == "Interrupted", err


def test_memory_limit_reports_oomkilled(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.hog_memory, 512, run_config={"resources": {"memory": "64m"}})
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code != 0, status
    assert status.reason is not None and status.reason.startswith("OOMKilled"), status
    assert not (task.workdir / "result.msgpack").exists()


def test_as_user_runs_as_the_mapped_uid_and_can_write_the_workdir(
    runner: DockerRunner, started: TaskFactory
) -> None:
    nobody = pwd.getpwnam("nobody")
    task = started.task(docker_fns.ids, as_user="nobody", owner=(nobody.pw_uid, nobody.pw_gid))
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task) == [nobody.pw_uid, nobody.pw_gid]
    assert (task.workdir / "written-by-task").stat().st_uid == nobody.pw_uid


def test_users_option_maps_a_name_to_uid_gid(
    make_runner: Callable[..., DockerRunner], started: TaskFactory
) -> None:
    runner = make_runner(users={"svc": "4321:4322"})
    task = started.task(docker_fns.ids, as_user="svc", owner=(4321, 4322))
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task) == [4321, 4322]


def test_tasks_run_without_capabilities_or_network(runner: DockerRunner, started: TaskFactory) -> None:
    code, out = _run_script(
        runner,
        started,
        "grep CapEff /proc/self/status; "
        "python3 -c 'import socket; print(sorted(n for _, n in socket.if_nameindex()))'",
    )
    assert code == 0 and out == "CapEff:\t0000000000000000\n['lo']\n"


# --- scripts --------------------------------------------------------------------------------------


def test_script_output_goes_to_the_log_files(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(None, script="echo to-out; echo to-err >&2; exit 3")
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code == 3 and status.reason is None
    assert (task.workdir / "stdout.log").read_text() == "to-out\n"
    assert (task.workdir / "stderr.log").read_text() == "to-err\n"
    assert status.logs is not None and "to-err" in status.logs


@pytest.fixture(scope="module")
def image_without_bash(image: str) -> Iterator[str]:
    """``image`` with bash removed (run + commit: no registry, no build context)."""
    name = f"lakeshore-python:nobash-{RUN_ID}"
    box = f"lakeshore-nobash-{RUN_ID}"
    made = docker("run", "--name", box, "--network", "none", image, "rm", "-f", "/usr/bin/bash", "/bin/bash")
    assert made.returncode == 0, made.stderr
    committed = docker("commit", box, name)
    docker("rm", "-f", box)
    assert committed.returncode == 0, committed.stderr
    yield name
    docker("rmi", "-f", name)


def test_script_runs_under_bash_or_falls_back_to_sh(
    make_runner: Callable[..., DockerRunner], started: TaskFactory, image_without_bash: str
) -> None:
    runner = make_runner(allowed_images=["lakeshore-python"])
    probe = 'if [ -n "$BASH_VERSION" ]; then echo bash; else echo sh; fi'
    assert _run_script(runner, started, probe) == (0, "bash\n")
    assert _run_script(runner, started, probe, run_config={"image": image_without_bash}) == (0, "sh\n")


# --- restart, collection, cleanup -----------------------------------------------------------------


def test_recover_with_a_new_runner_instance(
    make_runner: Callable[..., DockerRunner], started: TaskFactory
) -> None:
    first = make_runner()
    task = started.task(docker_fns.wait_for_file, "release")
    started.start(first, task)
    del first  # "nymph restarted": only the persisted handle survives
    second = make_runner()
    handle = Handle.load(task.workdir)
    assert handle is not None
    assert second.recover(handle) is True
    assert second.inspect(handle) == "running"
    assert second.wait(handle, 0.1) is None
    (task.workdir / "release").touch()
    status = second.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0
    assert kit.result(task) == "released"
    second.destroy(handle)
    second.destroy(handle)  # idempotent
    assert second.inspect(handle) == "gone" and second.recover(handle) is False


def test_list_labelled_finds_containers_of_a_previous_life(
    make_runner: Callable[..., DockerRunner], started: TaskFactory, kind: str
) -> None:
    worker = f"test-{RUN_ID}-{kind}"
    task = started.task(docker_fns.hang, False, labels={"nymph.worker": worker})
    handle = started.start(make_runner(), task)
    # once the task has written into its workdir (else its write races the removal: "Directory
    # not empty", seen once in the full suite on a loaded machine)
    kit.until(lambda: (task.workdir / "started").exists(), "the task to start")
    shutil.rmtree(task.workdir)  # the previous life's workdir is gone; the container is not
    later = make_runner()
    found = later.list_labelled(worker_id=worker)
    assert [(h.invocation_id, h.data["container_id"]) for h in found] == [
        (task.invocation_id, handle.data["container_id"])
    ]
    assert found[0].runner == kind and found[0].data["workdir"] == str(task.workdir)
    later.stop(found[0], 0.5)
    later.destroy(found[0])
    assert later.list_labelled(worker_id=worker) == []
    assert later.inspect(handle) == "gone"


# --- refusals -------------------------------------------------------------------------------------


def test_an_image_not_allowed_is_refused(runner: DockerRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.noop, run_config={"image": "evil.example/miner:latest"})
    with pytest.raises(RunnerError, match=r"image 'evil.example/miner:latest' is not allowed"):
        runner.start(task)


def test_a_missing_image_with_pull_never_is_a_clear_error(
    make_runner: Callable[..., DockerRunner], started: TaskFactory
) -> None:
    runner = make_runner(allowed_images=["lakeshore-missing/"])
    task = started.task(docker_fns.noop, run_config={"image": "lakeshore-missing/none:1"})
    with pytest.raises(RunnerError, match=r"'lakeshore-missing/none:1' is not present .* pull='never'"):
        runner.start(task)
    with pytest.raises(RunnerUnavailable, match="not present"):
        make_runner(image="lakeshore-missing/none:1").check()


def test_an_unreachable_engine_is_unavailable_with_what_to_do(tmp_path: Path) -> None:
    runner = DockerRunner(docker_host=f"unix://{tmp_path}/no-docker.sock")
    with pytest.raises(RunnerUnavailable, match=r"not reachable.*dockerd.*DOCKER_HOST"):
        runner.check()
    task = Task(ids.new_ulid(), 1, tmp_path, {})
    with pytest.raises(RunnerUnavailable):
        runner.start(task)


# --- gvisor only ----------------------------------------------------------------------------------


def test_gvisor_check_says_how_to_register_a_missing_runtime(image: str) -> None:
    runner = GVisorRunner(image=image, pull="never", runtime="runsc-not-registered")
    with pytest.raises(RunnerUnavailable, match=r"no 'runsc-not-registered' runtime.*daemon\.json.*HUP"):
        runner.check()


@pytest.fixture
def gvisor(image: str) -> GVisorRunner:
    require("runsc" in (runtimes() or {}), "needs the runsc runtime registered with Docker")
    return GVisorRunner(image=image, pull="never", code_dirs=[str(ROOT)])


def test_gvisor_root_is_read_only_with_a_private_tmp(gvisor: GVisorRunner, started: TaskFactory) -> None:
    script = "touch /tmp/x && echo tmp-writable; touch /etc/x 2>/dev/null || echo root-read-only"
    assert _run_script(gvisor, started, script) == (0, "tmp-writable\nroot-read-only\n")


def test_gvisor_low_pids_limit_is_raised_not_fatal(gvisor: GVisorRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.add, 1, 1, run_config={"resources": {"pids": 64}})
    status = gvisor.wait(started.start(gvisor, task), LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task) == 2


def _containers_of(task: Task) -> list[str]:
    out = docker("ps", "-a", "-q", "--no-trunc", "--filter", f"label=nymph.invocation={task.invocation_id}")
    return out.stdout.split()


@pytest.mark.parametrize("lost", ["create", "start"])
def test_a_start_tried_again_after_a_lost_answer_leaves_one_container(
    runner: DockerRunner, started: TaskFactory, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    """The engine did the work but its answer never came: the retry finds that container, never a second."""
    import docker.models.containers
    import requests.exceptions

    task = started.task(docker_fns.add, 2, 3)
    models = docker.models.containers
    cls: Any = models.ContainerCollection if lost == "create" else models.Container
    real = getattr(cls, lost)

    def do_it_then_lose_the_answer(self: Any, *args: Any, **kwargs: Any) -> Any:
        real(self, *args, **kwargs)
        raise requests.exceptions.ConnectionError("connection reset (the answer was lost)")

    monkeypatch.setattr(cls, lost, do_it_then_lose_the_answer)
    with pytest.raises(RunnerUnavailable):
        runner.start(task)
    first = _containers_of(task)
    assert len(first) == 1  # the engine made it although nymph never heard
    monkeypatch.undo()
    handle = started.start(runner, task)  # what nymph does with RunnerUnavailable: start again
    assert _containers_of(task) == [handle.data["container_id"]]
    if lost == "start":  # it ran: adopted, not started a second time
        assert handle.data["container_id"] == first[0]
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task) == 5
    runner.destroy(handle)
    assert _containers_of(task) == []


def test_a_container_of_the_same_name_that_is_not_this_tasks_is_refused(
    runner: DockerRunner, started: TaskFactory, image: str
) -> None:
    from nymph.runnerkit import task_name

    task = started.task(docker_fns.add, 1, 1)
    name = task_name(task)
    made = docker("create", "--name", name, "--label", f"{RUN_LABEL}={RUN_ID}", image, "true")
    assert made.returncode == 0, made.stderr
    try:
        with pytest.raises(RunnerError, match="not this task's"):
            runner.start(task)
    finally:
        docker("rm", "-f", name)
