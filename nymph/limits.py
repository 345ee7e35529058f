"""Memory and process limits in a task's cgroup, and the out-of-memory kill a task may end in.

A task of the process runner shares its host: without limits one task that allocates without
bound takes the host's memory (the kernel's OOM killer then picks any process, nymph included),
and a fork bomb takes its process table. So each task cgroup (:mod:`nymph.cgroup`) gets
``memory.max`` and ``pids.max``, from the task's ``run_config.resources`` (``memory``, ``pids``)
or nymph's defaults (``--task-memory-max``, default 90% of the host's memory; ``--task-pids-max``,
default 4096). A task asking for more than nymph's cap is refused before it runs.

Where the controllers are (:func:`detect`):

- **cgroup v2**: ``memory`` and ``pids`` enabled for the children of ``nymph-tasks``
  (``+memory +pids`` written to its ``cgroup.subtree_control``; they must be enabled in nymph's
  own cgroup first: under systemd, ``Delegate=yes`` and nymph in a leaf of its own, or a root
  cgroup). The limits are ``memory.max`` / ``pids.max`` in the task's cgroup; an OOM kill shows as
  ``oom_kill`` in its ``memory.events``, the peak in ``memory.peak``.
- **cgroup v1** (a hybrid host: the cgroup2 tree has no memory controller, the v1 ``memory`` and
  ``pids`` hierarchies are mounted): a cgroup per task under ``<mount><nymph's cgroup>/nymph-tasks``
  in each hierarchy, ``memory.limit_in_bytes`` and ``pids.max``; the task joins them with its
  cgroup2 one, before anything of it runs. An OOM kill shows as ``oom_kill`` in ``memory.oom_control``,
  the peak in ``memory.max_usage_in_bytes``.

Neither: no limits, and ``nymph doctor`` says so (``run_config.resources`` asking for ``memory``
or ``pids`` is then refused, as before). A task killed at its memory limit is reported as
``OutOfMemory`` with the limit and the peak (:class:`OomKill`), which the control plane does not
retry unless ``retry_on`` names it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from nymph.cgroup import MOUNTINFO, SELF_CGROUP, TASKS_DIR

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids")
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class OomKill:
    """A task the kernel killed at its memory limit: the limit and the peak usage, in bytes."""

    limit: int | None
    peak: int | None

    def message(self) -> str:
        limit = "its memory limit" if self.limit is None else f"its memory limit of {size(self.limit)}"
        peak = "" if self.peak is None else f" (peak {size(self.peak)})"
        return (
            f"the task ran out of memory: the kernel killed it at {limit}{peak}; ask for more with "
            "run_config.resources={'memory': ...} (up to this nymph's --task-memory-max), or use less"
        )


def size(n: int) -> str:
    """Bytes in a short binary unit: ``268435456`` -> ``256 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 10 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def host_memory(meminfo: Path = MEMINFO) -> int | None:
    """The host's memory in bytes (``MemTotal``); None when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class Controllers:
    """Where task cgroups get their limits: ``v2`` (the controllers enabled under ``nymph-tasks``)
    and ``v1`` (controller -> the ``nymph-tasks`` directory of its v1 hierarchy)."""

    v2: tuple[str, ...] = ()
    v1: dict[str, Path] = field(default_factory=dict)
    problem: str = ""

    @property
    def available(self) -> tuple[str, ...]:
        return tuple(c for c in CONTROLLERS if c in self.v2 or c in self.v1)

    def describe(self) -> str:
        """One line for ``nymph doctor``: which controllers limit tasks, and from where."""
        parts = [f"{c} (cgroup v2)" for c in self.v2] + [f"{c} (cgroup v1, {p})" for c, p in self.v1.items()]
        missing = [c for c in CONTROLLERS if c not in self.available]
        line = "task limits: " + (", ".join(parts) if parts else "none")
        if missing:
            line += f"; no {' / '.join(missing)} controller: {self.problem or 'not available'}"
        return line

    def apply(self, v2_path: Path, name: str, memory: int | None, pids: int | None) -> list[Path]:
        """Set the limits of task ``name`` (its cgroup2 directory ``v2_path``); the v1 cgroups it
        must join besides (their ``cgroup.procs``), made here. Raises OSError when one cannot be set."""
        joins: list[Path] = []
        for controller, value in (("memory", memory), ("pids", pids)):
            if value is None:
                continue
            if controller in self.v2:
                _write(v2_path / f"{controller}.max", str(value))
            elif controller in self.v1:
                path = self.v1[controller] / name
                path.mkdir(exist_ok=True)
                _write(path / ("memory.limit_in_bytes" if controller == "memory" else "pids.max"), str(value))
                joins.append(path / "cgroup.procs")
        return joins

    def oom(self, v2_path: Path | None, v1_paths: list[Path]) -> OomKill | None:
        """The OOM kill of a task that ended (its cgroups not yet removed); None when none happened."""
        if v2_path is not None and "memory" in self.v2:
            events = _keyed(v2_path / "memory.events")
            if events.get("oom_kill", 0) > 0:
                return OomKill(_int(v2_path / "memory.max"), _int(v2_path / "memory.peak"))
        for path in v1_paths:
            control = path / "memory.oom_control"
            if control.exists() and _keyed(control).get("oom_kill", 0) > 0:
                return OomKill(_int(path / "memory.limit_in_bytes"), _int(path / "memory.max_usage_in_bytes"))
        return None

    @staticmethod
    def remove(v1_paths: list[Path]) -> None:
        """Remove a task's v1 cgroups (empty once its cgroup2 one was killed); gone is fine."""
        for path in v1_paths:
            with contextlib.suppress(FileNotFoundError):
                try:
                    path.rmdir()
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        log.warning("cgroup %s: cannot remove it: %s", path, exc.strerror)


