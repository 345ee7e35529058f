"""The process runner's warm mode (``nymph start --warm``) end to end: a real control plane over
HTTP, ``nymph start`` as a real subprocess, real warm worker processes.

What a user relies on (docs/nymph.md "Warm mode"): many calls of one function run in one worker
process that keeps its module state; a call that crashes the worker fails like a cold crash
(``ProcessExited`` with the code) and the next call gets a new worker; a cancel or a timeout kills
the worker that ran the call; pickled functions are refused unless allowed, and then run cold, as
do scripts and ``as_user`` tasks; without ``--warm`` nothing changes; a nymph killed mid-call
leaves the call running, and its next life acks it. No assertion is about speed
(``bench/warm.py`` measures that).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.envelope import Envelope, fn_for
from nymph.runner import Task
from tests import warm_fns
from tests.conftest import ROOT
from tests.host_users import ensure_user
from tests.integration.conftest import ControlPlane
from tests.stack.nymph import Nymph
from tests.stack.procs import alive, busy_descriptors
from tests.stack.producer import await_result, call, envelope, frames_of, submit
from tests.stack.wait import until

if str(ROOT / "runners") not in sys.path:
    sys.path.insert(0, str(ROOT / "runners"))

from nymph_process import ProcessRunner

WARM = ("--warm",)


def _run(cp: ControlPlane, blob: bytes, **run_config: Any) -> dict[str, Any]:
    inv = submit(cp.url, cp.producer_token, blob, **run_config)
    return await_result(cp.url, cp.producer_token, inv)


def _value(out: dict[str, Any], n: Nymph | None = None) -> Any:
    assert out["state"] == "succeeded", (out, n.output()[-3000:] if n is not None else "")
    return wire.unpack(out["result_blob"])


def _count(cp: ControlPlane, n: Nymph) -> tuple[int, int]:
    pid, calls = _value(_run(cp, envelope(warm_fns.count)), n)
    return int(pid), int(calls)


def _held(cp: ControlPlane, tmp_path: Path, **run_config: Any) -> tuple[str, int, Path]:
    """Submit ``hold``; the invocation, the pid of the process that runs it, and its release file."""
    pid_file, release = tmp_path / f"pid-{os.urandom(4).hex()}", tmp_path / f"go-{os.urandom(4).hex()}"
    inv = submit(
        cp.url, cp.producer_token, envelope(warm_fns.hold, str(pid_file), str(release)), **run_config
    )
    until(lambda: pid_file.exists() and pid_file.read_text(), "the call to start")
    return inv, int(pid_file.read_text()), release


def test_many_calls_run_in_one_worker_process_that_keeps_its_module_state(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM)
    results = [_count(cp, n) for _ in range(12)]
    pids = {pid for pid, _ in results}
    assert len(pids) == 1, results  # one worker ran every call
    (pid,) = pids
    assert n.proc is not None and pid != n.proc.pid
    assert [calls for _, calls in results] == list(range(1, 13))  # the module was imported once
    assert alive(pid), "the warm worker stays for the next call"
    # the output of each call still reaches its own LOG frames
    inv = submit(cp.url, cp.producer_token, envelope(warm_fns.count))
    out = await_result(cp.url, cp.producer_token, inv)
    assert tuple(_value(out, n)) == (pid, 13)
    logs = [f.body for f in frames_of(cp.url, cp.producer_token, inv) if f.kind == wire.FRAME_LOG]
    assert logs == [f"call 13 in {pid}\n".encode()]


def test_generators_stream_from_the_warm_worker(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM)
    pids = []
    for _ in range(2):
        inv = submit(cp.url, cp.producer_token, envelope(warm_fns.values, 5))
        pids.append(_value(await_result(cp.url, cp.producer_token, inv), n))
        frames = frames_of(cp.url, cp.producer_token, inv)
        assert [wire.unpack(f.body) for f in frames if f.kind == wire.FRAME_VALUE] == [0, 1, 2, 3, 4]
        assert frames[-1].kind == wire.FRAME_END
    assert pids[0] == pids[1]


def test_a_crash_mid_call_fails_it_like_a_cold_crash_and_the_next_call_gets_a_new_worker(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM)
    first, _ = _count(cp, n)
    out = _run(cp, envelope(warm_fns.crash, 3))
    assert out["state"] == "failed", out
    assert out["error"]["type"] == "ProcessExited"
    assert "code 3" in out["error"]["message"] and "warm worker" in out["error"]["message"]
    until(lambda: not alive(first), "the crashed worker to be gone")
    second, calls = _count(cp, n)
    assert second != first and calls == 1  # a new worker, its module imported afresh


def test_a_worker_killed_while_idle_is_replaced_at_the_next_call(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM)
    first, _ = _count(cp, n)
    os.kill(first, signal.SIGKILL)  # the OOM killer, an operator
    until(lambda: not alive(first), "the worker to die")
    second, calls = _count(cp, n)
    assert second != first and calls == 1


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_cancel_or_a_timeout_kills_the_warm_worker_and_the_pool_replaces_it(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path, how: str
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM)
    before, _ = _count(cp, n)
    inv, pid, _release = _held(cp, tmp_path, **({"timeout_s": 2} if how == "timeout" else {}))
    assert pid == before  # the held call runs in the warm worker
    if how == "cancel":
        call(cp.url, cp.producer_token, f"/v1/producer/invocations/{inv}/cancel", {})
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == ("killed" if how == "cancel" else "timeout"), out
    assert out["error"]["type"] == ("Cancelled" if how == "cancel" else "Timeout")
    until(lambda: not alive(pid), "the warm worker to be killed")
    after, calls = _count(cp, n)
    assert after != pid and calls == 1


def test_pickled_functions_are_refused_without_allow_pickled_and_run_cold_with_it(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    for name in ("strict", "loose"):
        (tmp_path / name).mkdir()
    strict = nymph_factory(cp.url, cp.daemon_token, *WARM, base=tmp_path / "strict")
    out = _run(cp, envelope(lambda: os.getpid(), transport="pickle"))
    assert out["state"] == "failed" and out["error"]["type"] == "PickleRefused", out
    assert "--allow-pickled" in out["error"]["message"]
    strict.stop()
    n = nymph_factory(cp.url, cp.daemon_token, *WARM, "--allow-pickled", base=tmp_path / "loose")
    warm, _ = _count(cp, n)
    cold = [_value(_run(cp, envelope(lambda: os.getpid(), transport="pickle")), n) for _ in range(2)]
    assert warm not in cold and cold[0] != cold[1]  # a process of its own each time
    assert _count(cp, n) == (warm, 2)  # the warm worker was not used, nor disturbed


def test_scripts_take_the_cold_path(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM, "--allow-script")
    warm, _ = _count(cp, n)
    inv = submit(cp.url, cp.producer_token, script="echo $$")
    out = await_result(cp.url, cp.producer_token, inv)
    assert _value(out, n) == {"exit_code": 0}
    logs = [f.body for f in frames_of(cp.url, cp.producer_token, inv) if f.kind == wire.FRAME_LOG]
    assert int(logs[0]) != warm  # bash, a process of its own
    assert _count(cp, n) == (warm, 2)  # the warm worker was not used, nor disturbed


def test_as_user_tasks_take_the_cold_path(tmp_path: Path) -> None:
    """At the runner (as_user needs a second user, which only root can make): a ref call with a
    user to become is started cold (a process of its own, no warm handle), one without goes warm."""
    if not ensure_user("nymphtest", "--no-create-home"):
        pytest.skip("needs root (or an existing user nymphtest) to run as another user")
    runner = ProcessRunner(warm=True, warm_workers=2)
    try:
        handles = []
        for as_user in (None, "nymphtest"):
            workdir = tmp_path / ids.new_ulid()
            workdir.mkdir(mode=0o711)
            (workdir / "args.msgpack").write_bytes(envelope(warm_fns.count))
            if as_user:
                shutil.chown(workdir, as_user)
            task = Task(
                invocation_id=workdir.name,
                attempt=1,
                workdir=workdir,
                env={"LAKESHORE_INVOCATION_ID": workdir.name, "PYTHONPATH": str(ROOT)},
                as_user=as_user,
            )
            handle = runner.start(task)
            assert runner.wait(handle, 60) is not None
            runner.destroy(handle)
            handles.append(handle)
        warm, cold = handles
        assert "warm" in warm.data and "warm" not in cold.data
        assert cold.data["pid"] != warm.data["pid"]
        assert alive(int(warm.data["pid"])) and not alive(int(cold.data["pid"]))
    finally:
        runner.close()


def test_calls_given_other_gpus_or_other_code_get_workers_of_their_own(tmp_path: Path) -> None:
    """At the runner: the devices a call was given and the code it shipped key its worker (CUDA
    initialised on one device cannot serve a call given another; one version's modules never meet
    another's); calls alike share one."""
    runner = ProcessRunner(warm=True, warm_workers=4)
    try:

        def run(env: dict[str, str]) -> tuple[int, int]:
            workdir = tmp_path / ids.new_ulid()
            workdir.mkdir(mode=0o700)
            (workdir / "args.msgpack").write_bytes(envelope(warm_fns.count))
            task = Task(
                invocation_id=workdir.name,
                attempt=1,
                workdir=workdir,
                env={"LAKESHORE_INVOCATION_ID": workdir.name, "PYTHONPATH": str(ROOT), **env},
            )
            handle = runner.start(task)
            status = runner.wait(handle, 60)
            assert status is not None and status.exit_code == 0, status
            runner.destroy(handle)
            assert "warm" in handle.data
            pid, calls = wire.unpack((workdir / "result.msgpack").read_bytes())
            return int(pid), int(calls)

        gpu0, again, gpu1 = (
            run({"CUDA_VISIBLE_DEVICES": "0"}),
            run({"CUDA_VISIBLE_DEVICES": "0"}),
            run({"CUDA_VISIBLE_DEVICES": "1"}),
        )
        assert gpu0[0] == again[0] and again[1] == 2
        assert gpu1[0] != gpu0[0] and gpu1[1] == 1
        code = tmp_path / "code"
        code.mkdir()
        shipped = run({"LAKESHORE_CODE_PATH": str(code)})
        assert shipped[0] not in (gpu0[0], gpu1[0]) and shipped[1] == 1
    finally:
        runner.close()


def test_a_nymph_past_1023_descriptors_still_runs_calls_warm(tmp_path: Path) -> None:
    """At the runner, in a process holding over a thousand descriptors (a busy nymph): its warm
    worker's socket is numbered past 1023, which ``select.select`` refused (every call's wait for
    the worker's answer raised ``ValueError``). Two calls run in one worker."""
    runner = ProcessRunner(warm=True, warm_workers=1)
    try:
        got = []
        with busy_descriptors():
            for _ in range(2):
                workdir = tmp_path / ids.new_ulid()
                workdir.mkdir(mode=0o700)
                (workdir / "args.msgpack").write_bytes(envelope(warm_fns.count))
                env = {"LAKESHORE_INVOCATION_ID": workdir.name, "PYTHONPATH": str(ROOT)}
                handle = runner.start(Task(workdir.name, 1, workdir, env=env))
                status = runner.wait(handle, 60)
                assert status is not None and status.exit_code == 0, status
                runner.destroy(handle)
                assert "warm" in handle.data
                got.append(tuple(wire.unpack((workdir / "result.msgpack").read_bytes())))
        (pid1, calls1), (pid2, calls2) = got
        assert pid1 == pid2 and (calls1, calls2) == (1, 2)
    finally:
        runner.close()


def test_a_root_nymphs_task_user_gets_warm_workers_of_its_own(tmp_path: Path) -> None:
    """A root nymph runs its tasks as its task user (``warm_users``, which ``nymph start --warm``
    fills with ``--task-user``): warm workers run as that user, many calls each; another
    ``as_user`` stays cold. The runtime is one the task user can read (the system python3 and the
    entry bundle), as docs/nymph.md says to set up for a root nymph in a private venv."""
    from dreamlake.lakeshore.daemon.bundle import build_bundle

    python = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")
    if os.geteuid() != 0 or not ensure_user("nymphtest", "--no-create-home") or not python:
        pytest.skip("needs root, a user nymphtest and a system python3")
    user = pwd.getpwnam("nymphtest")
    base = Path(tempfile.mkdtemp(prefix="nymph-warm-user-"))
    try:
        os.chmod(base, 0o711)
        runtime = base / "runtime"
        (runtime / "tests").mkdir(parents=True)
        bundle = build_bundle(runtime / "lakeshore-entry.zip")
        for name in ("__init__.py", "warm_fns.py"):
            shutil.copyfile(ROOT / "tests" / name, runtime / "tests" / name)
        for path in [runtime, *runtime.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        runner = ProcessRunner(
            python=python, pythonpath=[str(bundle), str(runtime)], warm=True, warm_users=["nymphtest"]
        )
        try:
            seen = []
            for as_user in ("nymphtest", "nymphtest", None):
                workdir = base / ids.new_ulid()
                workdir.mkdir(mode=0o700)
                (workdir / "args.msgpack").write_bytes(envelope(warm_fns.identity))
                if as_user:
                    shutil.chown(workdir, as_user, as_user)
                    os.chown(workdir / "args.msgpack", user.pw_uid, user.pw_gid)
                task = Task(
                    invocation_id=workdir.name,
                    attempt=1,
                    workdir=workdir,
                    env={"LAKESHORE_INVOCATION_ID": workdir.name},
                    as_user=as_user,
                )
                handle = runner.start(task)
                status = runner.wait(handle, 60)
                assert status is not None and status.exit_code == 0, status
                runner.destroy(handle)
                assert "warm" in handle.data
                seen.append(tuple(wire.unpack((workdir / "result.msgpack").read_bytes())))
            (a, uid_a, calls_a), (b, uid_b, calls_b), (c, uid_c, calls_c) = seen
            assert a == b and (uid_a, uid_b) == (user.pw_uid, user.pw_uid) and (calls_a, calls_b) == (1, 2)
            assert c != a and uid_c == 0 and calls_c == 1  # nymph's own user: a worker of its own
        finally:
            runner.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_without_warm_every_call_is_a_fresh_process(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    first, second = _count(cp, n), _count(cp, n)
    assert first[1] == second[1] == 1 and first[0] != second[0]
    inv, pid, release = _held(cp, tmp_path)
    handle = json.loads((n.workdir / inv / "handle.json").read_text())
    assert "warm" not in handle["data"]
    release.touch()
    assert _value(await_result(cp.url, cp.producer_token, inv), n) == pid
    until(lambda: not alive(pid), "the cold entry to exit")


def test_warm_max_calls_recycles_the_worker(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM, "--warm-max-calls", "2")
    results = [_count(cp, n) for _ in range(5)]
    a, b, c = results[0][0], results[2][0], results[4][0]
    assert [r[0] for r in results] == [a, a, b, b, c] and len({a, b, c}) == 3, results
    assert [r[1] for r in results] == [1, 2, 1, 2, 1]
    until(lambda: not alive(a) and not alive(b), "the recycled workers to exit")


def test_a_nymph_killed_mid_call_leaves_the_call_running_and_its_next_life_acks_it(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    first = nymph_factory(cp.url, cp.daemon_token, *WARM)
    warm, _ = _count(cp, first)
    inv, pid, release = _held(cp, tmp_path)
    assert pid == warm
    # killed once the call's handle is saved (the moment before it is the no-handle path, which
    # waits for the task unsupervised: tests/unit/test_nymph_lifecycle.py)
    handle = first.workdir / inv / "handle.json"
    until(lambda: handle.exists() and "warm" in json.loads(handle.read_text())["data"], "the handle")
    first.signal(signal.SIGKILL)
    first.wait()
    assert alive(pid), "the warm call must survive nymph's death, as a cold one does"
    second = nymph_factory(cp.url, cp.daemon_token, *WARM)
    until(lambda: "re-attached" in second.output(), "the new nymph to re-attach")
    release.touch()
    out = await_result(cp.url, cp.producer_token, inv)
    assert _value(out, second) == pid
    until(lambda: not alive(pid), "the orphaned worker to exit after its call")
    new, calls = _count(cp, second)
    assert new != pid and calls == 1  # the new life's own worker


def test_one_warm_worker_per_slot(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM, "--concurrency", "2")
    first, a, release_a = _held(cp, tmp_path)
    second, b, release_b = _held(cp, tmp_path)
    assert a != b  # two calls at once: two workers
    release_a.touch()
    release_b.touch()
    assert {_value(await_result(cp.url, cp.producer_token, i), n) for i in (first, second)} == {a, b}
    assert {_count(cp, n)[0] for _ in range(6)} <= {a, b}  # and no third one after


def test_the_entry_gates_still_run_at_every_warm_call(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    """``--allow-module`` on what a reference resolved to, and ``src_hash``, are checked by the
    entry in the warm worker at each call (the module is already imported there: no shortcut)."""
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, *WARM, "--allow-module", "tests.*")
    warm, _ = _count(cp, n)
    sneaky = {**fn_for(warm_fns.count, "ref"), "qualname": "os.getpid", "src_hash": None}
    out = _run(cp, Envelope.create(sneaky, (), {}).to_bytes())
    assert out["state"] == "failed" and out["error"]["type"] == "ModuleRefused", out
    stale = {**fn_for(warm_fns.count, "ref"), "src_hash": "sha256:0000000000000000"}
    out = _run(cp, Envelope.create(stale, (), {}).to_bytes())
    assert out["state"] == "failed" and out["error"]["type"] == "StaleSource", out
    assert _count(cp, n) == (warm, 2)  # refused in the same worker, which carries on
