"""The process runner's cgroup bookkeeping: one cgroup v2 per task, and where a handle's live.

Every task gets its own cgroup (:mod:`nymph.cgroup`, option ``cgroup``: ``"auto"`` (default),
``"off"``, or the path of a cgroup to create task cgroups under; :func:`detect`): a spawned task
joins it through a ``/bin/sh`` prefix before its command runs, a forked one first thing after the
fork. Stopping a task signals every process in its cgroup (SIGTERM, the grace, then
``cgroup.kill``), and ``destroy`` kills what is left and removes the cgroup, so a descendant that
started its own session (``setsid``, a daemonising library) dies with the task. A handle records
its cgroup (:func:`cgroup_of` finds it again, also a previous life's) and the v1 cgroups its
limits live in (:func:`v1_of`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from nymph import limits
from nymph.cgroup import CgroupError, TaskCgroups
from nymph.cgroup import detect as detect_tree
from nymph.runner import Handle

log = logging.getLogger(__name__)


def detect(option: str) -> tuple[TaskCgroups | None, str]:
    """The task cgroup tree for the ``cgroup`` option, or None and why not."""
    if option == "off":
        return None, 'turned off (cgroup = "off")'
    found = detect_tree(None if option == "auto" else option)
    if found.tree is None:
        log.warning(
            "process runner: no task cgroups (%s); falling back to process groups: a "
            "descendant that leaves its task's session is found by walking the process "
            "tree, best effort",
            found.problem,
        )
    return found.tree, found.problem


def task_cgroup(tree: TaskCgroups | None, name: str, invocation_id: str) -> Path | None:
    """A fresh cgroup for task ``name``; None without cgroups (or when this one cannot be made)."""
    if tree is None:
        return None
    try:
        return tree.create(name)
    except CgroupError as exc:
        log.warning("invocation %s: %s; tracked by its process group", invocation_id, exc)
        return None


def cgroup_of(tree: TaskCgroups | None, handle: Handle) -> tuple[TaskCgroups, Path] | None:
    """The cgroup a handle records, with the tree that manages it; None when it records none."""
    raw = handle.data.get("cgroup")
    if not raw:
        return None
    path = Path(str(raw))
    if tree is not None and tree.owns(path):
        return tree, path
    if path.is_absolute() and ".." not in path.parts and (path / "cgroup.kill").exists():
        return TaskCgroups(path.parent), path  # a previous life's tree (nymph's own handle)
    return tree or TaskCgroups(path.parent), path  # gone: nothing left to kill


def v1_of(controllers: limits.Controllers, handle: Handle) -> list[Path]:
    """The v1 cgroups a handle records, if they are task cgroups of this runner's hierarchies."""
    raw = handle.data.get("limits")
    if not isinstance(raw, list):
        return []
    bases = set(controllers.v1.values())
    paths = [Path(str(p)) for p in raw]
    return [p for p in paths if p.parent in bases and p.name and not p.name.startswith(".")]
