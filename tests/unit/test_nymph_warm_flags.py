"""``nymph start --warm`` / ``--warm-max-calls``: shorthands of the process runner's warm options,
with the slot count as the pool size (docs/nymph.md "Warm mode")."""

from __future__ import annotations

from typing import Any

import click
import pytest

from nymph.cli import _resolve

BASE = {"server": "http://cp", "token": "t"}


def _opts(**flags: Any) -> dict[str, Any]:
    return dict(_resolve({**BASE, **flags}).runner_options)


TASK_USER = {"warm_users": ["nymph-task"]}  # a root nymph's tasks (and so its warm workers) run as it
# the task cgroups' caps (--task-memory-max, --task-pids-max), and as many zygotes as slots, 4 at least
CAPS = {"memory": "90%", "pids": 4096, "zygotes": 4}


def test_warm_turns_the_mode_on_with_one_worker_per_slot() -> None:
    assert _opts(warm=True, concurrency=4) == {"warm": True, "warm_workers": 4, **TASK_USER, **CAPS}
    assert _opts(warm=True, warm_max_calls=100) == {
        "warm": True,
        "warm_max_calls": 100,
        "warm_workers": 1,
        **TASK_USER,
        **CAPS,
    }
    assert _opts(warm=True, task_user="svc")["warm_users"] == ["svc"]


def test_off_by_default_and_runner_opts_still_win() -> None:
    assert _opts() == CAPS
    assert _opts(warm=False) == {"warm": False, **CAPS}
    assert _opts(warm=True, runner_opts=("warm_workers=2",), concurrency=8)["warm_workers"] == 2
    assert _opts(runner_opts=("warm=true",), concurrency=3) == {
        "warm": True,
        "warm_workers": 3,
        **TASK_USER,
        **CAPS,
    }


def test_the_task_caps_reach_the_process_runner_and_a_runner_opt_still_wins() -> None:
    assert _opts(task_memory_max="2g", task_pids_max=64) == {"memory": "2g", "pids": 64, "zygotes": 4}
    assert _opts(task_memory_max="0", task_pids_max=0) == {"memory": None, "pids": None, "zygotes": 4}
    assert _opts(task_memory_max="2g", runner_opts=("memory=1g",))["memory"] == "1g"
    assert _opts(runner="docker") == {}  # a container runner has limits of its own


def test_prefork_keeps_as_many_zygotes_as_slots_four_at_least() -> None:
    assert _opts(concurrency=16)["zygotes"] == 16
    assert _opts(concurrency=2)["zygotes"] == 4
    assert _opts(concurrency=16, runner_opts=("zygotes=2",))["zygotes"] == 2


def test_bad_values_and_other_runners_are_refused_with_what_to_do() -> None:
    with pytest.raises(click.UsageError, match="--warm-max-calls must be 0"):
        _opts(warm=True, warm_max_calls=-1)
    with pytest.raises(click.UsageError, match=r"modes of the process runner.*--runner process"):
        _opts(warm=True, runner="docker")
