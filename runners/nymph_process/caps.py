"""The process runner's resource limits: what a task may ask for, and its caps.

Each task cgroup gets ``memory.max`` and ``pids.max`` where the controllers exist
(:mod:`nymph.limits`: cgroup v2 under ``nymph-tasks``, or the v1 ``memory`` / ``pids`` hierarchies
of a hybrid host, joined with the cgroup2 one before the task runs): ``run_config.resources``'
``memory`` / ``pids``, else the runner's caps (options ``memory``, default ``"90%"`` of the host,
and ``pids``, default 4096: ``nymph start --task-memory-max`` / ``--task-pids-max``); a task
asking above a cap, or for a field no controller here holds (``cpus``, ``shm``, and ``memory`` /
``pids`` without their controller), is refused with :class:`~nymph.resources.ResourceError`
(:func:`asked`). A task the kernel killed at its memory limit exits with ``ExitStatus.oom`` set
(the limit and the peak), reported as ``OutOfMemory``. ``gpus`` is assigned through
``CUDA_VISIBLE_DEVICES``. Warm workers get no limits of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nymph import limits
from nymph.resources import ResourceError, Resources, parse_resources
from nymph.runner import RunnerError

#: run_config.resources fields a local process cannot be held to, with why (see nymph.resources);
#: memory and pids are held where the task cgroups have those controllers (nymph.limits)
UNSUPPORTED_RESOURCES = dict.fromkeys(("cpus", "shm"), "the process runner does not limit it")
_NO_CONTROLLER = "this host's task cgroups have no {} controller (`nymph doctor` says why)"
PIDS_MAX_DEFAULT = 4096  # nymph start --task-pids-max
MEMORY_MAX_DEFAULT = "90%"  # of the host's memory: nymph start --task-memory-max


def asked(runner: str, resources: Any, controllers: limits.Controllers, caps: Resources) -> Resources:
    """The task's memory and pids limits: what it asks for (refused above nymph's caps, or
    where no controller holds it), else the caps."""
    unsupported = dict(UNSUPPORTED_RESOURCES)
    for name in limits.CONTROLLERS:
        if name not in controllers.available:
            unsupported[name] = _NO_CONTROLLER.format(name)
    wanted = parse_resources(resources, runner, unsupported=unsupported)
    for name, flag in (("memory", "--task-memory-max"), ("pids", "--task-pids-max")):
        value, cap = getattr(wanted, name), getattr(caps, name)
        if value is not None and cap is not None and value > cap:
            shown = limits.size(value) if name == "memory" else str(value)
            capped = limits.size(cap) if name == "memory" else str(cap)
            raise ResourceError(
                runner,
                name,
                f"asks for {shown}, above this nymph's cap of {capped} ({flag})",
                f"ask for {capped} or less, or raise {flag} on the nymph",
            )
    return wanted.over(caps)


def apply(controllers: limits.Controllers, cgroup: Path, name: str, wanted: Resources) -> list[Path] | None:
    """Set ``wanted``'s memory and pids limits on the task's cgroup(s) -> the v1 cgroups it joins
    too (None: no controller here, nothing set)."""
    if not controllers.available:
        return None
    memory = wanted.memory if "memory" in controllers.available else None
    pids = wanted.pids if "pids" in controllers.available else None
    try:
        return controllers.apply(cgroup, name, memory, pids)
    except OSError as exc:
        raise RunnerError(f"process runner: cannot set the task's limits in {cgroup}: {exc}") from exc


def memory_cap(value: int | str | None) -> int | str | None:
    """``--task-memory-max``: a size, or a share of the host's memory (``"90%"``); None: no cap."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ResourceError(
                "process",
                "memory",
                f"not a share of the host's memory: {value!r}",
                "give a size (512m, 8g) or a share between 1% and 100%",
                source="runner_options",
            )
        total = limits.host_memory()
        return None if total is None else int(total * share / 100)
    return value
