"""run_config.resources read one way (nymph.resources) and refused one way by every runner."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore import gpucount, ids
from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.store.placement import needs_of
from dreamlake.lakeshore.store.values import check_run_config
from nymph.resources import ResourceError, Resources, parse_defaults, parse_resources
from nymph.runner import RunnerError, Task
from nymph.slots import gpus_requested


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("64k", 64 * 2**10),
        ("512m", 512 * 2**20),
        ("1g", 2**30),
        ("2GiB", 2 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1.5Gi", 3 * 2**29),
    ],
)
def test_sizes(value: object, expected: int) -> None:
    assert parse_resources({"memory": value}, "any").memory == expected
    assert parse_resources({"shm": value}, "any").shm == expected


@pytest.mark.parametrize("value", [0, -1, True, "0.5", 0.5, "lots", "", None, "1x", float("inf")])
def test_bad_sizes_name_the_field_and_the_value(value: object) -> None:
    # "0.5" / 0.5 used to parse as 0 bytes, which docker reads as "no limit"
    with pytest.raises(RunnerError, match=r"resources\.memory: expected a positive size .* got"):
        parse_resources({"memory": value}, "any")


@pytest.mark.parametrize(
    ("value", "millicpus"), [(2, 2000), (1.5, 1500), ("1.5", 1500), ("500m", 500), ("0.25", 250)]
)
def test_cpus_as_numbers_or_millicores(value: object, millicpus: int) -> None:
    parsed = parse_resources({"cpus": value}, "any")
    assert parsed.millicpus == millicpus and parsed.cpus == millicpus / 1000
    assert parse_resources({"cpu": value}, "any") == parsed  # Kubernetes' name is an alias


def test_aliases_whole_numbers_and_defaults() -> None:
    assert parse_resources({"nvidia.com/gpu": 2, "pids": "64"}, "any") == Resources(gpus=2, pids=64)
    assert parse_resources(None, "any") == Resources() and Resources().given() == ()
    defaults = parse_defaults("docker", cpus=None, memory="1g", pids=512, shm=None)
    task = parse_resources({"memory": "256m", "gpus": 0}, "docker").over(defaults)
    assert task == Resources(memory=256 * 2**20, pids=512, gpus=0)
    assert task.given() == ("memory", "pids", "gpus")
    with pytest.raises(
        ResourceError, match=r"^docker runner: runner_options\.memory: expected a positive size"
    ):
        parse_defaults("docker", memory="lots")


@pytest.mark.parametrize(
    "resources",
    [
        {"gpus": 1},
        {"gpus": 1.0},
        {"gpus": "2"},
        {"gpus": 0},
        {"nvidia.com/gpu": 1},
        {"nvidia.com/gpu": "3"},
        {"gpus": 1.5},
        {"gpus": "1.0"},
        {"gpus": -1},
        {"gpus": True},
        {"gpus": 2000},
        {"gpus": 1, "nvidia.com/gpu": 1},
    ],
)
def test_a_gpu_count_is_placed_as_nymph_runs_it(resources: dict[str, Any]) -> None:
    """The control plane's placement, the runners' reading and the devices nymph takes agree on
    every value: a count placed is the count run (the alias used to be placed as 1 GPU and run
    with none; 1.0 placed, then refused by the runner), a value refused is refused by both."""
    try:
        placed: int | None = needs_of({"resources": resources}, "default").gpus
    except PlaneError as exc:
        assert exc.status == 400
        placed = None
    try:
        run: int | None = parse_resources(resources, "any").gpus or 0
    except ResourceError:
        run = None
    assert placed == run, (placed, run)
    assert gpus_requested({"resources": resources}) == (placed or 0)


@pytest.mark.parametrize("resources", [{"cpus": 2}, {"cpu": 2}, {"cpu": "500m"}, {"cpus": "1.5"}, {}])
def test_cpus_are_placed_as_nymph_limits_them(resources: dict[str, Any]) -> None:
    """``cpu`` (Kubernetes' name) limits the task to that many CPUs on every runner, and used to be
    placed as no CPUs at all: a 4-CPU call went to a host with 1 free. Placement reads the field
    or its alias as the runners do."""
    limited = parse_resources(resources, "any").cpus
    assert needs_of({"resources": resources}, "default").cpus == (limited or 0.0)


_LIMITS = [
    ({"memory": 0}, "memory must be a positive size such as 512m, 1g or 512Mi, got 0"),
    ({"memory": "0"}, "memory must be a positive size"),
    ({"memory": "0Mi"}, "memory must be a positive size"),
    ({"memory": 0.5}, "memory must be a positive size"),
    ({"memory": "lots"}, "memory must be a positive size"),
    ({"shm": 0}, "shm must be a positive size"),
    ({"cpus": 0}, "cpus must be a positive number of CPUs"),
    ({"cpus": "0"}, "cpus must be a positive number of CPUs"),
    ({"cpus": "0m"}, "cpus must be a positive number of CPUs"),
    ({"cpus": 0.0001}, "cpus must be a positive number of CPUs"),  # 0 millicores
    ({"cpu": 0}, "cpu must be a positive number of CPUs"),
    ({"pids": 0}, "pids must be a positive whole number, got 0"),
    ({"pids": "many"}, "pids must be a positive whole number"),
    ({"pids": 1.5}, "pids must be a positive whole number"),
    ({"cpus": 1, "cpu": 2}, "cpus is given twice (as 'cpus' and 'cpu'): give it once"),
    ({"memory": 1}, None),
    ({"memory": "512Mi"}, None),
    ({"shm": "64m"}, None),
    ({"cpus": "500m"}, None),
    ({"cpus": 0.5}, None),
    ({"cpu": "1.5"}, None),
    ({"pids": "64"}, None),
    # a name nymph does not know: every runner fails the call before it runs (ResourceError)
    ({"gpu": 1}, "gpu is not a resource nymph knows: use cpus, memory, pids, shm, gpus"),
    ({"mem": "1g"}, "mem is not a resource nymph knows"),
    ({"disk": 1}, "disk is not a resource nymph knows"),
]


@pytest.mark.parametrize(("resources", "refused"), _LIMITS)
def test_a_limit_nymph_refuses_is_refused_at_submit(resources: dict[str, Any], refused: str | None) -> None:
    """``memory: 0`` and ``cpus: "0"`` used to be queued (0 read as "not asked") and then failed by
    nymph (``ResourceError: expected a positive ...``): submit refuses, with nymph's words, what
    nymph would refuse, and accepts what it runs."""
    try:
        parse_resources(resources, "any")
        runs = True
    except ResourceError:
        runs = False
    assert runs == (refused is None)
    if refused is None:
        check_run_config({"resources": resources})
        needs_of({"resources": resources}, "default")
        return
    with pytest.raises(PlaneError, match="^run_config.resources." + re.escape(refused)) as err:
        check_run_config({"resources": resources})
    assert err.value.status == 400
    (name,) = set(resources) if len(resources) == 1 else ("",)
    if name in ("memory", "cpus", "cpu"):  # placement reads these the same way
        with pytest.raises(PlaneError, match=f"^run_config.resources.{name} must be a positive"):
            needs_of({"resources": resources}, "default")


@pytest.mark.parametrize("value", [-1, True, None, math.nan, math.inf, 1.5, "two", 2000])
@pytest.mark.parametrize("name", ["gpus", "nvidia.com/gpu"])
def test_a_bad_gpu_count_is_refused_saying_what_a_gpu_count_is(name: str, value: object) -> None:
    """The general resources words (``a finite number >= 0 or a size such as '512Mi'``) used to
    answer a bad GPU count, the general check running before the GPU one: the 400 says what a GPU
    count must be, as gpucount (and nymph) say it."""
    with pytest.raises(PlaneError) as err:
        check_run_config({"resources": {name: value}})
    assert err.value.status == 400
    assert str(err.value).startswith(f"run_config.resources.{name} must be {gpucount.EXPECTED}, got "), (
        err.value
    )


# --- every runner: one table of inputs, one error shape -----------------------------------------

OK = None
ALL = ("process", "docker", "gvisor", "kube", "slurm")


def _everywhere(outcome: str | None) -> dict[str, str | None]:
    return dict.fromkeys(ALL, outcome)


#: (run_config.resources, {runner: None when accepted, else the field it refuses}); "" is the
#: mapping as a whole (unknown keys, not a table); "memory?" / "pids?": the process runner holds
#: it where the task cgroups have that controller (nymph.limits), and refuses it elsewhere
#: ("memory?shm": where it holds memory, it refuses shm next).
TABLE: list[tuple[Any, dict[str, str | None]]] = [
    ({}, _everywhere(OK)),
    ({"gpus": 1}, _everywhere(OK)),
    ({"nvidia.com/gpu": 2}, _everywhere(OK)),
    ({"cpus": 2}, {**_everywhere(OK), "process": "cpus"}),
    ({"cpus": "500m"}, {**_everywhere(OK), "process": "cpus"}),
    ({"cpu": 1.5}, {**_everywhere(OK), "process": "cpus"}),
    ({"memory": "512Mi"}, {**_everywhere(OK), "process": "memory?"}),
    ({"memory": "1g", "shm": "64m"}, {**_everywhere(OK), "process": "memory?shm", "slurm": "shm"}),
    ({"shm": "64m"}, {**_everywhere(OK), "process": "shm", "slurm": "shm"}),
    ({"pids": 100}, {**_everywhere(OK), "process": "pids?", "kube": "pids", "slurm": "pids"}),
    ({"cpus": True}, _everywhere("cpus")),
    ({"cpus": 0}, _everywhere("cpus")),
    ({"cpus": "lots"}, _everywhere("cpus")),
    ({"memory": "lots"}, _everywhere("memory")),
    ({"pids": 0}, _everywhere("pids")),
    ({"gpus": -1}, _everywhere("gpus")),
    ({"gpus": True}, _everywhere("gpus")),
    ({"gpus": 1.0}, _everywhere(OK)),  # as the control plane places it (dreamlake.lakeshore.gpucount)
    ({"gpus": 1.5}, _everywhere("gpus")),
    ({"cpus": 1, "cpu": 2}, _everywhere("cpus")),
    ({"disk": "1g"}, _everywhere("")),
    ("2 cpus", _everywhere("")),
]


@pytest.fixture(scope="module")
def appliers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Callable[[Any], object]]]:
    """Each runner's own reading of ``run_config.resources``: what its start does with it."""
    from nymph_docker import DockerRunner
    from nymph_gvisor import GVisorRunner
    from nymph_kube import KubeRunner
    from nymph_process import ProcessRunner
    from nymph_slurm.jobs import resource_args

    process = ProcessRunner(prefork=False)
    root = tmp_path_factory.mktemp("process")

    def start_process(resources: Any) -> object:
        """A real start (of ``true``): refused before anything is spawned, else run and destroyed."""
        workdir = root / ids.new_ulid()
        workdir.mkdir()
        task = Task(ids.new_ulid(), 1, workdir, {}, script="true", run_config={"resources": resources})
        try:
            handle = process.start(task)
        except ResourceError:
            assert list(workdir.iterdir()) == []  # nothing spawned, no log opened
            raise
        process.wait(handle, 30)
        process.destroy(handle)
        return handle

    yield {
        "process": start_process,
        "docker": DockerRunner().limits,
        "gvisor": GVisorRunner().limits,
        "kube": KubeRunner(node_name="n").limits,
        "slurm": lambda resources: resource_args(resources, 0),
    }
    process.close()


@pytest.mark.parametrize(("resources", "outcomes"), TABLE, ids=[repr(r) for r, _ in TABLE])
def test_every_runner_accepts_or_refuses_with_the_same_error_shape(
    appliers: dict[str, Callable[[Any], object]], resources: Any, outcomes: dict[str, str | None]
) -> None:
    assert set(outcomes) == set(appliers)
    for runner, field in outcomes.items():
        if field is not None and "?" in field:
            held, _, then = field.partition("?")
            field = (then or None) if held in _process_controllers() else held
        if field is None:
            appliers[runner](resources)
            continue
        with pytest.raises(ResourceError) as info:
            appliers[runner](resources)
        err = info.value
        where = r"run_config\.resources" + (re.escape("." + field) if field else "")
        assert (err.runner, err.field) == (runner, field), str(err)
        assert re.fullmatch(rf"{runner} runner: {where}: .+; .+", str(err)), str(err)
        assert err.problem and err.fix and isinstance(err, RunnerError)


def _process_controllers() -> tuple[str, ...]:
    """The controllers the process runner limits tasks with on this host (nymph.limits)."""
    from nymph import cgroup, limits

    tree = cgroup.detect().tree
    return limits.detect(None if tree is None else tree.base).available


def test_a_field_a_runner_cannot_enforce_says_why_and_what_to_do(
    appliers: dict[str, Callable[[Any], object]],
) -> None:
    with pytest.raises(ResourceError) as info:
        appliers["kube"]({"pids": 100})
    assert str(info.value) == (
        "kube runner: run_config.resources.pids: not enforced by this runner (a pod cannot set its own "
        "pids limit: the kubelet's podPidsLimit does); leave it out, or send the task to a nymph whose "
        "runner enforces it"
    )


def test_the_same_cpus_on_every_runner(appliers: dict[str, Callable[[Any], object]]) -> None:
    half = {"cpus": "500m"}
    assert appliers["docker"](half) == {"nano_cpus": 500_000_000}
    assert appliers["kube"](half) == ({"requests": {"cpu": "500m"}, "limits": {"cpu": "500m"}}, None)
    assert appliers["slurm"](half) == ["--cpus-per-task=1"]  # Slurm allocates whole CPUs
    gib = {"memory": "1Gi", "shm": "64m"}
    assert appliers["docker"](gib) == {"mem_limit": 2**30, "memswap_limit": 2**30, "shm_size": 64 * 2**20}
    limits = {"memory": str(2**30)}
    assert appliers["kube"](gib) == ({"requests": limits, "limits": limits}, 64 * 2**20)
    assert appliers["gvisor"]({"pids": 64})["pids_limit"] == 1024  # raised: gVisor's threads count


def test_runner_defaults_are_read_the_same_way(tmp_path: Path) -> None:
    from nymph_docker import DockerRunner
    from nymph_kube import KubeRunner

    assert DockerRunner(cpus="500m", memory="1g").limits({"memory": "256m"}) == {
        "nano_cpus": 500_000_000,
        "mem_limit": 256 * 2**20,
        "memswap_limit": 256 * 2**20,
    }
    assert KubeRunner(node_name="n", shm="64m").limits(None, gpus=2) == (
        {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}},
        64 * 2**20,
    )
    with pytest.raises(ResourceError, match=r"^kube runner: runner_options\.cpus: expected"):
        KubeRunner(node_name="n", cpus="-1")
