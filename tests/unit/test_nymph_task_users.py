"""Who tasks run as (nymph.taskuser's pool) and how an OOM kill is read and reported (nymph.limits).

The pool's leases are what keep two running tasks on different uids; the OOM reading is what turns
a SIGKILL from the kernel into ``OutOfMemory`` with the limit and the peak. The real thing (root
nymph, real users, real cgroups) is tests/security/test_task_isolation.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nymph import workdir as wd
from nymph.config import NymphConfig
from nymph.limits import Controllers, OomKill, size
from nymph.runner import ExitStatus
from nymph.taskuser import TaskUserError, TaskUsers, pool_names


def test_each_holder_gets_a_user_of_its_own_until_it_gives_it_back() -> None:
    users = TaskUsers("shared", ["u-0", "u-1"], pooled=True, fallback=False)
    a, b, c = object(), object(), object()
    assert users.acquire(a) == "u-0" and users.acquire(b) == "u-1"
    assert users.acquire(a) == "u-0"  # asked again (a start retried): the same user
    with pytest.raises(TaskUserError, match="--shared-task-user"):
        users.acquire(c)  # used up, and the operator did not allow sharing
    users.release(a)
    assert users.acquire(c) == "u-0"
    assert users.users() == ["u-0", "u-1"]


def test_a_used_up_pool_falls_back_to_the_shared_user_only_when_allowed() -> None:
    users = TaskUsers("shared", ["u-0"], pooled=True, fallback=True)
    assert users.acquire(object()) == "u-0" and users.acquire(object()) == "shared"
    assert users.users() == ["u-0", "shared"]
    unpooled = TaskUsers("shared", [], pooled=False, fallback=True)
    assert unpooled.acquire(object()) == "shared" and unpooled.users() == ["shared"]


def test_a_recovered_task_keeps_its_user() -> None:
    users = TaskUsers(None, ["u-0", "u-1"], pooled=True, fallback=False)
    recovered = object()
    users.hold(recovered, "u-0")
    assert users.acquire(object()) == "u-1"
    users.hold(object(), "not-in-the-pool")  # an as_user task's, or a shared one: not the pool's
    assert users.acquire(recovered) == "u-0"


def test_the_pool_is_named_after_the_task_user_and_its_problem_says_what_to_do() -> None:
    cfg = NymphConfig(server="x", token="t", task_user="svc", task_user_pool=3, concurrency=2)
    assert pool_names(cfg) == ["svc-0", "svc-1", "svc-2"]
    problem = TaskUsers("svc", ["svc-0"], pooled=True, fallback=False).pool_problem(cfg)
    assert "1 of svc-0 .. svc-2 exist and --concurrency 2 needs 2" in problem
    for fix in ("nymph doctor --fix", "--shared-task-user", "--allow-root-tasks", "--task-user"):
        assert fix in problem


def _files(path: Path, **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text)
    return path


def test_an_oom_kill_is_read_from_the_v2_cgroup_or_the_v1_memory_cgroup(tmp_path: Path) -> None:
    v2 = _files(
        tmp_path / "v2",
        memory__events="low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n",
        memory__max="134217728\n",
    )
    (v2 / "memory.peak").write_text("134213632\n")
    assert Controllers(v2=("memory", "pids")).oom(v2, []) == OomKill(134217728, 134213632)
    calm = _files(tmp_path / "calm", memory__events="oom 0\noom_kill 0\n", memory__max="max\n")
    assert Controllers(v2=("memory",)).oom(calm, []) is None
    v1 = _files(
        tmp_path / "v1",
        memory__oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        memory__limit_in_bytes="268435456\n",
        memory__max_usage_in_bytes="268431360\n",
    )
    assert Controllers(v1={"memory": tmp_path}).oom(None, [v1]) == OomKill(268435456, 268431360)


def test_an_oom_kill_is_acked_out_of_memory_with_the_limit_and_the_peak(tmp_path: Path) -> None:
    status = ExitStatus(-9, "OOMKilled", "Killed", oom={"limit": 128 << 20, "peak": (128 << 20) - 4096})
    outcome = wd.read_outcome(tmp_path, status)
    assert outcome.state == "failed" and outcome.error is not None
    assert outcome.error["type"] == "OutOfMemory"
    assert "memory limit of 128 MiB (peak 128 MiB)" in outcome.error["message"]
    assert outcome.error["memory_limit"] == 128 << 20
    # a container runner's OOMKilled (no figures) is the same outcome
    docker = wd.read_outcome(tmp_path, ExitStatus(137, "OOMKilled"))
    assert docker.error is not None and docker.error["type"] == "OutOfMemory"
    assert docker.error["memory_limit"] is None
    slurm = wd.read_outcome(tmp_path, ExitStatus(-125, "OOMKilled; Slurm reason: OutOfMemory"))
    assert slurm.error is not None and slurm.error["type"] == "OutOfMemory"


def test_sizes_read_as_people_write_them() -> None:
    assert [size(n) for n in (512, 128 << 20, 1536 << 20, 3 << 40)] == [
        "512 B",
        "128 MiB",
        "1.5 GiB",
        "3.0 TiB",
    ]
