"""What one tenant's task leaves outside its workdir as its pool user, against the next tenant on that uid.

A root nymph leases each process-runner task a user of the task user pool (nymph.taskuser); the
next task leased that uid is another tenant's, and owns whatever the uid owns. Before: a file the
first task wrote in ``/tmp`` (``/tmp/model-key``), a directory tree it left there, a SysV shared
memory segment, semaphore array or message queue it made, outlived the release, and the next
tenant's task read them. After: the release removes them (nymph.uidsweep), once the uid's processes
are dead, and leaves everyone else's alone.

``/tmp`` is a scratch sticky directory here (:data:`nymph.uidsweep.SHARED_DIRS` points at it); the
SysV objects are real, in the host's IPC namespace. The uids are users of their own
(``nymph-sweep-0``, ``nymph-sweep-1``): a sweep must not reach another test's pool users' objects.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nymph import uidsweep
from nymph.taskuser import TaskUsers
from tests.host_users import ensure_user
from tests.security.nymph_stack import USER_FLAGS, require_root

PREFIX = "nymph-sweep"
IPC_CREAT, IPC_RMID = 0o1000, 0
KEY = 0x6E796D70  # tenant A's shm segment, by a key tenant B could guess
LIBC = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def sweep_users() -> Iterator[list[pwd.struct_passwd]]:
    """Two pool users of their own: ``nymph-sweep-0`` and ``nymph-sweep-1``."""
    require_root()
    names = [f"{PREFIX}-{i}" for i in range(2)]
    for name in names:
        assert ensure_user(name, *USER_FLAGS), f"cannot create {name}"
    users = [pwd.getpwnam(name) for name in names]
    _drop_ipc(users)  # a previous run's, if it died before its clean-up
    yield users
    _drop_ipc(users)


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A world-writable sticky directory standing in for ``/tmp`` (and the only place swept)."""
    path = Path(tempfile.mkdtemp(prefix="nymph-sweep-tmp-", dir="/tmp"))
    os.chmod(path, 0o1777)
    monkeypatch.setattr(uidsweep, "SHARED_DIRS", (str(path),))
    monkeypatch.setattr(uidsweep, "RUN_USER", str(path / "no-run-user"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _drop_ipc(users: list[pwd.struct_passwd]) -> None:
    for user in users:
        for ident in uidsweep.ipc_ids("shm", user.pw_uid):
            LIBC.shmctl(ident, IPC_RMID, None)
        for ident in uidsweep.ipc_ids("sem", user.pw_uid):
            LIBC.semctl(ident, 0, IPC_RMID)
        for ident in uidsweep.ipc_ids("msg", user.pw_uid):
            LIBC.msgctl(ident, IPC_RMID, None)


def _as(user: pwd.struct_passwd, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", "-c", script], user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
        capture_output=True, text=True, timeout=10,
    )  # fmt: skip


def _ipc_as(user: pwd.struct_passwd, key: int = 0, *, all_kinds: bool = True) -> list[int]:
    """Make, as ``user`` (a forked child that drops to the uid), a shm segment of ``key`` (0: a
    private one) and, with ``all_kinds``, a semaphore array and a message queue; their ids (-1: failed)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: system calls only, then _exit
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
            os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
            ids = [LIBC.shmget(key, ctypes.c_size_t(4096), IPC_CREAT | 0o600)]
            if all_kinds:
                ids += [LIBC.semget(0, 1, IPC_CREAT | 0o600), LIBC.msgget(0, IPC_CREAT | 0o600)]
            os.write(write, " ".join(map(str, ids)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as fh:
        out = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return [int(x) for x in out.split()]


def _has_shm(user: pwd.struct_passwd, key: int) -> bool:
    """Whether ``user`` finds a shm segment of ``key`` (``shmget`` without creating, as the uid)."""
    pid = os.fork()
    if pid == 0:  # the child: system calls only, then _exit
        code = 2
        try:
            os.setgroups([])
            os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
            os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
            code = 0 if LIBC.shmget(key, ctypes.c_size_t(0), 0) >= 0 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 1), status
    return os.WEXITSTATUS(status) == 0


def test_a_release_removes_what_the_pool_user_left_in_tmp_and_sysv_ipc_and_nothing_else(
    sweep_users: list[pwd.struct_passwd], shared: Path
) -> None:
    mine, other = sweep_users
    users = TaskUsers(None, [mine.pw_name, other.pw_name], pooled=True, fallback=False)
    a = object()
    assert users.acquire(a) == mine.pw_name
    # root's file, the target of a link the tenant plants; another uid's file; root's directory
    (shared / "roots").write_text("root's")
    (shared / "roots-dir").mkdir()
    (shared / "roots-dir" / "keep").write_text("root's")
    made = _as(other, f"echo theirs > {shared}/theirs")
    assert made.returncode == 0, made.stderr
    theirs_shm = _ipc_as(other, all_kinds=False)
    # what tenant A's task leaves
    made = _as(
        mine,
        f"cd {shared} && echo secret > model-key && mkdir -p tree/a/b && echo x > tree/a/b/deep "
        f"&& chmod 0500 tree/a && ln -s {shared}/roots link && ln -s {shared}/roots-dir dirlink "
        f"&& mkfifo fifo",
    )
    assert made.returncode == 0, made.stderr
    ids = _ipc_as(mine)
    assert all(i >= 0 for i in ids) and ids[0] in uidsweep.ipc_ids("shm", mine.pw_uid), ids
    assert ids[1] in uidsweep.ipc_ids("sem", mine.pw_uid) and ids[2] in uidsweep.ipc_ids("msg", mine.pw_uid)
    try:
        users.release(a)
        left = sorted(p.name for p in shared.iterdir())
        assert left == ["roots", "roots-dir", "theirs"], left
        assert (shared / "roots").read_text() == "root's"  # the link went, not its target
        assert (shared / "roots-dir" / "keep").read_text() == "root's"
        assert (shared / "theirs").read_text() == "theirs\n"
        assert uidsweep.ipc_ids("shm", mine.pw_uid) == []
        assert uidsweep.ipc_ids("sem", mine.pw_uid) == [] and uidsweep.ipc_ids("msg", mine.pw_uid) == []
        assert theirs_shm[0] in uidsweep.ipc_ids("shm", other.pw_uid)  # not the pool user's: kept
    finally:
        _drop_ipc(sweep_users)


def test_what_the_pool_user_left_in_others_world_writable_directories_goes_too(
    sweep_users: list[pwd.struct_passwd], shared: Path
) -> None:
    """Before: only the top level of ``/tmp`` was swept, so tenant A's task could leave
    ``/tmp/<someone's 1777 dir>/model-key`` for the next tenant on the uid. Now each world-writable
    directory of another owner is walked too (nested ones as well, no link followed); the owner's
    own files, and directories the uid could not write to, are left."""
    mine, other = sweep_users
    users = TaskUsers(None, [mine.pw_name], pooled=True, fallback=False)
    a = object()
    assert users.acquire(a) == mine.pw_name
    (shared / "roots-1777").mkdir()
    os.chmod(shared / "roots-1777", 0o1777)
    (shared / "roots-0755").mkdir()
    (shared / "roots-0755" / "keep").write_text("root's")
    made = _as(
        other,
        f"cd {shared} && mkdir -m 1777 theirs theirs/deeper && echo own > theirs/own "
        f"&& echo own > theirs/deeper/own && ln -s {shared}/roots-1777 theirs/link",
    )
    assert made.returncode == 0, made.stderr
    made = _as(
        mine,
        f"cd {shared} && echo secret > roots-1777/model-key && echo secret > theirs/model-key "
        f"&& mkdir theirs/deeper/tree && echo x > theirs/deeper/tree/key",
    )
    assert made.returncode == 0, made.stderr
    users.release(a)
    left = sorted(str(p.relative_to(shared)) for p in shared.rglob("*"))
    assert left == [
        "roots-0755",
        "roots-0755/keep",
        "roots-1777",
        "theirs",
        "theirs/deeper",
        "theirs/deeper/own",
        "theirs/link",
        "theirs/own",
    ], left


def test_the_walk_is_bounded_and_says_where_it_stopped(
    sweep_users: list[pwd.struct_passwd], shared: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A ``/tmp`` of many entries costs a release a bounded walk: past ``NESTED_ENTRIES`` it stops,
    with a warning naming the place; past ``NESTED_DEPTH`` nested directories are not entered."""
    mine = sweep_users[0]
    made = _as(mine, f"cd {shared} && for i in 1 2 3 4 5 6; do echo x > f$i; done")
    assert made.returncode == 0, made.stderr
    monkeypatch.setattr(uidsweep, "NESTED_ENTRIES", 4)
    with caplog.at_level("WARNING", logger="nymph.uidsweep"):
        assert uidsweep.sweep(mine.pw_uid)[str(shared)] == 4
    assert len(list(shared.iterdir())) == 2
    assert f"stopped looking under {shared} after 4 entries" in caplog.text
    assert uidsweep.sweep(mine.pw_uid)[str(shared)] == 2  # the next release takes the rest
    monkeypatch.setattr(uidsweep, "NESTED_ENTRIES", 1000)
    monkeypatch.setattr(uidsweep, "NESTED_DEPTH", 1)
    nested = shared / "a" / "b"
    nested.mkdir(parents=True)
    for d in (shared / "a", nested):
        os.chmod(d, 0o1777)
    made = _as(mine, f"echo x > {shared}/a/one && echo x > {nested}/two")
    assert made.returncode == 0, made.stderr
    assert uidsweep.sweep(mine.pw_uid)[str(shared)] == 1
    assert not (shared / "a" / "one").exists() and (nested / "two").exists()


def test_the_next_lease_of_a_pool_user_cannot_see_what_the_last_tenant_left(
    sweep_users: list[pwd.struct_passwd], shared: Path
) -> None:
    user = sweep_users[0]
    users = TaskUsers(None, [user.pw_name], pooled=True, fallback=False)
    tenant_a, tenant_b = object(), object()
    assert users.acquire(tenant_a) == user.pw_name
    wrote = _as(user, f"umask 077 && echo sk-tenant-a > {shared}/model-key")
    assert wrote.returncode == 0, wrote.stderr
    assert _ipc_as(user, KEY, all_kinds=False)[0] >= 0
    assert _has_shm(user, KEY)  # there, for tenant A's later calls
    try:
        users.release(tenant_a)
        assert users.acquire(tenant_b) == user.pw_name  # the same uid, another tenant
        read = _as(user, f"cat {shared}/model-key")
        assert read.returncode != 0 and "sk-tenant-a" not in read.stdout, read
        assert "No such file" in read.stderr, read.stderr
        assert not _has_shm(user, KEY)  # no segment of that key
        users.release(tenant_b)
    finally:
        _drop_ipc(sweep_users)
