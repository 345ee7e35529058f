"""A producer's call may not steer how nymph's own processes start its task.

nymph starts a task with the task's environment: the process runner's zygote (a long-lived
interpreter that forks the tasks, root's on a root nymph, dropping to the task's user only in
each child), ``runuser``, the cgroup join. Before, a call's ``env={"LD_PRELOAD": ...}`` (or
``PYTHONUSERBASE``, whose ``.pth`` files an interpreter runs as it starts) reached that zygote,
which loaded the library as root: a file an earlier task of the producer's left in /tmp was enough.
Such names are now refused at submit (400 naming the name and what to do), in ``env`` and as a
secret's name (a secret's value lands in the same environment), and nothing is stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import running_control_plane, submit_body

pytestmark = [pytest.mark.timeout(120)]


@pytest.mark.parametrize(
    "run_config",
    [
        {"env": {"LD_PRELOAD": "/tmp/evil.so"}},
        {"env": {"LD_AUDIT": "/tmp/evil.so"}},
        {"env": {"PYTHONUSERBASE": "/tmp/evil"}},
        {"env": {"PYTHONHOME": "/tmp/evil"}},
        {"secrets": ["LD_LIBRARY_PATH"]},
    ],
)
def test_a_call_cannot_set_what_its_tasks_loader_or_interpreter_reads_at_start(
    tmp_path: Path, run_config: dict[str, object]
) -> None:
    with running_control_plane(str(tmp_path / "s.db")) as cp:
        inv = new_ulid()
        status, out = cp.call(
            "/v1/producer/submit", submit_body(inv, "q", run_config=run_config), cp.producer_token
        )
        assert status == 400, out
        assert "changes how the processes that start a task load" in out["error"], out
        assert "--pass-env" in out["error"], out
        assert cp.store.get(inv) is None


def test_a_secret_cannot_be_named_for_the_loader(tmp_path: Path) -> None:
    with running_control_plane(str(tmp_path / "s.db")) as cp:
        for name in ("LD_PRELOAD", "PYTHONPATH"):
            status, out = cp.json(
                "PUT", f"/v1/namespaces/default/secrets/{name}", {"value": "/tmp/evil.so"}, cp.producer_token
            )
            assert status == 400 and name in out["error"], (name, status, out)
        status, out = cp.json("GET", "/v1/namespaces/default/secrets", None, cp.producer_token)
        assert status == 200 and out["secrets"] == [], out


@pytest.mark.parametrize("mount", ["../etc", "/etc", "data sets", "a\nb", "x" * 64])
def test_a_mount_name_no_operator_could_declare_is_refused_at_submit(tmp_path: Path, mount: str) -> None:
    # before: stored, claimed and acked failed by nymph (MountRefused), whose advice named an
    # impossible `--mount ../etc=/host/path[:ro]`
    with running_control_plane(str(tmp_path / "s.db")) as cp:
        inv = new_ulid()
        body = submit_body(inv, "q", run_config={"mounts": [mount]})
        status, out = cp.call("/v1/producer/submit", body, cp.producer_token)
        assert status == 400 and "is not a mount name" in out["error"], out
        assert "\n" not in out["error"]
        assert cp.store.get(inv) is None
