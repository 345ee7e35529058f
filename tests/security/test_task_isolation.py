# ruff: noqa: F811  (the fixtures are imported from tests.security.nymph_stack)
"""Issue 31, the host side: one tenant's task against another's, on one root nymph.

The stack is the one an operator runs: ``nymph start`` as root (no ``--namespace``: it serves every
namespace), the process runner, and two producers bound to namespaces ``team-a`` and ``team-b``.
Before: every task ran as the one task user ``nymph-task``, so B's task could forge A's
``result.msgpack`` / ``error.json`` (A's caller got B's value), read ``LAKESHORE_TOKEN`` from
``/proc/PID/environ`` of a child of A's task (and submit as A), and signal A's processes; a task
credential kept answering ``/v1/ops/whoami`` after its attempt; a task could allocate memory and
fork without bound (an OOM kill read ``ProcessExited ... signal 9`` and was retried); and every
nymph ran exec jobs (``bash -c``) without the operator asking for them. After: each running task
has a uid of its own from the task user pool (nymph.taskuser), its credential is in a 0400 file of
that uid, its cgroup has memory.max / pids.max (nymph.limits), and exec jobs need ``--allow-exec``.

The cross-task attacks also run on the docker and gVisor runners, where each task is a container
of its own: the sibling's workdir and processes are not even visible there.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from dreamlake.lakeshore import ids, wire
from tests.integration.conftest import submit_body
from tests.security.attack_fns import RELEASE, VICTIM
from tests.security.nymph_stack import (  # noqa: F401  (fixtures)
    LIMIT_S,
    TASK_USER,
    ControlPlane,
    RootNymph,
    await_result,
    call,
    nymph_args,
    plane,
    pool_uids,
    readable_runtime,
    ref,
    root_nymph,
    task_user,
)
from tests.stack.procs import child_env
from tests.stack.wait import within

REFUSED = "refused: PermissionError"


def _producer(cp: ControlPlane, namespace: str) -> str:
    return cp.store.create_token("producer", f"producer-{namespace}", namespace)


def _submit(cp: ControlPlane, token: str, args_blob: bytes, **run_config: Any) -> str:
    body = submit_body(ids.new_ulid(), "default", run_config=run_config, args_blob=args_blob)
    return str(call(cp, "/v1/producer/submit", body, token)["invocation_id"])


def _victim_started(n: RootNymph, inv: str) -> dict[str, int]:
    path = n.workdir / inv / VICTIM
    told = within(lambda: path.exists() and json.loads(path.read_text()), 90)
    assert told, ("the victim never started", n.output()[-3000:])
    return dict(told)


def _cross_task(
    cp: ControlPlane, n: RootNymph, host_pids: Callable[[str], tuple[int, int]] | None = None
) -> tuple[dict[str, Any], dict[str, Any], os.stat_result]:
    """A's victim runs; B's attacker tries everything against it (knowing A's workdir and the pids
    of A's task and its child: what the victim reports, or ``host_pids(invocation)``); then A is
    released. Returns the attacker's report, A's outcome and the stat of A's workdir (while it ran)."""
    team_a, team_b = _producer(cp, "team-a"), _producer(cp, "team-b")
    victim = _submit(cp, team_a, ref("tests.security.attack_fns", "victim", "genuine A"), max_attempts=1)
    told = _victim_started(n, victim)
    pid, child = (told["pid"], told["child"]) if host_pids is None else host_pids(victim)
    workdir = n.workdir / victim
    attacker = _submit(
        cp,
        team_b,
        ref("tests.security.attack_fns", "attack_sibling", str(workdir), pid, child),
        max_attempts=1,
    )
    out_b = await_result(cp, attacker)
    assert out_b["state"] == "succeeded", (out_b, n.output()[-3000:])
    report = dict(wire.unpack(out_b["result_blob"]))
    st = workdir.stat()
    (workdir / RELEASE).touch()
    return report, await_result(cp, victim), st


def test_a_task_cannot_forge_read_or_signal_a_sibling_task_of_another_tenant(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], pool_uids: set[int]
) -> None:
    n = root_nymph("--concurrency", "2")
    report, out_a, st = _cross_task(plane, n)
    assert report["forge_result"] == REFUSED and report["forge_error"] == REFUSED, report
    assert report["read_environ"] == REFUSED and "environ_has_token" not in report, report
    assert report["read_token_file"] == REFUSED, report
    assert report["signal_child"] == REFUSED and report["signal_victim"] == REFUSED, report
    # A's caller gets A's own value, from A's own uid: a pool user that is not B's
    assert out_a["state"] == "succeeded", (out_a, n.output()[-3000:])
    assert wire.unpack(out_a["result_blob"]) == "genuine A"
    assert st.st_uid in pool_uids and st.st_mode & 0o077 == 0


