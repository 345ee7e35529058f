# ruff: noqa: F811  (the fixtures are imported from tests.security.nymph_stack)
"""Issue 11, attack 1: a producer token is code execution on the nymphs serving its queue. Bound it.

Before: ``run_config={"script": "id > owned.txt"}`` ran under ``bash -c`` as uid 0 (the pickle gate
was skipped for scripts), and a ``ref`` to ``builtins:exec`` or ``subprocess:check_output`` ran
and returned ``uid=0(root)``. After: nymph (as root, as the systemd unit runs it) runs tasks as its
task user; scripts only with ``--allow-script``; with ``--allow-module`` only functions of the
named modules (checked before anything spawns, and again in the entry on what the reference
resolved to); root only with ``--allow-root-tasks``. Each test asserts what the attacker sees.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from tests import code_kit
from tests.security.nymph_stack import (  # noqa: F401  (fixtures)
    LIMIT_S,
    ControlPlane,
    RootNymph,
    await_result,
    nymph_args,
    plane,
    pool_uids,
    readable_runtime,
    ref,
    root_nymph,
    submit,
    task_user,
)
from tests.stack.procs import child_env
from tests.stack.wait import until


def _no_workdir(n: RootNymph, inv: str) -> bool:
    """Nothing was written for ``inv``: refused before its workdir existed."""
    return not (n.workdir / inv).exists()


def test_a_script_is_refused_without_allow_script(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], tmp_path: Path
) -> None:
    n = root_nymph()
    owned = tmp_path / "owned.txt"
    inv = submit(plane, script=f"id > {owned}")
    out = await_result(plane, inv)
    assert out["state"] == "failed", n.output()[-3000:]
    assert out["error"]["type"] == "ScriptRefused"
    assert "--allow-script" in out["error"]["message"]
    assert not owned.exists() and _no_workdir(n, inv)


def test_an_allowed_script_runs_as_a_task_user(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], pool_uids: set[int]
) -> None:
    n = root_nymph("--allow-script")
    inv = submit(plane, script="id -u")
    out = await_result(plane, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    resp = plane.client(plane.admin_token).get(
        f"/v1/producer/invocations/{inv}/result/stream", params={"since": -1, "timeout": 5}
    )
    frames = wire.FrameReader().feed(resp.content)
    stdout = b"".join(
        f.body for f in frames if f.kind == wire.FRAME_LOG and (f.meta or {}).get("stream") == "stdout"
    )
    assert int(stdout.decode().strip()) in pool_uids and 0 not in pool_uids


def test_a_ref_to_any_callable_runs_as_a_task_user_not_root(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], pool_uids: set[int]
) -> None:
    """Without --allow-module any importable callable still resolves (a producer token is code
    execution, as in every peer): but as the task user, never as root."""
    n = root_nymph()
    inv = submit(plane, ref("subprocess", "check_output", ["id", "-u"]))
    out = await_result(plane, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert int(wire.unpack(out["result_blob"]).decode().strip()) in pool_uids
    inv = submit(plane, ref("tests.security.attack_fns", "ids"))
    out = await_result(plane, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    real, effective = wire.unpack(out["result_blob"])
    assert real == effective and real in pool_uids and 0 not in pool_uids


def test_allow_module_refuses_exec_and_subprocess_before_anything_spawns(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], tmp_path: Path
) -> None:
    n = root_nymph("--allow-module", "tests.*")
    owned = tmp_path / "owned.txt"
    for module, qualname, args in (
        ("builtins", "exec", (f"open({str(owned)!r}, 'w').write('x')",)),
        ("subprocess", "check_output", (["id"],)),
    ):
        inv = submit(plane, ref(module, qualname, *args))
        out = await_result(plane, inv)
        assert out["state"] == "failed", n.output()[-3000:]
        assert out["error"]["type"] == "ModuleRefused"
        assert (
            "--allow-module" in out["error"]["message"] and f"{module}:{qualname}" in out["error"]["message"]
        )
        assert _no_workdir(n, inv)
    assert not owned.exists()
    inv = submit(plane, ref("tests.nymph_fns", "add", 2, 3))  # an allowed module still runs
    out = await_result(plane, inv)
    assert out["state"] == "succeeded" and wire.unpack(out["result_blob"]) == 5


def test_allow_module_is_checked_again_on_what_the_reference_resolved_to(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], tmp_path: Path
) -> None:
    """``tests.nymph_fns:os.system`` names an allowed module, but the callable is ``os``'s: the entry
    refuses it (exit 2) before calling it."""
    n = root_nymph("--allow-module", "tests.*")
    owned = tmp_path / "owned.txt"
    inv = submit(plane, ref("tests.nymph_fns", "os.system", f"touch {owned}"))
    out = await_result(plane, inv)
    assert out["state"] == "failed", n.output()[-3000:]
    assert out["error"]["type"] == "ModuleRefused" and "--allow-module" in out["error"]["message"]
    assert not owned.exists()


def test_as_user_root_needs_allow_root_tasks(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    n = root_nymph("--allow-user", "root")
    inv = submit(plane, ref("tests.security.attack_fns", "ids"), as_user="root")
    out = await_result(plane, inv)
    assert out["state"] == "failed", n.output()[-3000:]
    assert out["error"]["type"] == "RootRefused" and "--allow-root-tasks" in out["error"]["message"]
    assert _no_workdir(n, inv)


def test_nymph_refuses_to_start_as_root_without_its_task_user(
    plane: ControlPlane, readable_runtime: tuple[str, list[str]]
) -> None:
    base = Path(tempfile.mkdtemp(prefix="nymph-sec-"))
    args = nymph_args(plane, base, readable_runtime, "--task-user", "nymph-no-such-user")
    out = subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=LIMIT_S)
    assert out.returncode != 0
    assert "useradd --system" in out.stderr and "nymph-no-such-user" in out.stderr
    assert "--task-user" in out.stderr and "--allow-root-tasks" in out.stderr
    assert not (base / "state" / "worker_id").exists()  # never registered
    os.remove(base / "token")
    os.rmdir(base)


def test_a_container_runs_as_the_task_user_not_root(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], task_user: pwd.struct_passwd
) -> None:
    """The docker runner runs the container as the workdir's owner: the task user's uid, not 0."""
    from tests.runner_kit import options_for

    image = options_for("docker")["image"]  # skips without an engine and a test image
    n = root_nymph(
        "--runner", "docker", "--runner-opt", f"image={image}", "--runner-opt", "pull=never", process=False
    )
    inv = submit(plane, ref("tests.security.attack_fns", "ids"))
    out = await_result(plane, inv)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    assert list(wire.unpack(out["result_blob"])) == [task_user.pw_uid, task_user.pw_uid]


def test_shipped_code_runs_as_the_task_user_and_allow_module_sees_every_shipped_module(
    plane: ControlPlane,
    root_nymph: Callable[..., RootNymph],
    task_user: pwd.struct_passwd,
    tmp_path: Path,
) -> None:
    """A code archive is unpacked by root nymph, read-only, for the task user to read; under
    --allow-module every module the archive ships must be allowed, not just the function's."""
    src = tmp_path / "src"
    name, evil = code_kit.unique_name(), "evil_" + code_kit.unique_name()
    code_kit.write_package(src, name, "one")
    code_kit.write_package(src, evil, "evil")
    which = code_kit.load(src, name).which
    n = root_nymph("--allow-module", "lk_user_*")
    try:
        with dls.scope(code="auto"):
            inv = submit(plane, which.thunk().to_envelope().to_bytes())
        out = await_result(plane, inv)
        assert out["state"] == "succeeded", (out, n.output()[-3000:])
        shipped = Path(wire.unpack(out["result_blob"])["file"])
        assert shipped.is_relative_to(n.workdir / ".code")
        st = shipped.stat()
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o444  # the task user reads, never writes
        # its directories are sealed 0555 once its bytecode is written, on a thread of nymph's
        # after the unpack (root's 0755 until then: no task user writes there either way)
        until(lambda: stat.S_IMODE(shipped.parent.stat().st_mode) == 0o555, "the archive sealed", 60)
        assert stat.S_IMODE((n.workdir / ".code").stat().st_mode) == 0o711  # not listable by tasks

        smuggled = dls.udf(code=[str(src / name), str(src / evil)])(which.__wrapped__)
        inv = submit(plane, smuggled.thunk().to_envelope().to_bytes())
        out = await_result(plane, inv)
        assert out["state"] == "failed", n.output()[-3000:]
        assert out["error"]["type"] == "ModuleRefused"
        assert f"ships code with module {evil!r}" in out["error"]["message"], out["error"]
        assert _no_workdir(n, inv)
    finally:
        sys.path.remove(str(src))
