# ruff: noqa: F811  (the fixtures are imported from tests.security.nymph_stack)
"""What one tenant's call leaves behind as its pool user, against the next tenant on that uid.

A root nymph leases each process-runner task a user of the task user pool (nymph.taskuser), and
gives it back when the job ends: the next task as that uid is another tenant's. Before: a process
left running as the uid outside the task's cgroup (the build backend of a pip environment, which
runs as the pool user with no task cgroup, double-forks a daemon) outlived the release, read the
next tenant's ``task.token`` and fetched its secrets; and a failed call's kept workdir stayed the
uid's for days, so the next tenant's task read its logs, ``error.json`` and token, and could write
into it. After: every process of the uid outside a task cgroup is killed before the user goes back
to the pool (nymph.uidreap), and a kept workdir is taken back (root's, 0700) before that.

The uids here are users of their own (``nymph-reap``, ``nymph-reap-0`` ..): killing every process of
a uid must not reach the tasks of another test's nymph, whose pool is ``nymph-task[-gwN]-*``.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from nymph.taskuser import TaskUsers
from nymph.workdir import seal
from tests.host_users import ensure_user
from tests.security.nymph_stack import (  # noqa: F401  (fixtures)
    USER_FLAGS,
    ControlPlane,
    RootNymph,
    await_result,
    plane,
    readable_runtime,
    ref,
    require_root,
    root_nymph,
    submit,
    task_user,
)
from tests.stack.wait import until

PREFIX = "nymph-reap"


@pytest.fixture(scope="module")
def reap_users() -> Iterator[list[pwd.struct_passwd]]:
    """Two pool users of their own: ``nymph-reap-0`` and ``nymph-reap-1``."""
    require_root()
    names = [f"{PREFIX}-{i}" for i in range(2)]
    for name in names:
        assert ensure_user(name, *USER_FLAGS), f"cannot create {name}"
    users = [pwd.getpwnam(name) for name in names]
    for user in users:  # a previous run's, if it died before its clean-up
        _kill_all(user.pw_uid)
    yield users
    for user in users:  # what a failing test left
        _kill_all(user.pw_uid)


def _processes(uid: int) -> list[int]:
    """The live processes (not zombies) whose real uid is ``uid``."""
    out = []
    for proc in psutil.process_iter(["uids", "status"]):
        uids, status = proc.info["uids"], proc.info["status"]
        if uids is not None and uids.real == uid and status != psutil.STATUS_ZOMBIE:
            out.append(proc.pid)
    return out


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_all(uid: int) -> None:
    for pid in _processes(uid):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _leave(user: pwd.struct_passwd, script: str) -> int:
    """Start ``script`` as ``user`` the way a build backend leaves a daemon: in a session of its
    own, its parent gone, in no task cgroup; its pid."""
    out = subprocess.run(
        ["/bin/sh", "-c", f"setsid /bin/sh -c '{script}' >/dev/null 2>&1 </dev/null & echo $!"],
        user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
        capture_output=True, text=True, check=True, timeout=10,
    )  # fmt: skip
    pid = int(out.stdout.strip())
    until(lambda: _alive(pid), f"the process {pid} left as {user.pw_name}", 10)
    return pid


@pytest.fixture
def users(reap_users: list[pwd.struct_passwd]) -> Iterator[TaskUsers]:
    yield TaskUsers(None, [u.pw_name for u in reap_users], pooled=True, fallback=False)
    for user in reap_users:
        _kill_all(user.pw_uid)


def test_what_a_pool_user_left_running_dies_before_the_user_goes_back_to_the_pool(
    users: TaskUsers, reap_users: list[pwd.struct_passwd]
) -> None:
    mine, other = reap_users
    a, b = object(), object()
    assert users.acquire(a) == mine.pw_name and users.acquire(b) == other.pw_name
    daemon = _leave(mine, "exec sleep 300")
    # one that forks without pause: the kill must take every child it makes meanwhile
    forker = _leave(mine, "while :; do sleep 300 & sleep 0.01; done")
    until(lambda: len(_processes(mine.pw_uid)) >= 5, "the forker's children", 10)
    running = _leave(other, "exec sleep 300")  # b's task, still leased: not touched
    outside = subprocess.Popen(["sleep", "300"])  # root's: not touched
    try:
        started = time.monotonic()
        users.release(a)
        took = time.monotonic() - started
        assert _processes(mine.pw_uid) == [] and not _alive(daemon) and not _alive(forker)
        assert _alive(running) and outside.poll() is None
        assert took < 3.0, took
        # the user is leased again, with nothing of the last tenant's left; a release with nothing
        # to kill is quick
        assert users.acquire(a) == mine.pw_name
        started = time.monotonic()
        users.release(a)
        assert time.monotonic() - started < 0.5
        users.release(b)
        assert not _alive(running)
    finally:
        outside.kill()
        outside.wait()


def test_a_failed_calls_kept_workdir_is_out_of_reach_of_its_pool_user(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], reap_users: list[pwd.struct_passwd]
) -> None:
    user = reap_users[0]
    n = root_nymph("--task-user", PREFIX, "--task-user-pool", "1", "--concurrency", "1")
    inv = submit(plane, ref("tests.security.attack_fns", "fail_when", "gate"), max_attempts=1)
    workdir = n.workdir / inv
    until(lambda: workdir.exists() and workdir.stat().st_uid == user.pw_uid, "the task's workdir", 60)
    daemon = _leave(user, "exec sleep 300")  # as a build backend's daemon would: no task cgroup
    (workdir / "gate").touch()
    out = await_result(plane, inv)
    assert out["state"] == "failed" and out["error"]["message"] == "failed on cue", (out, n.output()[-3000:])
    until(lambda: workdir.stat().st_uid == 0, "the kept workdir to be taken back", 10)
    assert workdir.stat().st_mode & 0o777 == 0o700
    assert (workdir / "stderr.log").exists() and (workdir / "error.json").exists()  # kept, for root
    for argv in (["ls", str(workdir)], ["cat", str(workdir / "stderr.log")], ["touch", str(workdir / "x")]):
        got = subprocess.run(
            argv, user=user.pw_uid, group=user.pw_gid, extra_groups=[], capture_output=True, text=True
        )
        assert got.returncode != 0 and "Permission denied" in got.stderr, (argv, got)
    until(lambda: not _alive(daemon), "the daemon left as the pool user to be killed", 10)


def test_seal_takes_a_workdir_back_from_its_user_only_and_follows_no_link(
    reap_users: list[pwd.struct_passwd], tmp_path: Path
) -> None:
    user, other = reap_users
    kept, theirs, target = tmp_path / "kept", tmp_path / "theirs", tmp_path / "target"
    for path, owner in ((kept, user), (theirs, other), (target, user)):
        path.mkdir(mode=0o755)
        os.chown(path, owner.pw_uid, owner.pw_gid)
    (tmp_path / "link").symlink_to(target)
    for path in (kept, theirs, tmp_path / "link"):
        seal(path, owners={user.pw_uid})
    st = kept.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o700)
    assert theirs.stat().st_uid == other.pw_uid  # not a pool user's (a restart's rule)
    assert target.stat().st_uid == user.pw_uid and target.stat().st_mode & 0o777 == 0o755
