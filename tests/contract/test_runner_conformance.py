"""The runner conformance suite: every runner plugin, driven through the Runner protocol alone.

Each test prepares a real workdir (args.msgpack holding a real Envelope of a ``@dls.udf`` function
from ``tests/nymph_fns.py``) and drives ``start / wait / stop / destroy / inspect / recover`` the way
nymph does. Runners: ``process`` always (spawned, warm-forked, and without cgroups); ``docker``
and ``gvisor`` need a Docker engine (and the runsc runtime) and an image with python3 and msgpack
in ``LAKESHORE_TEST_IMAGE`` (the bare ``lakeshore-python:bookworm`` of scripts/services/docker.sh:
no dreamlake in it); ``slurm`` a Slurm controller.

The ``readme`` tests run one user module, ``tests/user_code/readme_udfs.py``, written as the README
shows (``import dreamlake.lakeshore as dls``, ``@dls.udf(queue=...)``): a plain call, a generator, a
failure with its traceback, a scope, a nested call, a Thunk and the wire types, on every runner. A
container gets that directory alone on PYTHONPATH, so the only SDK it can import is the entry
bundle's; host runners also get the repository (their installed copy).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.envelope import Envelope
from nymph import workdir as wd
from nymph.codecache import CodeCache, code_env
from nymph.runner import Handle, Runner, Task
from nymph.runnerkit import BUNDLE_TARGET, CODE_TARGET
from tests import code_kit, nymph_fns
from tests import runner_kit as kit
from tests.conftest import ROOT

if str(ROOT / "runners") not in sys.path:  # until the editable install exposes runners/
    sys.path.insert(0, str(ROOT / "runners"))

from nymph.plugins import load_runner
from tests.runner_kit import options_for

readme = kit.user_module("readme_udfs")

# process-pgroup: the process runner without cgroups (its process-group fallback)
RUNNERS = ["process", "process-prefork", "process-warm", "process-pgroup", "docker", "gvisor", "slurm"]
LIMIT_S = 60.0


@pytest.fixture(params=RUNNERS)
def make_runner(request: pytest.FixtureRequest) -> Iterator[Callable[[], Runner]]:
    name = request.param
    options = options_for(name)
    cls = load_runner(name.split("-")[0])
    made: list[Runner] = []

    def _make() -> Runner:
        made.append(cls(**options))
        return made[-1]

    yield _make
    for made_runner in made:  # engine/API clients, the prefork runner's zygotes
        made_runner.close()


@pytest.fixture
def runner(make_runner: Callable[[], Runner]) -> Runner:
    return make_runner()


@pytest.fixture
def prepare(tmp_path: Path) -> Iterator[Callable[..., Task]]:
    factory = kit.TaskFactory(
        tmp_path, env_extra={"LAKESHORE_RUNTIME_POLICY": "minor", "PYTHONPATH": str(ROOT)}
    )
    yield factory.task
    factory.destroy_all()  # nothing recorded: the tests use kit.start_saved and destroy their own


CONTAINER_RUNNERS = ("docker", "gvisor")


@pytest.fixture
def prepare_user(tmp_path: Path, runner: Runner) -> Iterator[Callable[..., Task]]:
    """Tasks of the README module: tests/user_code alone in a container, plus the repo on the host."""
    path = str(kit.USER_CODE)
    if runner.name not in CONTAINER_RUNNERS:
        path += os.pathsep + str(ROOT)
    root = tmp_path / "user"
    root.mkdir()
    factory = kit.TaskFactory(root, env_extra={"LAKESHORE_RUNTIME_POLICY": "minor", "PYTHONPATH": path})
    yield factory.task
    factory.destroy_all()


def _run(runner: Runner, task: Task, code: int = 0) -> None:
    handle = kit.start_saved(runner, task)
    status = runner.wait(handle, LIMIT_S)
    runner.destroy(handle)
    assert status is not None and status.exit_code == code, (status, _error_text(task))


def _error_text(task: Task) -> str | None:
    path = task.workdir / "error.json"
    return path.read_text() if path.exists() else None


def test_readme_plain_call(runner: Runner, prepare_user: Callable[..., Task]) -> None:
    task = prepare_user(readme.topk, [3, 1, 2], 2)
    _run(runner, task)
    assert kit.result(task) == [2, 3]


def test_readme_generator_streams_while_running(runner: Runner, prepare_user: Callable[..., Task]) -> None:
    task = prepare_user(readme.count, 3, "release")
    handle = kit.start_saved(runner, task)
    kit.until(lambda: len(kit.frames(task.workdir)) >= 2, "two frames in the journal")
    assert runner.inspect(handle) == "running"
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    runner.destroy(handle)
    assert status is not None and status.exit_code == 0, (status, _error_text(task))
    frames = kit.frames(task.workdir)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE] * 3 + [wire.FRAME_END]
    assert [wire.unpack(f.body) for f in frames] == [0, 1, 2, "done"]  # type: ignore[arg-type]
    assert kit.result(task) == "done"


def test_readme_failure_carries_its_traceback(runner: Runner, prepare_user: Callable[..., Task]) -> None:
    import json

    task = prepare_user(readme.fail, "no luck")
    _run(runner, task, code=1)
    err = json.loads((task.workdir / "error.json").read_text())
    assert (err["type"], err["message"]) == ("ValueError", "no luck")
    assert "readme_udfs.py" in err["traceback"] and "in fail" in err["traceback"]
    assert "raise ValueError(message)" in err["traceback"]


def test_readme_scope_reaches_the_body(runner: Runner, prepare_user: Callable[..., Task]) -> None:
    with dls.scope("scenes/0007"):
        task = prepare_user(readme.keys, "x.png")
    _run(runner, task)
    assert kit.result(task) == {
        "id": task.invocation_id,
        "name": "keys",
        "key": "scenes/0007/x.png",
        "inner": "scenes/0007/frames/x.png",
    }


def test_readme_nested_call_runs_in_the_invocation(runner: Runner, prepare_user: Callable[..., Task]) -> None:
    task = prepare_user(readme.nested, [3, 1, 2])
    _run(runner, task)
    assert kit.result(task) == {"top": [2, 3], "inner": "who", "outer": "nested", "id": task.invocation_id}


def test_readme_wire_types_and_thunk(runner: Runner, prepare_user: Callable[..., Task]) -> None:
    import datetime

    task = prepare_user(readme.values)
    _run(runner, task)
    out = kit.result(task)
    assert out["tuple"] == (1, "a") and out["set"] == {2, 3} and out["bytes"] == b"\x00\xff"
    assert out["when"] == datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.UTC)
    assert out["complex"] == 1 + 2j
    assert out["plan"] == {"queue": "work", "priority": 2.0, "key": None}
    assert out["plan_fn"] == "topk"
    if runner.name in CONTAINER_RUNNERS:  # the bare image has no dreamlake: the SDK is the bundle's
        assert out["sdk"].startswith(BUNDLE_TARGET + "/"), out["sdk"]
    else:
        assert out["sdk"] == str(ROOT / "dreamlake" / "lakeshore" / "decorator.py")


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
            return False  # a zombie survived: nobody reaped it
        except psutil.NoSuchProcess:
            continue
    return True


def test_handle_names_the_runner_and_persists(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(nymph_fns.add, 2, 3)
    handle = kit.start_saved(runner, task)
    loaded = Handle.load(task.workdir)
    assert loaded == handle
    assert loaded is not None and loaded.runner == runner.name and loaded.invocation_id == task.invocation_id
    assert runner.wait(handle, LIMIT_S) is not None
    runner.destroy(handle)


def test_plain_result(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(nymph_fns.add, 2, 3)
    handle = kit.start_saved(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == 5
    assert runner.inspect(handle) in ("exited", "gone")
    runner.destroy(handle)


def test_a_result_changed_after_the_entry_wrote_it_is_damage_never_a_success(
    runner: Runner, prepare: Callable[..., Task]
) -> None:
    """The entry (the bundle's, in a container) leaves ``result.digest`` beside ``result.msgpack``,
    and what nymph acks from (``workdir.read_outcome``, the one reader for every runner) checks it:
    one byte changed inside the string value (no longer UTF-8; the msgpack structure intact) is a
    ``DamagedOutput``, never a success."""
    task = prepare(nymph_fns.env_value, "LAKESHORE_INVOCATION_ID")
    handle = kit.start_saved(runner, task)
    status = runner.wait(handle, LIMIT_S)
    runner.destroy(handle)
    assert status is not None and status.exit_code == 0, (status, _error_text(task))
    ok = wd.read_outcome(task.workdir, status)
    assert ok.state == "succeeded" and wire.unpack(ok.result_blob) == task.invocation_id, ok
    assert (task.workdir / "result.digest").exists()
    data = (task.workdir / "result.msgpack").read_bytes()
    at = data.index(task.invocation_id.encode()) + 3
    (task.workdir / "damaged").write_bytes(data[:at] + b"\xff" + data[at + 1 :])
    os.replace(task.workdir / "damaged", task.workdir / "result.msgpack")  # whoever owns the old one
    out = wd.read_outcome(task.workdir, status)
    assert out.state == "failed" and out.error is not None and out.error["type"] == "DamagedOutput", out
    assert "changed between the entry writing it and nymph reading it" in out.error["message"], out


def test_generator_frames_appear_while_running(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(nymph_fns.slow_count, 3, 0.0, "release")
    handle = kit.start_saved(runner, task)
    kit.until(lambda: len(kit.frames(task.workdir)) >= 2, "two frames in the journal")
    assert runner.inspect(handle) == "running"  # the body waits for the release: frames came first
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0
    frames = kit.frames(task.workdir)
    assert [f.kind for f in frames] == [wire.FRAME_VALUE] * 3 + [wire.FRAME_END]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 2]  # type: ignore[arg-type]
    runner.destroy(handle)


def test_failure_leaves_error_json(runner: Runner, prepare: Callable[..., Task]) -> None:
    import json

    task = prepare(nymph_fns.boom, "no luck")
    handle = kit.start_saved(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 1
    err = json.loads((task.workdir / "error.json").read_text())
    assert err["type"] == "ValueError" and err["message"] == "no luck" and "boom" in err["traceback"]
    runner.destroy(handle)


def test_wait_times_out_then_stop_ladder_kills_a_sigterm_ignoring_tree(
    runner: Runner, prepare: Callable[..., Task]
) -> None:
    task = prepare(nymph_fns.stubborn_tree, 2)
    handle = kit.start_saved(runner, task)
    kit.until(lambda: (task.workdir / "pids.txt").exists(), "the tree to start")
    assert runner.wait(handle, 0.2) is None  # still running: wait gives up, nothing is killed
    assert runner.inspect(handle) == "running"
    runner.stop(handle, 0.3)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code != 0
    assert runner.inspect(handle) in ("exited", "gone")
    runner.destroy(handle)
    if runner.name == "process":  # host pids: every process of the tree is gone and reaped
        pids = [int(p) for p in (task.workdir / "pids.txt").read_text().split()]
        assert _gone(pids), [p for p in pids if psutil.pid_exists(p)]


def test_script_runs_bash_with_logs_and_exit_code(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(None, script="echo to-out; echo to-err >&2; exit 3")
    handle = kit.start_saved(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 3
    assert (task.workdir / "stdout.log").read_text() == "to-out\n"
    assert (task.workdir / "stderr.log").read_text() == "to-err\n"
    runner.destroy(handle)


def _text(task: Task, name: str) -> str:
    try:
        return (task.workdir / name).read_text()
    except FileNotFoundError:
        return ""


def test_output_reaches_the_workdir_logs_while_the_function_runs(
    runner: Runner, prepare: Callable[..., Task]
) -> None:
    """print() (unflushed), stderr and a child process's output are in stdout.log / stderr.log
    before the function ends, on every runner: that is what nymph streams as LOG frames."""
    task = prepare(nymph_fns.chatty, "release")
    handle = kit.start_saved(runner, task)
    kit.until(
        lambda: (
            # whole lines: an unbuffered child writes a line's text and its newline separately
            "from a child process\n" in _text(task, "stdout.log")
            and "careful, stderr\n" in _text(task, "stderr.log")
        ),
        "the output in the workdir logs",
    )
    assert runner.inspect(handle) == "running"  # the function waits for the release: output came first
    assert _text(task, "stdout.log") == "hello from print\nfrom a child process\n"
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    runner.destroy(handle)
    assert status is not None and status.exit_code == 0, (status, _error_text(task))
    assert kit.result(task) == "talked"
    assert _text(task, "stdout.log") == "hello from print\nfrom a child process\nafter the gate\n"
    assert _text(task, "stderr.log") == "careful, stderr\n"


def test_script_output_reaches_the_logs_while_it_runs(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(None, script="echo before; while [ ! -e release ]; do sleep 0.05; done; echo after")
    handle = kit.start_saved(runner, task)
    kit.until(lambda: _text(task, "stdout.log") == "before\n", "the script's first line in stdout.log")
    assert runner.inspect(handle) == "running"
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    runner.destroy(handle)
    assert status is not None and status.exit_code == 0, status
    assert _text(task, "stdout.log") == "before\nafter\n"


def test_recover_after_restart_reattaches_to_the_same_task(
    make_runner: Callable[[], Runner], prepare: Callable[..., Task]
) -> None:
    first = make_runner()
    task = prepare(nymph_fns.wait_for_file, "release")
    kit.start_saved(first, task)
    del first  # "nymph restarted": a new runner instance, only the persisted handle survives
    second = make_runner()
    handle = Handle.load(task.workdir)
    assert handle is not None
    assert second.recover(handle) is True
    assert second.inspect(handle) == "running"
    assert second.wait(handle, 0.1) is None
    (task.workdir / "release").touch()
    status = second.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == "released"
    second.destroy(handle)
    assert second.recover(handle) is False  # finished: nothing to re-attach to


def test_close_releases_the_runner_and_its_tasks_run_on(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(nymph_fns.wait_for_file, "release")
    handle = kit.start_saved(runner, task)
    assert runner.inspect(handle) == "running"
    runner.close()  # nymph's shutdown: clients and helpers go, the task does not
    runner.close()  # and twice is fine
    assert runner.inspect(handle) == "running"  # the runner still answers (it reconnects)
    (task.workdir / "release").touch()
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == "released"
    runner.destroy(handle)


def test_destroy_leaves_nothing_and_is_idempotent(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(nymph_fns.stubborn_tree, 2)
    handle = kit.start_saved(runner, task)
    kit.until(lambda: (task.workdir / "pids.txt").exists(), "the tree to start")
    runner.destroy(handle)
    assert runner.inspect(handle) in ("exited", "gone")
    runner.destroy(handle)
    if runner.name == "process":
        pids = [int(p) for p in (task.workdir / "pids.txt").read_text().split()]
        assert _gone(pids)


def test_env_reaches_the_task(runner: Runner, prepare: Callable[..., Task]) -> None:
    task = prepare(nymph_fns.env_value, "LAKESHORE_INVOCATION_ID")
    handle = kit.start_saved(runner, task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0
    assert wire.unpack((task.workdir / "result.msgpack").read_bytes()) == task.invocation_id
    runner.destroy(handle)


def _marked(marker: str) -> list[int]:
    """Live (non-zombie) processes on this host with ``marker`` on their command line."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.pid)
    return found


@pytest.mark.parametrize("ending", ["stopped", "exited"])
def test_setsid_descendants_die_with_the_task(
    runner: Runner, prepare: Callable[..., Task], ending: str
) -> None:
    """Daemons that left the task's session (fork, setsid, fork) and ignore SIGTERM die with it:
    on a stop (cancel, timeout, lease loss, shutdown all use it) and when the task just exits."""
    import uuid

    marker = f"nymph-test-daemon-{uuid.uuid4().hex}"
    task = prepare(nymph_fns.setsid_daemons, 2, marker, None if ending == "stopped" else "release")
    handle = kit.start_saved(runner, task)
    kit.until(lambda: (task.workdir / "daemons.txt").exists(), "the daemons to start")
    assert len((task.workdir / "daemons.txt").read_text().split()) == 2
    host_visible = runner.name != "gvisor"  # gVisor's processes live inside its sandbox
    if host_visible:  # a daemon's pid is recorded before it execs the command line with the marker
        kit.until(lambda: len(_marked(marker)) == 2, "the daemons to exec")
    if ending == "stopped":
        runner.stop(handle, 0.3)
        status = runner.wait(handle, LIMIT_S)
        assert status is not None and status.exit_code != 0
    else:
        (task.workdir / "release").touch()  # the task returns; its daemons are still running
        status = runner.wait(handle, LIMIT_S)
        assert status is not None and status.exit_code == 0, status
    runner.destroy(handle)
    assert runner.inspect(handle) in ("exited", "gone")
    if host_visible:
        assert _marked(marker) == []


# --- code archives shipped with the call (issue 13) ------------------------------------------------


def _ship(factory: kit.TaskFactory, cache: CodeCache, fn: Any, *args: Any) -> Task:
    """A task of ``fn`` whose call ships its package (``code="auto"``), unpacked through nymph's
    cache and handed to the runner as nymph's Job does (``Task.code_dirs`` + the env)."""
    with dls.scope(code="auto"):
        task = factory.task(fn, *args)
    record = Envelope.from_bytes((task.workdir / "args.msgpack").read_bytes()).cfg["code"]
    task.code_dirs = [cache.acquire(record)]
    task.env.update(code_env(task.code_dirs))
    return task


def test_shipped_code_runs_first_on_the_import_path_two_versions_at_once(
    runner: Runner, tmp_path: Path
) -> None:
    """A local package no worker has installed, shipped with the call: it runs from the archive,
    ahead of a stale copy on the task's PYTHONPATH (whose src_hash the gate would refuse), an edit
    runs on the next call without a restart, and two versions in flight each run their own."""
    import json

    name = code_kit.unique_name()
    src, host = tmp_path / "src", tmp_path / "host"
    code_kit.write_package(host, name, "stale host copy")  # what an old deployment left on the host
    path = str(host) if runner.name in CONTAINER_RUNNERS else f"{host}{os.pathsep}{ROOT}"
    root = tmp_path / "work"
    root.mkdir()
    factory = kit.TaskFactory(root, env_extra={"LAKESHORE_RUNTIME_POLICY": "minor", "PYTHONPATH": path})
    cache = CodeCache(root / ".code")
    try:
        code_kit.write_package(src, name, "one")
        # the call without its archive runs the host's stale copy, which the src_hash gate refuses
        bare = factory.task(code_kit.load(src, name).which, "release")
        _run(runner, bare, code=2)
        err = json.loads((bare.workdir / "error.json").read_text())
        assert err["type"] == "StaleSource", err
        first = _ship(factory, cache, code_kit.load(src, name).which, "release")
        h1 = factory.start(runner, first)
        code_kit.write_package(src, name, "second")  # edited while the first version runs
        second = _ship(factory, cache, code_kit.load(src, name).which, "release")
        h2 = factory.start(runner, second)
        kit.until(lambda: runner.inspect(h1) == "running" and runner.inspect(h2) == "running", "both to run")
        assert runner.inspect(h1) == "running" and runner.inspect(h2) == "running"
        for task in (first, second):
            (task.workdir / "release").touch()
        outs = []
        for task, handle in ((first, h1), (second, h2)):
            status = runner.wait(handle, LIMIT_S)
            assert status is not None and status.exit_code == 0, (status, _error_text(task))
            outs.append(kit.result(task))
        assert [(o["version"], o["helper"]) for o in outs] == [
            ("one", "one-helper"),
            ("second", "second-helper"),
        ]
        for task, out in zip((first, second), outs, strict=True):
            where = Path(CODE_TARGET) if runner.name in CONTAINER_RUNNERS else task.code_dirs[0].parent
            shipped = where / task.code_dirs[0].name / name / "__init__.py"
            assert out["file"] == str(shipped), out
            assert out["sys_path0"].startswith(str(shipped.parent.parent)), out  # first, for subprocesses too
        assert cache.fetches == 2
        # the second version again: the cache hit, nothing unpacked, the same files run
        again = _ship(factory, cache, code_kit.load(src, name).which)
        assert again.code_dirs == second.code_dirs and cache.fetches == 2
        _run(runner, again)
        assert kit.result(again)["file"] == outs[1]["file"]
    finally:
        factory.destroy_all()
