"""The kube runner against a fake Kubernetes API over real HTTP (``kube_fake.py``), and a real cluster.

The official client talks HTTP to the fake through a kubeconfig; the fake's kubelet runs each pod's
command as a local process in the hostPath workdir, so the workdir contract (args.msgpack in,
result.msgpack / error.json out) runs end to end through the entry bundle the runner mounts. The
last test uses a real cluster when ``KUBECONFIG`` points at one and is skipped otherwise.

The pod's PYTHONPATH holds only the bundle: user code comes with the image. The fake's "image" is an
interpreter with this repository's code installed (:func:`_image`); the README module's test uses a
bare one, the system python3 without msgpack, with only ``tests/user_code`` installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import ids
from dreamlake.lakeshore.envelope import Envelope
from nymph.codecache import CodeCache, code_env
from nymph.runner import Handle, Runner, RunnerError, RunnerUnavailable
from nymph.runnerkit import CODE_TARGET, task_name
from nymph_kube import KubeRunner, podspec
from tests import code_kit, docker_fns, nymph_fns
from tests import runner_kit as kit
from tests.conftest import ROOT, require
from tests.integration.kube_fake import KubeFake
from tests.runner_kit import TaskFactory
from tests.stack.wait import until

pytestmark = pytest.mark.timeout(120)

LIMIT_S = 60.0
NS = "lakeshore"
NODE = "node-1"
OWNER = 10001  # a non-root owner for workdirs when the tests run as root (pods run as non-root)


def _image(tmp_path: Path, python: str, code: Path) -> str:
    """An "image" for the fake kubelet: ``python`` with ``code`` installed (after the pod's PYTHONPATH)."""
    path = tmp_path / "image-python3"
    path.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH}}:{code}" exec {python} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[KubeFake]:
    scratch = tmp_path / "kubelet"
    scratch.mkdir()
    with KubeFake(namespaces={NS}, python=_image(tmp_path, sys.executable, ROOT), scratch=scratch) as f:
        yield f


@pytest.fixture
def make_runner(fake: KubeFake, tmp_path: Path) -> Callable[..., KubeRunner]:
    config = fake.kubeconfig(tmp_path / "kubeconfig")

    def _make(**options: Any) -> KubeRunner:
        base: dict[str, Any] = {"namespace": NS, "node_name": NODE, "kubeconfig": str(config)}
        return KubeRunner(**{**base, **options})

    return _make


@pytest.fixture
def runner(make_runner: Callable[..., KubeRunner]) -> KubeRunner:
    return make_runner()


def _factory(root: Path) -> TaskFactory:
    """Tasks in fresh workdirs under one workdir root, owned by a non-root user when we are root."""
    return TaskFactory(
        root,
        env_extra={"PYTHONPATH": "/x"},
        labels_extra={"nymph.worker": "W1"},
        owner=(OWNER, OWNER) if os.geteuid() == 0 else None,
    )


@pytest.fixture
def started(tmp_path: Path) -> Iterator[TaskFactory]:
    """Starts tasks under tmp_path/work and destroys every pod at teardown."""
    root = tmp_path / "work"
    root.mkdir()
    s = _factory(root)
    yield s
    s.destroy_all(ignore=(RunnerUnavailable,))  # a test may have taken the API away


def _created(fake: KubeFake) -> dict[str, Any]:
    posts = fake.calls("POST", "/pods")
    assert len(posts) == 1
    body: dict[str, Any] = posts[0].body
    return body


# --- the pod spec ---------------------------------------------------------------------------------


def test_is_a_runner_with_its_capabilities(runner: KubeRunner) -> None:
    assert isinstance(runner, Runner)
    assert runner.name == "kube"
    caps = runner.capabilities
    assert caps.as_user and caps.gpus and caps.resources and caps.image and caps.recover
    assert not caps.network


