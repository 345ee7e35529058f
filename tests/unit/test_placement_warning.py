"""The submit's placement warning names what no live worker meets (server/liveness.py)."""

from __future__ import annotations

from typing import Any

import pytest

from dreamlake.lakeshore.server.liveness import placement_warning
from dreamlake.lakeshore.store.placement import Needs


def _worker(gpus: int = 0, labels: dict[str, str] | None = None, **task: Any) -> dict[str, Any]:
    capacity: dict[str, Any] = {"gpus": [{"index": i} for i in range(gpus)]}
    if task:
        capacity["task"] = task
    return {"capacity": capacity, "labels": labels or {}}


# a process nymph (memory capped, no CPU limit: cpus 0) and a 2-GPU one in pool a
FLEET = [_worker(memory=2**30, cpus=0), _worker(2, {"pool": "a"}, memory=2**30, cpus=0)]


@pytest.mark.parametrize(
    ("needs", "message"),
    [
        (Needs(cpus=2.0), "gives one task 2 CPUs (none can limit a task's CPUs)"),
        (Needs(gpus=4), "offers 4 GPUs (largest: 2)"),
        (Needs(memory=2**31), "gives one task 2 GiB of memory (largest: 1 GiB)"),
        (Needs(selector=(("pool", "b"),)), "has the labels pool=b"),
        (
            Needs(gpus=4, cpus=1.5),
            "offers 4 GPUs (largest: 2); nor gives one task 1.5 CPUs (none can limit a task's CPUs)",
        ),
        # a GPU some worker has: only the labels are named
        (Needs(gpus=1, selector=(("zone", "x"),)), "has the labels zone=x"),
    ],
)
def test_the_warning_names_only_what_is_unmet(needs: Needs, message: str) -> None:
    assert placement_warning("q", needs, FLEET) == f"no live worker of queue 'q' {message}"


def test_a_limit_some_worker_gives_is_named_with_the_largest() -> None:
    fleet = [_worker(cpus=1.0), _worker(cpus=0)]
    assert (
        placement_warning("q", Needs(cpus=2.0), fleet)
        == "no live worker of queue 'q' gives one task 2 CPUs (largest: 1)"
    )


def test_needs_met_apart_but_never_together_are_named_together() -> None:
    fleet = [_worker(2), _worker(0, {"pool": "a"})]
    got = placement_warning("q", Needs(gpus=1, selector=(("pool", "a"),)), fleet)
    assert got == "no live worker of queue 'q' has all of 1 GPU, pool=a at once"


def test_no_warning_when_a_worker_fits_or_none_is_live() -> None:
    assert placement_warning("q", Needs(gpus=2, selector=(("pool", "a"),)), FLEET) is None
    assert placement_warning("q", Needs(cpus=2.0), []) is None


@pytest.mark.parametrize(
    ("asked", "largest", "said"),
    [
        # the QA case: "99999 TiB of memory (largest: 22748575334 bytes)" mixed units
        (99999 * 2**40, 22748575334, "99999 TiB of memory (largest: 21.2 GiB)"),
        (3 * 2**29, 2**29, "1.5 GiB of memory (largest: 512 MiB)"),
        (1000 * 2**10, 999 * 2**10, "1000 KiB of memory (largest: 999 KiB)"),
        # too close to tell apart in three digits: both exactly, in bytes
        (2**30 + 2**20, 2**30, "1074790400 bytes of memory (largest: 1073741824 bytes)"),
    ],
)
def test_the_memory_warning_writes_both_sizes_one_way(asked: int, largest: int, said: str) -> None:
    got = placement_warning("q", Needs(memory=asked), [_worker(memory=largest)])
    assert got == f"no live worker of queue 'q' gives one task {said}"