def detect(
    tasks_base: Path | None, mountinfo: Path = MOUNTINFO, self_cgroup: Path = SELF_CGROUP
) -> Controllers:
    """The controllers task cgroups under ``tasks_base`` (the cgroup2 ``nymph-tasks``) can use."""
    if tasks_base is None:
        return Controllers(problem="no task cgroups (see the cgroups check)")
    found = Controllers()
    problems = []
    try:
        offered = (tasks_base / "cgroup.controllers").read_text().split()
    except OSError:
        offered = []
    for controller in CONTROLLERS:
        if controller not in offered:
            with contextlib.suppress(OSError):  # nymph's own cgroup may delegate it (it must be empty)
                _write(tasks_base.parent / "cgroup.subtree_control", f"+{controller}")
                offered = (tasks_base / "cgroup.controllers").read_text().split()
        if controller not in offered:
            continue
        try:
            _write(tasks_base / "cgroup.subtree_control", f"+{controller}")
            found.v2 += (controller,)
        except OSError as exc:
            problems.append(f"cannot enable {controller} under {tasks_base}: {exc.strerror}")
    missing = [c for c in CONTROLLERS if c not in found.v2]
    if missing:
        found.v1, why = _v1_bases(missing, mountinfo, self_cgroup)
        problems += why
    if [c for c in CONTROLLERS if c not in found.available]:
        found.problem = "; ".join(problems) or (
            f"neither {tasks_base.parent} delegates it (cgroup v2: Delegate=yes, nymph in a leaf "
            "cgroup of its own) nor is a cgroup v1 hierarchy of it mounted"
        )
    return found


def _v1_bases(wanted: list[str], mountinfo: Path, self_cgroup: Path) -> tuple[dict[str, Path], list[str]]:
    """``nymph-tasks`` in the v1 hierarchy of each ``wanted`` controller, created and proven writable."""
    mounts: dict[str, Path] = {}
    try:
        for line in mountinfo.read_text().splitlines():
            left, sep, right = line.partition(" - ")
            fields = right.split()
            if sep and fields and fields[0] == "cgroup" and len(fields) >= 3:
                for option in fields[2].split(","):
                    if option in wanted:
                        mounts[option] = Path(left.split()[4])
    except (OSError, IndexError):
        return {}, []
    own: dict[str, str] = {}
    try:
        for line in self_cgroup.read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(","):
                own[name] = path
    except (OSError, ValueError):
        pass
    bases: dict[str, Path] = {}
    problems = []
    for controller, mount in mounts.items():
        base = mount / own.get(controller, "/").lstrip("/") / TASKS_DIR
        probe = base / f"probe-{os.getpid()}"
        try:
            base.mkdir(exist_ok=True)
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            problems.append(f"cannot use the cgroup v1 {controller} hierarchy at {base}: {exc.strerror}")
            continue
        bases[controller] = base
    return bases, problems


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _keyed(path: Path) -> dict[str, int]:
    """A flat keyed cgroup file (``oom_kill 1`` lines) as a dict; empty when unreadable."""
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    except OSError:
        pass
    return out


def _int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None