def test_pod_spec_is_locked_down_and_carries_the_workdir(
    make_runner: Callable[..., KubeRunner], started: TaskFactory, fake: KubeFake
) -> None:
    runner = make_runner(
        service_account="nymph-tasks",
        node_selector="pool=gpu,zone=a",
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        users={"alice": "1234:2345"},
    )
    task = started.task(
        docker_fns.add,
        1,
        2,
        as_user="alice",
        gpus=["0", "1"],
        run_config={"resources": {"cpus": 1.5, "memory": "256Mi", "shm": "64m"}},
        labels={"team": "ml", "bad label!": "x"},
    )
    started.start(runner, task)
    pod = _created(fake)
    meta, spec = pod["metadata"], pod["spec"]
    assert podspec.valid_name(meta["name"]) and len(meta["name"]) <= 63
    assert meta["namespace"] == NS
    assert meta["labels"] == {
        "nymph.invocation": task.invocation_id,
        "nymph.attempt": "1",
        "nymph.worker": "W1",
        "nymph.runner": "kube",
        "app.kubernetes.io/managed-by": "nymph",
        "team": "ml",
    }
    assert meta["annotations"] == {"nymph.workdir": str(task.workdir.resolve()), "nymph.script": "0"}
    assert spec["restartPolicy"] == "Never"
    assert spec["nodeName"] == NODE
    assert spec["nodeSelector"] == {"pool": "gpu", "zone": "a"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["serviceAccountName"] == "nymph-tasks"
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1234, "runAsGroup": 2345}
    (container,) = spec["containers"]
    assert container["command"] == ["python3", "-m", "dreamlake.lakeshore.daemon.entry"]
    assert container["workingDir"] == "/work/inv"
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1234,
        "runAsGroup": 2345,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    limits = {"cpu": "1500m", "memory": str(256 * 1024 * 1024), "nvidia.com/gpu": "2"}
    assert container["resources"] == {"requests": limits, "limits": limits}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PYTHONPATH"] == "/opt/lakeshore/entry.zip"  # nymph's own PYTHONPATH means nothing there
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin picks the GPUs
    assert env["LAKESHORE_INVOCATION_ID"] == task.invocation_id
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["workdir"] == {
        "name": "workdir",
        "hostPath": {"path": str(task.workdir.resolve()), "type": "Directory"},
    }
    bundle = Path(volumes["entry-bundle"]["hostPath"]["path"])
    assert volumes["entry-bundle"]["hostPath"]["type"] == "File"
    assert bundle.parent == started.root.resolve() / ".lakeshore-bundle" and bundle.is_file()
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(64 * 1024**2)}}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/opt/lakeshore/entry.zip"]["readOnly"] is True
    assert set(mounts) == {"/work/inv", "/opt/lakeshore/entry.zip", "/tmp", "/dev/shm"}


