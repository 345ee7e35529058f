# ruff: noqa: F811  (the fixtures are imported from tests.security.nymph_stack)
"""Issue 11, attack 6 (nymph's part): the daemon token was visible in ``ps`` through ``--token``.

After: the token comes from ``--token-file`` (or ``token_file``, or ``NYMPH_TOKEN``) and never needs
the command line; a ``--token`` given anyway is moved to the environment by an immediate re-exec
(same PID); no process on the host (nymph, its zygote, its tasks) shows the token in its command
line, and no task finds it in its environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from dreamlake.lakeshore import wire
from tests.security.nymph_stack import (  # noqa: F401  (fixtures)
    LIMIT_S,
    ControlPlane,
    RootNymph,
    await_result,
    nymph_args,
    plane,
    readable_runtime,
    ref,
    root_nymph,
    submit,
    task_user,
)
from tests.stack.procs import child_env


def _shown_by_ps(token: str) -> list[str]:
    """Command lines on this host that contain ``token`` (what ``ps`` shows every local user)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if token in line:
            found.append(f"{proc.pid}: {line[:200]}")
    return found


def test_a_token_file_keeps_the_token_out_of_ps_and_out_of_tasks(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    n = root_nymph()
    inv = submit(plane, ref("tests.security.attack_fns", "token_seen", plane.daemon_token))
    scanned = n.workdir / inv / "scanned"
    deadline = time.monotonic() + LIMIT_S
    while not scanned.exists():  # the task runs: nymph, its zygote and the task are all on the host
        assert time.monotonic() < deadline, n.output()[-3000:]
        time.sleep(0.05)
    assert _shown_by_ps(plane.daemon_token) == []
    (n.workdir / inv / "release").write_text("")
    out = await_result(plane, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert wire.unpack(out["result_blob"]) == {"environ": False, "cmdlines": []}


def test_a_token_on_the_command_line_is_moved_off_it_at_once(
    plane: ControlPlane, readable_runtime: tuple[str, list[str]], task_user: object
) -> None:
    base = Path(tempfile.mkdtemp(prefix="nymph-sec-"))
    os.chmod(base, 0o711)
    args = nymph_args(plane, base, readable_runtime)
    at = args.index("--token-file")
    args[at : at + 2] = ["--token", plane.daemon_token]
    n = RootNymph(base, args).start()
    try:
        assert n.proc is not None
        pid = n.proc.pid
        registered = base / "state" / "worker_id"
        deadline = time.monotonic() + LIMIT_S
        while not registered.exists():
            assert n.proc.poll() is None and time.monotonic() < deadline, n.output()[-3000:]
            time.sleep(0.05)
        assert plane.daemon_token not in " ".join(psutil.Process(pid).cmdline())  # same PID, re-executed
        assert _shown_by_ps(plane.daemon_token) == []
        assert "--token-file" in n.output()  # it says what to use instead
        inv = submit(plane, ref("tests.nymph_fns", "add", 1, 2))
        assert await_result(plane, inv)["state"] == "succeeded", n.output()[-3000:]
    finally:
        n.stop()
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_a_token_file_others_can_read_is_refused(plane: ControlPlane) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text(plane.daemon_token)
        os.chmod(token_file, 0o644)
        cmd = [sys.executable, "-m", "nymph", "start", "--server", plane.url, "--token-file", str(token_file)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=LIMIT_S)
    assert out.returncode != 0
    assert "readable or writable by every local user" in out.stderr and "chmod 600" in out.stderr
    assert plane.daemon_token not in out.stderr + out.stdout