def test_the_credential_is_a_file_of_the_task_not_its_environment_and_dies_with_the_attempt(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    n = root_nymph()
    inv = _submit(plane, _producer(plane, "team-a"), ref("tests.security.attack_fns", "leak_token", "gate"))
    token_path = n.workdir / inv / "token"
    token = within(lambda: token_path.exists() and token_path.read_text(), 90)
    assert token, n.output()[-3000:]
    st = (n.workdir / inv / "task.token").stat()
    assert st.st_mode & 0o777 == 0o400 and st.st_uid == (n.workdir / inv).stat().st_uid != 0
    whoami = plane.url + "/v1/ops/whoami"
    headers = {"Authorization": f"Bearer {token}"}
    alive = httpx.get(whoami, headers=headers, timeout=30)
    assert alive.status_code == 200 and alive.json()["kind"] == "task", alive.text
    (n.workdir / inv / "gate").touch()
    out = await_result(plane, inv)
    assert out["state"] == "succeeded" and wire.unpack(out["result_blob"]) == "file only", out
    ended = httpx.get(whoami, headers=headers, timeout=30)
    assert ended.status_code == 401, ended.text
    assert "ended with that attempt" in ended.json()["error"]


@pytest.mark.parametrize(
    ("flags", "resources", "limit"),
    [
        (("--task-memory-max", "256m"), {"memory": "128m"}, 128 << 20),  # the task's own limit
        (("--task-memory-max", "192m"), None, 192 << 20),  # asks for none: nymph's cap holds it
    ],
    ids=["resources-memory", "nymph-cap"],
)
def test_a_memory_hog_is_killed_at_its_limit_and_reported_once_as_out_of_memory(
    plane: ControlPlane,
    root_nymph: Callable[..., RootNymph],
    flags: tuple[str, ...],
    resources: dict[str, str] | None,
    limit: int,
) -> None:
    n = root_nymph(*flags)
    run_config: dict[str, Any] = {"max_attempts": 3}
    if resources:
        run_config["resources"] = resources
    inv = _submit(plane, _producer(plane, "team-a"), ref("tests.security.attack_fns", "hog"), **run_config)
    out = await_result(plane, inv, limit_s=120)
    assert out["state"] == "failed", (out, n.output()[-3000:])
    error = out["error"]
    assert error["type"] == "OutOfMemory", (error, n.output()[-3000:])
    assert error["memory_limit"] == limit and f"{limit >> 20} MiB" in error["message"], error
    assert error["memory_peak"] is None or error["memory_peak"] <= limit + (1 << 20), error
    stored = plane.store.get(inv)
    assert stored is not None and stored.attempt == 1  # not retried: retry_on does not name it


def test_a_memory_limit_above_nymphs_cap_is_never_claimed_by_it(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    """A call asking more memory than one task may have on this nymph (--task-memory-max) is not
    for it: placement matches memory (issue 29), so it waits queued instead of being claimed and
    refused; one within the cap runs (under that limit)."""
    n = root_nymph("--task-memory-max", "256m")
    too_big = _submit(
        plane, _producer(plane, "team-a"), ref("tests.security.attack_fns", "ids"), resources={"memory": "1g"}
    )
    fits = _submit(
        plane,
        _producer(plane, "team-a"),
        ref("tests.security.attack_fns", "ids"),
        resources={"memory": "128m"},
    )
    assert await_result(plane, fits)["state"] == "succeeded", n.output()[-3000:]
    stored = plane.store.get(too_big)
    assert stored is not None and (stored.state, stored.attempt) == ("queued", 0)


def test_a_result_too_big_to_serialise_within_the_limit_is_refused_before_it_is_packed(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    """Packing a result copies it: 160 MiB under a 256 MiB limit fits once, not twice. Refused
    before packing (half the limit), it is a clear failure, not an OOM kill in the middle."""
    n = root_nymph("--task-memory-max", "256m")
    inv = _submit(
        plane, _producer(plane, "team-a"), ref("tests.security.attack_fns", "big_result", 160), max_attempts=3
    )
    out = await_result(plane, inv, limit_s=120)
    assert out["state"] == "failed", (out, n.output()[-3000:])
    assert out["error"]["type"] == "ResultTooLarge", out["error"]
    assert f"more than the {128 << 20} this task may serialise" in out["error"]["message"]
    stored = plane.store.get(inv)
    assert stored is not None and stored.attempt == 1
    small = _submit(plane, _producer(plane, "team-a"), ref("tests.security.attack_fns", "big_result", 16))
    done = await_result(plane, small, limit_s=120)
    assert done["state"] == "succeeded" and len(wire.unpack(done["result_blob"])) == 16 << 20, done["state"]


def test_a_fork_bomb_stops_at_the_tasks_pids_max(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    n = root_nymph("--task-pids-max", "48")
    inv = _submit(plane, _producer(plane, "team-b"), ref("tests.security.attack_fns", "fork_bomb", 500))
    out = await_result(plane, inv, limit_s=120)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    got = wire.unpack(out["result_blob"])
    assert got["errno"] == errno.EAGAIN and 0 < got["forked"] < 48, got
    # what it forked died with it (the cgroup is killed whole)
    assert within(lambda: not _sleepers(n.workdir / inv), 30), _sleepers(n.workdir / inv)


def _sleepers(workdir: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["cwd", "status"]):
        if p.info["cwd"] == str(workdir) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
    return out


def test_exec_jobs_are_claimed_only_by_a_nymph_started_with_allow_exec(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    # what the job ran says so on its stdout (a file it wrote in a shared /tmp directory would be
    # swept at its pool user's release: nymph.uidsweep)
    status, job = plane.json(
        "POST", "/v1/namespaces/team-a/exec", {"command": "echo ran-as-$(id -u)"}, plane.admin_token
    )
    assert status == 202, job
    n = root_nymph()
    # the nymph polls (an invocation submitted after the exec job runs) and leaves the job alone
    inv = _submit(plane, _producer(plane, "team-a"), ref("tests.security.attack_fns", "ids"))
    assert await_result(plane, inv)["state"] == "succeeded", n.output()[-3000:]
    assert plane.store.get_exec("team-a", job["exec_id"])["attempt"] in (0, None)  # type: ignore[index]
    opted_in = root_nymph("--allow-exec")
    status, out = plane.json(
        "GET",
        f"/v1/namespaces/team-a/jobs/{job['exec_id']}/result?wait=60",
        None,
        plane.admin_token,
        timeout=90,
    )
    assert status == 200 and out["exit_code"] == 0, (out, opted_in.output()[-3000:])
    ran = out["stdout"].decode() if isinstance(out["stdout"], bytes) else out["stdout"]
    assert ran.startswith("ran-as-") and ran.strip() != "ran-as-0", out  # run, as a task user


# --- the pool: said at start, shared only with the operator's leave ----------------------------------


def test_a_pool_smaller_than_the_slots_refuses_the_start_unless_sharing_is_allowed(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], readable_runtime: tuple[str, list[str]]
) -> None:
    base = Path(tempfile.mkdtemp(prefix="nymph-sec-"))
    try:  # the tests made {TASK_USER}-0 .. -3: eight slots need eight
        args = nymph_args(plane, base, readable_runtime, "--concurrency", "8")
        out = subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=LIMIT_S)
        assert out.returncode != 0
        assert f"4 of {TASK_USER}-0 .. {TASK_USER}-63 exist and --concurrency 8 needs 8" in out.stderr
        assert "nymph doctor --fix" in out.stderr and "--shared-task-user" in out.stderr
        assert not (base / "state" / "worker_id").exists()  # never registered
    finally:
        shutil.rmtree(base, ignore_errors=True)
    n = root_nymph("--concurrency", "8", "--shared-task-user")
    inv = _submit(plane, _producer(plane, "team-a"), ref("tests.security.attack_fns", "ids"))
    assert await_result(plane, inv)["state"] == "succeeded", n.output()[-3000:]
    assert f"tasks beyond the pool run as the shared task user '{TASK_USER}'" in n.output()


def test_doctor_fix_creates_the_task_user_pool(
    plane: ControlPlane, readable_runtime: tuple[str, list[str]]
) -> None:
    prefix = f"nymph-fix{os.getpid() % 100000}"
    base = Path(tempfile.mkdtemp(prefix="nymph-sec-"))
    names = [f"{prefix}-{i}" for i in range(2)]
    try:
        args = nymph_args(plane, base, readable_runtime, "--task-user", prefix, "--task-user-pool", "2")
        doctor = [*args[:3], "doctor", "--fix", *args[4:]]  # python -m nymph doctor --fix <the same>
        out = subprocess.run(doctor, capture_output=True, text=True, env=child_env(), timeout=LIMIT_S)
        assert f"[fix] task users: created 2 ({', '.join(names)})" in out.stdout, out.stdout + out.stderr
        assert "[ok] task-user: nymph runs as root; each task runs as a user of its own" in out.stdout
        assert all(pwd.getpwnam(name).pw_uid != 0 for name in names)
    finally:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


# --- the same cross-task attacks on the container runners -----------------------------------------


@pytest.mark.parametrize("runner", ["docker", "gvisor"])
def test_a_container_task_cannot_reach_a_sibling_container_task(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph], task_user: pwd.struct_passwd, runner: str
) -> None:
    """Each task is a container of its own (own PID and mount namespaces, only its workdir
    mounted): the sibling's workdir is not there to write, its processes not there to read or
    signal, whatever the uid (the container runners run every task as the one task user)."""
    from tests.runner_kit import options_for

    image = options_for(runner)["image"]  # requires an engine, runsc and the test image
    n = root_nymph(
        "--runner", runner, "--runner-opt", f"image={image}", "--runner-opt", "pull=never",
        "--concurrency", "2", process=False,
    )  # fmt: skip
    report, out_a, _ = _cross_task(plane, n, _container_pids)
    for attack in ("forge_result", "forge_error", "read_environ", "read_token_file"):
        assert report[attack] == "refused: FileNotFoundError", (attack, report)
    for attack in ("signal_child", "signal_victim"):  # no such process in the attacker's namespace
        assert report[attack] == "refused: ProcessLookupError", (attack, report)
    assert "environ_has_token" not in report
    assert out_a["state"] == "succeeded", (out_a, n.output()[-3000:])
    assert wire.unpack(out_a["result_blob"]) == "genuine A"


def _container_pids(invocation_id: str) -> tuple[int, int]:
    """The host pids of the victim's container (its init) and of a process below it: what an
    attacker on the host would aim at (the pids the victim sees are its container's own)."""
    import docker

    client = docker.from_env()
    try:
        (container,) = client.containers.list(filters={"label": f"nymph.invocation={invocation_id}"})
        init = int(container.attrs["State"]["Pid"])
    finally:
        client.close()
    below = psutil.Process(init).children(recursive=True)
    return init, below[-1].pid if below else init
