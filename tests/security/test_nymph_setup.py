"""nymph checks its own set-up before it registers (issue 35, item 2), and ``nymph doctor`` agrees.

A root nymph runs its tasks as its task users (the process runner: the pool, whose first user,
``nymph-task-0``, is the one checked and named). Started with an interpreter that user cannot run (this
machine's own: a venv whose python lives under root's 0700 home, the pyenv trap) or a workdir it
cannot enter (0700), every task would fail later with a misleading error. ``nymph start`` refuses at
once, naming the path and the fix, and registers nothing; ``nymph doctor`` says the same and
registers nothing either (no phantom worker in ``lakeshore workers``).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import ControlPlane
from tests.security.nymph_stack import (  # noqa: F401  (fixtures)
    TASK_USER,
    nymph_args,
    plane,
    readable_runtime,
    task_user,
)
from tests.stack.procs import child_env

LIMIT_S = 120
USER = re.escape(TASK_USER) + r"(-\d+)?"  # the shared task user, or a user of its pool (one accessor)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nymph-setup-"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=LIMIT_S)


def _doctor(args: list[str]) -> list[str]:
    return [*args[:3], "doctor", *args[4:]]


def _workers(cp: ControlPlane) -> list[object]:
    status, body = cp.json("GET", "/v1/ops/workers", None, cp.admin_token)
    assert status == 200, body
    return list(body["workers"])


def _unreadable_interpreter() -> str:
    """nymph's own interpreter, when the task user cannot reach it (the trap this test is about)."""
    real = os.path.realpath(sys.executable)
    user = pwd.getpwnam(TASK_USER)
    for parent in Path(real).parents:
        st = parent.stat()
        if st.st_uid != user.pw_uid and not st.st_mode & 0o001:
            return str(parent)
    pytest.fail(f"{real} is reachable by {TASK_USER} here: this host does not have the trap to test")


def test_start_refuses_an_interpreter_the_task_user_cannot_run_and_doctor_agrees(
    plane: ControlPlane,  # noqa: F811
    task_user: pwd.struct_passwd,  # noqa: F811
    base: Path,
) -> None:
    closed = _unreadable_interpreter()  # e.g. /root (0700), above /root/.pyenv/versions/...
    (base / "work").mkdir(mode=0o711)
    args = nymph_args(plane, base, None)  # the process runner with nymph's own interpreter
    started = _run(args)
    assert started.returncode != 0, started.stdout + started.stderr
    said = started.stderr
    assert re.search(rf"task user {USER} cannot enter {re.escape(closed)} ", said), said
    assert "install nymph system-wide, or give the runner an interpreter it can run" in said
    assert "registered as worker" not in started.stdout + said
    assert _workers(plane) == []

    doctor = _run(_doctor(args))
    assert doctor.returncode == 1, doctor.stdout
    line = next(ln for ln in doctor.stdout.splitlines() if "task-setup" in ln)
    assert line.startswith("[FAIL] task-setup") and re.search(
        rf"task user {USER} cannot enter {re.escape(closed)} ", line
    )
    assert _workers(plane) == []  # the doctor registered nothing either


def test_start_refuses_a_workdir_the_task_user_cannot_enter_and_doctor_agrees(
    plane: ControlPlane,  # noqa: F811
    task_user: pwd.struct_passwd,  # noqa: F811
    readable_runtime: tuple[str, list[str]],  # noqa: F811
    base: Path,
) -> None:
    work = base / "work"
    work.mkdir(mode=0o700)
    os.chmod(work, 0o700)
    args = nymph_args(plane, base, readable_runtime)
    started = _run(args)
    assert started.returncode != 0, started.stdout + started.stderr
    assert re.search(
        rf"task user {USER} cannot enter {re.escape(str(work))} \(mode 0700, owner root:root\)",
        started.stderr,
    )
    assert "chmod 711" in started.stderr
    assert _workers(plane) == []

    doctor = _run(_doctor(args))
    assert doctor.returncode == 1
    assert re.search(
        rf"\[FAIL\] task-setup: task user {USER} cannot enter {re.escape(str(work))} ", doctor.stdout
    )

    # what doctor and start accept: 0711 (enterable, not listable) passes with no warning; 0755
    # passes with a warning (others can list the ids), never a failure that breaks shipped code
    os.chmod(work, 0o711)
    fixed = _run(_doctor(args))
    assert "[ok] task-setup" in fixed.stdout and "[ok] workdir" in fixed.stdout, fixed.stdout
    os.chmod(work, 0o755)
    listable = _run(_doctor(args))
    assert "[ok] task-setup" in listable.stdout
    assert "[warn] workdir" in listable.stdout and "chmod 711" in listable.stdout
    assert _workers(plane) == []


def test_a_task_that_cannot_read_its_sys_path_is_told_so_not_that_a_module_is_missing(
    task_user: pwd.struct_passwd,  # noqa: F811
    readable_runtime: tuple[str, list[str]],  # noqa: F811
) -> None:
    """The entry's import error names an unreadable sys.path entry (the real cause) instead of
    'install it or add it to PYTHONPATH'; with every entry readable it says the module is missing."""
    python, pythonpath = readable_runtime
    closed = Path(tempfile.mkdtemp(prefix="lakeshore-closed-", dir="/root"))  # under a 0700 home
    script = (
        "import sys\n"
        "sys.path += sys.argv[1:]\n"
        "from dreamlake.lakeshore.envelope import resolve_fn\n"
        "try:\n"
        "    resolve_fn({'kind': 'ref', 'module': 'mylib_nowhere', 'qualname': 'f'}, allow_pickled=False)\n"
        "except Exception as exc:\n"
        "    print(exc)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(pythonpath)}

    def run(*extra: str) -> str:
        runuser = shutil.which("runuser") or "runuser"
        cmd = [runuser, "-u", task_user.pw_name, "--", python, "-c", script, *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=LIMIT_S, cwd="/")
        assert out.returncode == 0, out.stderr
        return out.stdout

    try:
        said = run(str(closed))
        assert f"cannot reach {closed} on sys.path" in said and "install it" not in said, said
        assert "install it or add it to PYTHONPATH" in run()
    finally:
        shutil.rmtree(closed, ignore_errors=True)
