# ruff: noqa: F811  (the fixtures are imported from tests.security.nymph_stack)
"""Issue 11, attacks 2 and 5: what a task can reach on its host.

Before: nymph wrote ``outcome.json.tmp``, ``pump.json.tmp`` and ``handle.json.tmp`` with a plain
``open()`` in the task's directory, so a planted symlink made root overwrite any file; and a child
that started its own session (``setsid``) survived cancel, timeout and shutdown. After: every name
nymph writes or reads in a workdir is used without following links (nothing outside the workdir
changes, nothing outside it is read into an ack), and each task's cgroup is killed whole.
"""

from __future__ import annotations

import os
import pwd
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.security.attack_fns import PLANTED
from tests.security.nymph_stack import (  # noqa: F401  (fixtures)
    ControlPlane,
    RootNymph,
    await_result,
    call,
    plane,
    pool_uids,
    readable_runtime,
    ref,
    root_nymph,
    submit,
    task_user,
)
from tests.stack.wait import within

SECRET = "root-only secret " + uuid.uuid4().hex


@pytest.fixture
def victims(task_user: pwd.struct_passwd) -> Iterator[tuple[Path, Path]]:
    """A root-owned directory of victim files and a secret, and a directory of the task user's own."""
    base = Path(tempfile.mkdtemp(prefix="nymph-sec-victims-"))
    os.chmod(base, 0o755)
    root_dir, mine = base / "root", base / "mine"
    root_dir.mkdir(mode=0o755)
    mine.mkdir(mode=0o755)
    os.chown(mine, task_user.pw_uid, task_user.pw_gid)
    os.chmod(mine, 0o1777)  # the task runs as a pool user (nymph.taskuser), whichever is free
    for name in PLANTED:
        victim = root_dir / f"victim-{name}"
        victim.write_text("untouched")
        os.chmod(victim, 0o644)
    (root_dir / "secret").write_text(SECRET)
    os.chmod(root_dir / "secret", 0o600)
    try:
        yield root_dir, mine
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def _snapshot(*dirs: Path) -> dict[str, tuple[str, int, int, int]]:
    """Content, mode, owner and link count of every file in ``dirs``."""
    out = {}
    for directory in dirs:
        for path in sorted(directory.iterdir()):
            st = path.lstat()
            out[str(path)] = (path.read_text(), stat.S_IMODE(st.st_mode), st.st_uid, st.st_nlink)
    return out


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_links_planted_by_the_task_never_make_nymph_write_or_read_outside_the_workdir(
    plane: ControlPlane,
    root_nymph: Callable[..., RootNymph],
    victims: tuple[Path, Path],
    task_user: pwd.struct_passwd,
    kind: str,
    pool_uids: set[int],
) -> None:
    root_dir, mine = victims
    before = _snapshot(root_dir)
    n = root_nymph()
    # one attempt: the task's exit is a crash, which would be retried (docs/protocol.md "Retries")
    planter = ref("tests.security.attack_fns", "plant_links", str(root_dir), str(mine), kind)
    inv = submit(plane, planter, max_attempts=1)
    out = await_result(plane, inv)
    assert out["state"] == "failed", (out, n.output()[-3000:])
    workdir = n.workdir / inv
    planted = (workdir / "planted.txt").read_text().split()
    if kind == "hardlink":  # the kernel (fs.protected_hardlinks) refused links to root's files...
        assert sorted(planted) == sorted(PLANTED) or not planted
        assert {p.read_text() for p in mine.iterdir()} <= {
            "original"
        }  # ...and nymph never wrote the task's own
        assert len(list(mine.iterdir())) == len(planted)
    assert _snapshot(root_dir) == before  # nothing outside the workdir changed
    # what the attacker sees: the failure, without the secret behind the planted stderr.log
    assert out["error"]["type"] == "ProcessExited" and "code 3" in out["error"]["message"]
    assert SECRET not in repr(out)
    # nymph's own records are regular files of its own, beside (not through) what was planted;
    # outcome.json is written once the ack is handed to the outbox, which may deliver it first
    assert within(lambda: stat.S_ISREG((workdir / "outcome.json").lstat().st_mode), 30), "outcome.json"
    for name in ("outcome.json", "pump.json"):
        st = (workdir / name).lstat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_nlink == 1, name
    assert (workdir / "planted.txt").stat().st_uid in pool_uids  # its pool user's...
    # ...who no longer reaches the kept workdir: root's, once its user went back to the pool
    assert within(lambda: workdir.stat().st_uid == 0, 10), "the kept workdir was not taken back"


def _marked(marker: str) -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline", "status"])
        if marker in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


@pytest.mark.parametrize("how", ["cancel", "timeout", "shutdown"])
def test_setsid_daemons_die_on_cancel_timeout_and_shutdown(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], how: str
) -> None:
    n = root_nymph("--grace-s", "0.5")
    marker = f"nymph-sec-daemon-{uuid.uuid4().hex}"
    timeout = {"timeout_s": 15} if how == "timeout" else {}
    inv = submit(plane, ref("tests.nymph_fns", "setsid_daemons", 2, marker, None), **timeout)
    deadline_ok = within(lambda: len(_marked(marker)) == 2)
    assert deadline_ok, ("the daemons never started", n.output()[-3000:])
    daemons = _marked(marker)
    assert all(psutil.Process(p).uids().real != 0 for p in daemons)  # the task user's, not root's
    if how == "cancel":
        call(plane, f"/v1/producer/invocations/{inv}/cancel", {})
        assert await_result(plane, inv)["state"] == "killed"
    elif how == "timeout":
        assert await_result(plane, inv)["state"] == "timeout"
    else:
        assert n.proc is not None
        n.stop()  # SIGINT: the shutdown grace, then the ladder on what is left
        assert n.proc.returncode is not None
    assert _marked(marker) == [], n.output()[-3000:]
