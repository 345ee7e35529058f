"""The process runner's warm-fork (zygote) mode, beyond the conformance suite (which runs it too).

The functions below are shipped by reference: the forked child imports this module itself, fresh
(PYTHONPATH = repo root), never the zygote.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.envelope import Envelope, fn_for
from nymph.runner import ExitStatus, Handle, Task
from tests.conftest import ROOT

if str(ROOT / "runners") not in sys.path:
    sys.path.insert(0, str(ROOT / "runners"))

import nymph_process
import nymph_process.forking
import nymph_process.prefork
from nymph_process import ProcessRunner
from nymph_process.prefork import ZygoteClient
from nymph_process.zygote import ENTRY_LOCK, ENTRY_LOCKED
from tests.stack.wait import until

LIMIT_S = 60.0
_CALLS: list[int] = []


# --- shipped functions (run in the forked child) --------------------------------------------------


def pollute() -> int:
    import json

    os.environ["PREFORK_JUNK"] = "1"
    json.PREFORK_JUNK = 1  # type: ignore[attr-defined]  # a module the zygote preloaded
    sys.modules["prefork_junk_module"] = sys
    sys.path.append("/prefork/junk")
    _CALLS.append(1)
    return os.getpid()


def observe() -> dict[str, Any]:
    _CALLS.append(1)
    return {
        "env": "PREFORK_JUNK" in os.environ,
        "module": "prefork_junk_module" in sys.modules,
        "path": "/prefork/junk" in sys.path,
        "preloaded": hasattr(sys.modules.get("json"), "PREFORK_JUNK"),
        "calls": len(_CALLS),  # 1: this module was imported fresh by this child
        "cwd": os.getcwd(),
        "sys_path0": sys.path[0],
        "invocation": os.environ.get("LAKESHORE_INVOCATION_ID"),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "session_leader": os.getsid(0) == os.getpid(),
    }


def say(text: str) -> str:
    print(text)
    print(f"err:{text}", file=sys.stderr)
    return text


def wait_release(path: str) -> str:
    while not Path(path).exists():
        time.sleep(0.02)
    return "released"


def record_run(runs: str, release: str) -> int:
    """Append this process's pid to ``runs`` (one line per run of the entry), then wait for ``release``."""
    with open(runs, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    while not Path(release).exists():
        time.sleep(0.02)
    return os.getpid()


# --- harness ---------------------------------------------------------------------------------------


@pytest.fixture
def runner() -> Iterator[ProcessRunner]:
    r = ProcessRunner(prefork=True)
    yield r
    r.close()


@pytest.fixture
def prepare(tmp_path: Path) -> Callable[..., Task]:
    def _prepare(
        fn: Callable[..., Any] | None, *args: Any, script: str | None = None, inline: bool = False
    ) -> Task:
        invocation_id = ids.new_ulid()
        workdir = tmp_path / invocation_id
        workdir.mkdir(mode=0o700)
        blob = None
        if fn is not None:
            blob = Envelope.create(fn_for(fn, "ref"), args, {}).to_bytes()
            if not inline:  # inline: handed over in the Task (Capabilities.args_inline), no file
                (workdir / "args.msgpack").write_bytes(blob)
        return Task(
            invocation_id=invocation_id,
            attempt=1,
            workdir=workdir,
            env={"LAKESHORE_INVOCATION_ID": invocation_id, "PYTHONPATH": str(ROOT)},
            script=script,
            args=blob if inline else None,
        )

    return _prepare


def _run(runner: ProcessRunner, task: Task) -> tuple[Handle, ExitStatus]:
    handle = runner.start(task)
    status = runner.wait(handle, LIMIT_S)
    assert status is not None
    return handle, status


def _result(task: Task) -> Any:
    return wire.unpack((task.workdir / "result.msgpack").read_bytes())


def _zygote_pids(runner: ProcessRunner) -> list[int]:
    return [z.pid for z in runner._zygotes.values() if z.alive]


def _zombies(pid: int) -> list[int]:
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                out.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return out


# --- tests -----------------------------------------------------------------------------------------


def test_python_tasks_are_forked_by_one_zygote(runner: ProcessRunner, prepare: Callable[..., Task]) -> None:
    parents = set()
    for _ in range(3):
        task = prepare(observe)
        handle = runner.start(task)
        parents.add(psutil.Process(handle.data["pid"]).ppid())
        status = runner.wait(handle, LIMIT_S)
        assert status is not None and status.exit_code == 0, status
        runner.destroy(handle)
    assert parents == set(_zygote_pids(runner)) and os.getpid() not in parents


def test_child_is_set_up_like_the_spawned_entry(runner: ProcessRunner, prepare: Callable[..., Task]) -> None:
    task = prepare(observe)
    handle, status = _run(runner, task)
    assert status.exit_code == 0, status
    seen = _result(task)
    assert seen["cwd"] == str(task.workdir) and seen["sys_path0"] == str(task.workdir)
    assert seen["invocation"] == task.invocation_id
    # SIGINT as a freshly spawned interpreter has it here: Python's handler, unless this test run
    # was itself started with SIGINT ignored (a background job of a non-interactive shell), which
    # a spawned entry would inherit just the same
    spawned = subprocess.run(
        [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip() == "True"  # fmt: skip
    assert seen["sigint"] == spawned and seen["session_leader"]
    assert handle.data["pgid"] == handle.data["pid"]
    runner.destroy(handle)

    task = prepare(say, "hello")
    handle, status = _run(runner, task)
    assert status.exit_code == 0
    assert (task.workdir / "stdout.log").read_text() == "hello\n"
    assert (task.workdir / "stderr.log").read_text() == "err:hello\n"
    runner.destroy(handle)


def test_state_does_not_leak_between_invocations(runner: ProcessRunner, prepare: Callable[..., Task]) -> None:
    first = prepare(pollute)
    handle, status = _run(runner, first)
    assert status.exit_code == 0, status
    runner.destroy(handle)
    second = prepare(observe)
    handle, status = _run(runner, second)
    assert status.exit_code == 0, status
    seen = _result(second)
    assert (seen["env"], seen["module"], seen["path"], seen["calls"]) == (False, False, False, 1)
    assert seen["preloaded"] is False  # a change to a module the zygote preloaded stays in its child
    runner.destroy(handle)
    # the zygote itself never imported user code
    zygote = _zygote_pids(runner)[0]
    assert "PREFORK_JUNK" not in psutil.Process(zygote).environ()


def test_arguments_in_the_task_reach_a_forked_child_by_file_never_through_the_zygote(
    runner: ProcessRunner, prepare: Callable[..., Task], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ProcessRunner.capabilities.args_inline
    sent: list[bytes] = []
    real_sendall = socket.socket.sendall

    def record(sock: Any, data: bytes) -> None:
        sent.append(bytes(data))
        real_sendall(sock, data)

    monkeypatch.setattr(socket.socket, "sendall", record)  # what nymph sends its zygotes
    forked = prepare(say, "by file, never through the zygote", inline=True)
    handle, status = _run(runner, forked)
    assert status.exit_code == 0, status
    assert handle.data["pid"] in runner._forked  # the zygote forked it
    assert _result(forked) == "by file, never through the zygote"
    assert (forked.workdir / "args.msgpack").read_bytes() == forked.args  # the runner wrote it
    assert sent and not [line for line in sent if b'"args"' in line or b"by file" in line]
    runner.destroy(handle)
    spawner = ProcessRunner(prefork=False)
    try:
        spawned = prepare(say, "from the file", inline=True)
        handle, status = _run(spawner, spawned)
        assert status.exit_code == 0, status
        assert _result(spawned) == "from the file"
        assert (spawned.workdir / "args.msgpack").read_bytes() == spawned.args  # the runner wrote it
        spawner.destroy(handle)
    finally:
        spawner.close()


def test_each_namespace_has_a_zygote_of_its_own(runner: ProcessRunner, prepare: Callable[..., Task]) -> None:
    parents: dict[str | None, set[int]] = {}
    for namespace in ("team-a", "team-b", "team-a", None, "team-b"):
        task = prepare(observe)
        task.namespace = namespace
        handle = runner.start(task)
        parents.setdefault(namespace, set()).add(psutil.Process(handle.data["pid"]).ppid())
        status = runner.wait(handle, LIMIT_S)
        assert status is not None and status.exit_code == 0, status
        runner.destroy(handle)
    assert all(len(p) == 1 for p in parents.values()), parents  # one zygote per namespace, reused
    assert len(set().union(*parents.values())) == 3 == len(_zygote_pids(runner))


def test_script_and_as_user_tasks_are_spawned(runner: ProcessRunner, prepare: Callable[..., Task]) -> None:
    task = prepare(None, script="echo $PPID")
    handle, status = _run(runner, task)
    assert status.exit_code == 0
    assert int((task.workdir / "stdout.log").read_text()) == os.getpid()
    runner.destroy(handle)


def test_zygote_killed_next_task_still_runs_and_running_one_completes(
    runner: ProcessRunner, prepare: Callable[..., Task]
) -> None:
    running = prepare(wait_release, "release")
    handle = runner.start(running)
    fresh = ProcessRunner(prefork=True)  # "nymph restarted": the handle's pid + start time re-attach
    assert fresh.recover(handle) and fresh.inspect(handle) == "running"
    (zygote,) = _zygote_pids(runner)
    os.kill(zygote, signal.SIGKILL)
    until(lambda: not _zygote_pids(runner), "the runner to notice the zygote died")

    task = prepare(observe)
    after, status = _run(runner, task)
    assert status.exit_code == 0 and _result(task)["calls"] == 1
    assert _zygote_pids(runner) and _zygote_pids(runner) != [zygote]  # restarted
    runner.destroy(after)

    assert runner.inspect(handle) == "running"  # the orphan carries on, watched like a re-attached one
    assert runner.wait(handle, 0.05) is None
    (running.workdir / "release").touch()
    orphan = runner.wait(handle, LIMIT_S)
    assert orphan is not None and orphan.exit_code == 0  # inferred from result.msgpack
    runner.destroy(handle)
    assert _result(running) == "released"
    assert not psutil.pid_exists(zygote) or psutil.Process(zygote).status() != psutil.STATUS_ZOMBIE


def test_zygote_that_cannot_start_falls_back_to_spawn(
    runner: ProcessRunner, prepare: Callable[..., Task], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken_zygote.py"
    broken.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(nymph_process.prefork, "ZYGOTE_SCRIPT", str(broken))
    for _ in range(4):  # past the failure limit: spawned from then on
        task = prepare(observe)
        handle = runner.start(task)
        assert psutil.Process(handle.data["pid"]).ppid() == os.getpid()
        status = runner.wait(handle, LIMIT_S)
        assert status is not None and status.exit_code == 0
        runner.destroy(handle)


def test_no_zombies_left_behind(runner: ProcessRunner, prepare: Callable[..., Task]) -> None:
    from tests import nymph_fns

    handles = []
    for fn, args in ((nymph_fns.add, (1, 2)), (nymph_fns.boom, ("x",)), (nymph_fns.stubborn_tree, (2,))):
        task = prepare(fn, *args)
        handles.append((task, runner.start(task)))
    stubborn_task, stubborn = handles[-1]
    until(lambda: (stubborn_task.workdir / "pids.txt").exists(), "the tree to start")
    runner.stop(stubborn, 0.1)
    for _task, handle in handles:
        assert runner.wait(handle, LIMIT_S) is not None
        runner.destroy(handle)
    (zygote,) = _zygote_pids(runner)
    assert _zombies(zygote) == [] and psutil.Process(zygote).children() == []
    # every task process (leaders, reaped by the zygote; the tree's children, reparented to this
    # subreaper and reaped by the ladder) is gone, not a zombie (other tests may leave zombies of theirs)
    pids = [int(p) for p in (stubborn_task.workdir / "pids.txt").read_text().split()]
    pids += [int(h.data["pid"]) for _t, h in handles]
    assert not [p for p in pids if psutil.pid_exists(p)]


def _runs(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_fork_answer_lost_the_child_is_adopted_never_run_twice(
    runner: ProcessRunner, prepare: Callable[..., Task], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote forks but its answer never arrives: the fallback adopts that child, runs nothing more."""
    warm = prepare(observe)  # the zygote is up (its start-up is not what times out below)
    handle, status = _run(runner, warm)
    assert status.exit_code == 0
    runner.destroy(handle)

    real_dispatch = ZygoteClient._dispatch

    def lose_fork_answers(self: ZygoteClient, msg: dict[str, Any]) -> None:
        if "id" in msg and "pid" in msg:
            return  # forked, but nymph never hears of it
        real_dispatch(self, msg)

    monkeypatch.setattr(ZygoteClient, "_dispatch", lose_fork_answers)
    monkeypatch.setattr(nymph_process, "ZYGOTE_TIMEOUT_S", 2.0)  # the entry lock's wait
    monkeypatch.setattr(nymph_process.forking, "ZYGOTE_TIMEOUT_S", 2.0)  # the fork answer's
    runs, release = tmp_path / "runs.txt", tmp_path / "release"
    task = prepare(record_run, str(runs), str(release))
    handle = runner.start(task)
    until(lambda: _runs(runs), "the entry to run")
    time.sleep(1.0)  # a second run (the bug) would have started by now
    assert _runs(runs) == [handle.data["pid"]]  # the one run is the adopted child
    assert runner.inspect(handle) == "running"
    release.touch()
    status = runner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status  # inferred from result.msgpack
    runner.destroy(handle)
    assert _result(task) == handle.data["pid"] and _runs(runs) == [handle.data["pid"]]


@pytest.mark.parametrize("spawned_one", ["running", "finished"])
def test_a_late_forked_child_never_runs_an_entry_the_runner_spawned(
    prepare: Callable[..., Task], tmp_path: Path, spawned_one: str
) -> None:
    """The other order: the runner spawned the entry (under the lock); a fork that lands after runs nothing."""
    spawner = ProcessRunner(prefork=False)
    runs, release = tmp_path / "runs.txt", tmp_path / "release"
    task = prepare(record_run, str(runs), str(release))
    handle = spawner.start(task)
    until(lambda: _runs(runs), "the spawned entry to run")
    assert (task.workdir / ENTRY_LOCK).exists()
    if spawned_one == "finished":  # the lock is free again, but the file says the entry ran
        release.touch()
        assert spawner.wait(handle, LIMIT_S) is not None
    env = {**os.environ, **task.env}
    zygote = ZygoteClient(spawner.python, env)
    try:
        child, _start = zygote.fork(task.workdir, env, LIMIT_S)
        assert child.done.wait(LIMIT_S)
        assert child.code == ENTRY_LOCKED
    finally:
        zygote.close()
    release.touch()
    status = spawner.wait(handle, LIMIT_S)
    assert status is not None and status.exit_code == 0, status
    spawner.destroy(handle)
    assert _runs(runs) == [handle.data["pid"]]


def test_zygote_exits_when_nymph_dies(tmp_path: Path) -> None:
    """nymph SIGKILLed: the zygote sees EOF and exits; what it forked carries on (tasks survive)."""
    workdir = tmp_path / ids.new_ulid()
    workdir.mkdir()
    release = workdir / "release"
    (workdir / "args.msgpack").write_bytes(
        Envelope.create(fn_for(wait_release, "ref"), (str(release),), {}).to_bytes()
    )
    code = f"""
import os, sys, signal
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "runners")!r}]
from pathlib import Path
from nymph.runner import Task
import nymph_process
from nymph_process import ProcessRunner
from nymph_process.prefork import ZygoteClient
from nymph_process.zygote import ENTRY_LOCK, ENTRY_LOCKED
r = ProcessRunner(prefork=True)
h = r.start(Task("x", 1, Path({str(workdir)!r}), {{"PYTHONPATH": {str(ROOT)!r}}}))
(z,) = [z.pid for z in r._zygotes.values()]
print(z, h.data["pid"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LIMIT_S)
    zygote, child = (int(p) for p in proc.stdout.split())

    def gone(pid: int) -> bool:
        try:
            return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return True

    until(lambda: gone(zygote), "the zygote to exit")
    assert not gone(child)  # the task survives nymph (and its zygote)
    release.touch()
    until(lambda: gone(child), "the task to finish")
    assert wire.unpack((workdir / "result.msgpack").read_bytes()) == "released"