def test_pod_spec_validates_against_the_kubernetes_schema(
    runner: KubeRunner, started: TaskFactory, fake: KubeFake
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    started.start(runner, started.task(None, script="true", run_config={"resources": {"memory": "1g"}}))
    kubernetes_validate.validate(_created(fake), "1.30", strict=True)


def test_script_command_and_persistent_volume_claim(
    make_runner: Callable[..., KubeRunner], started: TaskFactory
) -> None:
    runner = make_runner(workdir_volume="persistentVolumeClaim", workdir_claim="nymph-work")
    task = started.task(None, script="echo hi")
    pod = runner.manifest(task, task.workdir.resolve(), "python:3.11-slim")
    spec = pod["spec"]
    assert "nodeName" not in spec  # a ReadWriteMany claim lets the pod land anywhere
    assert spec["containers"][0]["command"] == ["sh", "-c", podspec.SCRIPT_SHIM, "sh", "echo hi"]
    assert spec["volumes"][0] == {"name": "workdir", "persistentVolumeClaim": {"claimName": "nymph-work"}}
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/work/inv"]["subPath"] == task.invocation_id
    assert mounts["/opt/lakeshore/entry.zip"]["subPath"].startswith(".lakeshore-bundle/lakeshore-entry-")
    assert pod["metadata"]["annotations"]["nymph.script"] == "1"


def test_a_shipped_code_archive_rides_the_workdir_claim(
    make_runner: Callable[..., KubeRunner], started: TaskFactory
) -> None:
    runner = make_runner(workdir_volume="persistentVolumeClaim", workdir_claim="nymph-work")
    task = started.task(docker_fns.noop)
    sha = "a" * 64
    task.code_dirs = [started.root.resolve() / ".code" / sha]
    pod = runner.manifest(task, task.workdir.resolve(), "python:3.11-slim")
    spec = pod["spec"]
    assert not [v for v in spec["volumes"] if v["name"].startswith("code-")]  # no hostPath left
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts[f"{CODE_TARGET}/{sha}"] == {
        "name": "workdir",
        "mountPath": f"{CODE_TARGET}/{sha}",
        "readOnly": True,
        "subPath": f".code/{sha}",
    }
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env["LAKESHORE_CODE_PATH"] == f"{CODE_TARGET}/{sha}"


def test_refusals_before_anything_is_created(
    make_runner: Callable[..., KubeRunner], started: TaskFactory, fake: KubeFake
) -> None:
    runner = make_runner(users={"root": "0:0"}, allowed_images=["ghcr.io/acme/"])
    with pytest.raises(RunnerError, match="runAsNonRoot"):
        runner.start(started.task(docker_fns.noop, as_user="root"))
    with pytest.raises(RunnerError, match="not allowed"):
        runner.start(started.task(docker_fns.noop, run_config={"image": "evil:latest"}))
    with pytest.raises(RunnerError, match="pids"):
        runner.start(started.task(docker_fns.noop, run_config={"resources": {"pids": 100}}))
    with pytest.raises(RunnerError, match="unknown keys"):
        runner.start(started.task(docker_fns.noop, run_config={"resources": {"disk": 1}}))
    assert fake.calls("POST") == []
    with pytest.raises(RunnerError, match="image_pull_policy"):
        make_runner(image_pull_policy="sometimes")
    with pytest.raises(RunnerError, match="workdir_volume"):
        make_runner(workdir_volume="nfs")


def test_start_tried_again_after_a_lost_create_answer_adopts_the_pod(
    runner: KubeRunner, started: TaskFactory, fake: KubeFake
) -> None:
    task = started.task(docker_fns.add, 2, 3)
    fake.lost_answers = 1
    with pytest.raises(RunnerUnavailable):  # the API created the pod; its answer never came
        runner.start(task)
    assert len(fake.pods) == 1
    handle = started.start(runner, task)  # what the job does after RunnerUnavailable: start again
    assert len(fake.calls("POST", "/pods")) == 2 and len(fake.pods) == 1  # 409, adopted: no second pod
    assert handle.data["pod"] == task_name(task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task) == 5


def test_a_pod_of_the_same_name_that_is_not_this_tasks_is_refused(
    runner: KubeRunner, started: TaskFactory, fake: KubeFake
) -> None:
    task = started.task(docker_fns.add, 2, 3)
    other = started.task(docker_fns.add, 2, 3)
    manifest = runner.manifest(other, other.workdir.resolve(), runner.image)
    manifest["metadata"]["name"] = task_name(task)  # squatting on this task's name
    assert runner._client().create(manifest) is not None
    with pytest.raises(RunnerError, match="not this task's"):
        runner.start(task)
    assert len(fake.pods) == 1
    runner.destroy(Handle("kube", other.invocation_id, 1, {"pod": task_name(task)}))


# --- the workdir contract through the fake kubelet ------------------------------------------------


def test_plain_result(runner: KubeRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.add, 2, 3)
    handle = started.start(runner, task)
    assert handle.runner == "kube" and Handle.load(task.workdir) == handle
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0 and status.reason is None, status
    assert kit.result(task) == 5
    assert runner.inspect(handle) == "exited"


@pytest.mark.parametrize("size", [1024, 300 * 1024], ids=["1KiB", "300KiB"])
def test_big_arguments_and_results_cross_the_host_path(
    runner: KubeRunner, started: TaskFactory, size: int
) -> None:
    """An args.msgpack nymph fetched by reference (args_ref) and a result it will ship back by
    reference are plain workdir files to the pod (tests/integration/test_payload_refs.py has the
    control-plane side)."""
    data = os.urandom(size)
    task = started.task(docker_fns.echo_bytes, data)
    handle = started.start(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert kit.result(task) == data[::-1]


def test_readme_module_runs_in_a_bare_image(make_runner: Callable[..., KubeRunner], tmp_path: Path) -> None:
    bare = "/usr/bin/python3"
    probe = subprocess.run([bare, "-s", "-c", "import msgpack"], capture_output=True, env={})
    require(os.path.exists(bare) and probe.returncode != 0, f"{bare} without msgpack (a bare runtime)")
    readme = kit.user_module("readme_udfs")
    scratch = tmp_path / "bare-kubelet"
    scratch.mkdir()
    root = tmp_path / "bare-work"
    root.mkdir()
    factory = _factory(root)
    with KubeFake(namespaces={NS}, python=_image(tmp_path, bare, kit.USER_CODE), scratch=scratch) as f:
        runner = KubeRunner(namespace=NS, node_name=NODE, kubeconfig=str(f.kubeconfig(tmp_path / "kc")))
        try:
            with dls.scope("scenes/0007"):
                tasks = [factory.task(readme.nested, [3, 1, 2]), factory.task(readme.keys, "x.png")]
            tasks.append(factory.task(readme.fail, "no luck"))
            for task, code in zip(tasks, (0, 0, 1), strict=True):
                status = runner.wait(factory.start(runner, task), LIMIT_S)
                assert status is not None and status.exit_code == code, status
        finally:
            factory.destroy_all()
            runner.close()
    nested, keys, failed = tasks
    assert kit.result(nested) == {
        "top": [2, 3],
        "inner": "who",
        "outer": "nested",
        "id": nested.invocation_id,
    }
    assert kit.result(keys)["inner"] == "scenes/0007/frames/x.png"
    error = json.loads((failed.workdir / "error.json").read_text())
    assert error["type"] == "ValueError" and "in fail" in error["traceback"]


def test_failure_leaves_error_json_and_the_log(runner: KubeRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.boom, "no luck")
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code == 1 and status.reason is None, status
    error = json.loads((task.workdir / "error.json").read_text())
    assert error["type"] == "ValueError" and error["message"] == "no luck"


def test_script_output_lands_in_stdout_log(runner: KubeRunner, started: TaskFactory) -> None:
    task = started.task(None, script="echo out; echo err >&2; exit 3")
    status = runner.wait(started.start(runner, task), LIMIT_S)
    assert status is not None and status.exit_code == 3, status
    assert (task.workdir / "stdout.log").read_text() == "out\n"  # as written, apart: the shim
    assert (task.workdir / "stderr.log").read_text() == "err\n"  # appends them to the workdir
    assert status.logs is not None and "out" in status.logs


def test_a_function_s_output_reaches_the_workdir_while_the_pod_runs(
    runner: KubeRunner, started: TaskFactory
) -> None:
    """The entry in the pod appends fd 1/2 to the hostPath workdir's logs: nymph streams them live
    (the pod log holds nothing of it, so nothing is appended twice at the end)."""
    task = started.task(nymph_fns.chatty, "release")
    handle = started.start(runner, task)
    kit.until(lambda: "from a child process" in _read(task, "stdout.log"), "the output while the pod runs")
    assert runner.inspect(handle) == "running"
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert _read(task, "stdout.log") == "hello from print\nfrom a child process\nafter the gate\n"
    assert _read(task, "stderr.log") == "careful, stderr\n"


def _read(task: Any, name: str) -> str:
    try:
        return (task.workdir / name).read_text()
    except FileNotFoundError:
        return ""


def test_wait_with_a_timeout_returns_none_while_running(runner: KubeRunner, started: TaskFactory) -> None:
    task = started.task(docker_fns.hang, False)
    handle = started.start(runner, task)
    until(lambda: (task.workdir / "started").exists(), "the task to start")
    assert runner.wait(handle, 0) is None
    assert runner.wait(handle, 0.3) is None
    assert runner.inspect(handle) == "running"


def test_oom_killed_reason(runner: KubeRunner, started: TaskFactory, fake: KubeFake) -> None:
    task = started.task(docker_fns.hang, False)
    handle = started.start(runner, task)
    until(lambda: (task.workdir / "started").exists(), "the task to start")
    fake.oom_kill(NS, handle.data["pod"])
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 137 and status.reason == "OOMKilled", status


@pytest.mark.parametrize("deaf", [False, True], ids=["sigterm", "sigkill-after-grace"])
def test_stop_deletes_with_the_grace(
    runner: KubeRunner, started: TaskFactory, fake: KubeFake, deaf: bool
) -> None:
    task = started.task(docker_fns.hang, deaf)
    handle = started.start(runner, task)
    until(lambda: (task.workdir / "started").exists(), "the task to start")
    runner.stop(handle, 1.2)
    (delete,) = fake.calls("DELETE", "/pods/" + handle.data["pod"])
    assert delete.query["gracePeriodSeconds"] == ["2"]  # whole seconds, rounded up
    until(lambda: runner.inspect(handle) == "gone", "the pod to go")
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == -1 and status.reason == "pod deleted by stop"


def test_destroy_is_idempotent(runner: KubeRunner, started: TaskFactory, fake: KubeFake) -> None:
    handle = started.start(runner, started.task(docker_fns.hang, False))
    runner.destroy(handle)
    until(lambda: runner.inspect(handle) == "gone", "the pod to go")
    runner.destroy(handle)  # 404: fine
    never = Handle(runner="kube", invocation_id=ids.new_ulid(), attempt=1, data={"pod": "nymph-never"})
    runner.destroy(never)
    assert not runner.recover(never) and runner.inspect(never) == "gone"
    assert fake.calls("DELETE", "/pods/" + handle.data["pod"])[0].query["gracePeriodSeconds"] == ["0"]


def test_recover_and_list_labelled_after_a_restart(
    make_runner: Callable[..., KubeRunner], started: TaskFactory
) -> None:
    task = started.task(docker_fns.hang, False)
    handle = started.start(make_runner(), task)
    until(lambda: (task.workdir / "started").exists(), "the task to start")
    reborn = make_runner()  # a restarted nymph: a new runner, the handle from the workdir
    loaded = Handle.load(task.workdir)
    assert loaded is not None and reborn.recover(loaded)
    assert reborn.inspect(loaded) == "running"
    (listed,) = reborn.list_labelled("W1")
    assert listed.invocation_id == task.invocation_id and listed.attempt == 1
    assert listed.data["pod"] == handle.data["pod"] and listed.data["workdir"] == str(task.workdir.resolve())
    assert reborn.list_labelled("someone-else") == []
    reborn.destroy(loaded)
    until(lambda: not reborn.recover(loaded), "the pod to go")


# --- check and the API's failures -----------------------------------------------------------------


def test_check_passes_against_a_reachable_api(runner: KubeRunner) -> None:
    runner.check()


def test_check_needs_the_node_name_for_host_path(make_runner: Callable[..., KubeRunner]) -> None:
    with pytest.raises(RunnerUnavailable, match="NYMPH_RUNNER_OPT_NODE_NAME"):
        make_runner(node_name=None).check()


def test_missing_namespace_and_forbidden_are_errors(
    make_runner: Callable[..., KubeRunner], fake: KubeFake
) -> None:
    with pytest.raises(RunnerError, match="not found") as info:
        make_runner(namespace="elsewhere").check()
    assert not isinstance(info.value, RunnerUnavailable)
    fake.forbid = True
    with pytest.raises(RunnerError, match="403") as info:
        make_runner().check()
    assert not isinstance(info.value, RunnerUnavailable)
    assert info.value.__cause__ is not None


def test_api_down_is_runner_unavailable(runner: KubeRunner, started: TaskFactory, fake: KubeFake) -> None:
    handle = started.start(runner, started.task(docker_fns.hang, False))
    fake.stop()
    for call in (runner.check, lambda: runner.inspect(handle), lambda: runner.wait(handle, 0)):
        with pytest.raises(RunnerUnavailable, match="not reachable") as info:
            call()
        assert info.value.__cause__ is not None
    with pytest.raises(RunnerUnavailable):
        runner.start(started.task(docker_fns.noop))


def test_no_kubeconfig_is_runner_unavailable(tmp_path: Path) -> None:
    with pytest.raises(RunnerUnavailable, match="no usable Kubernetes configuration"):
        KubeRunner(node_name=NODE, kubeconfig=str(tmp_path / "missing")).check()


# --- a real cluster -------------------------------------------------------------------------------


def test_against_a_real_cluster(tmp_path: Path) -> None:
    """With KUBECONFIG: check() and list_labelled(); a full run only when the workdir is on the node.

    ``LAKESHORE_TEST_KUBE_NODE`` names a node that sees ``LAKESHORE_TEST_KUBE_WORKDIR`` (a hostPath
    also visible here, e.g. a kind extraMount); ``LAKESHORE_TEST_KUBE_NAMESPACE`` (default
    ``default``) the namespace. No cluster can exist on the dev box or in CI: a plain skip.
    """
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig or not Path(kubeconfig.split(os.pathsep)[0]).is_file():
        pytest.skip("no real cluster: KUBECONFIG does not point at a kubeconfig file")
    namespace = os.environ.get("LAKESHORE_TEST_KUBE_NAMESPACE", "default")
    node = os.environ.get("LAKESHORE_TEST_KUBE_NODE")
    runner = KubeRunner(namespace=namespace, node_name=node or "unused", image="python:3.11-slim")
    runner.check()
    assert isinstance(runner.list_labelled(), list)
    root = os.environ.get("LAKESHORE_TEST_KUBE_WORKDIR")
    if not node or not root:
        return
    s = _factory(Path(root))
    task = s.task(None, script="echo hello from a pod")
    handle = s.start(runner, task)
    try:
        status = runner.wait(handle, 300)
        assert status is not None and status.exit_code == 0, status
        assert "hello from a pod" in (task.workdir / "stdout.log").read_text()
    finally:
        runner.destroy(handle)


def test_shipped_code_comes_through_the_hostpath_cache(
    runner: KubeRunner, started: TaskFactory, fake: KubeFake, tmp_path: Path
) -> None:
    """A code archive the call shipped: nymph's cache under the workdir root, a read-only hostPath
    volume at /opt/lakeshore/code/<sha256>, first on the pod's import path; an edit runs next call."""
    name = code_kit.unique_name()
    src = tmp_path / "src"
    cache = CodeCache(started.root / ".code")
    outs = []
    for version in ("one", "second"):
        code_kit.write_package(src, name, version)
        with dls.scope(code="auto"):
            task = started.task(code_kit.load(src, name).which)
        record = Envelope.from_bytes((task.workdir / "args.msgpack").read_bytes()).cfg["code"]
        task.code_dirs = [cache.acquire(record)]
        task.env.update(code_env(task.code_dirs))
        handle = started.start(runner, task)
        status = runner.wait(handle, LIMIT_S)
        assert status is not None and status.exit_code == 0, (
            status,
            (task.workdir / "stdout.log").read_text(),
        )
        outs.append((task, kit.result(task)))
    assert [out["version"] for _, out in outs] == ["one", "second"]
    for task, out in outs:  # the fake kubelet runs the pod on this host: the hostPath's own file
        assert out["file"] == str(task.code_dirs[0] / name / "__init__.py"), out
    pod = fake.calls("POST", "/pods")[-1].body
    sha = outs[-1][0].code_dirs[0].name
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "code-0")
    assert volume["hostPath"] == {"path": str(started.root / ".code" / sha), "type": "Directory"}
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "code-0")
    assert mount == {"name": "code-0", "mountPath": f"{CODE_TARGET}/{sha}", "readOnly": True}
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["LAKESHORE_CODE_PATH"] == f"{CODE_TARGET}/{sha}"
