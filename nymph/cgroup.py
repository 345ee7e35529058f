"""One cgroup (v2) per task: every process a task starts, and one kill that ends them all.

A process group is not a boundary: a task's descendant that calls ``setsid()`` (a daemonising
library, a double fork) leaves it, so signalling the group misses it. A cgroup cannot be left by an
unprivileged process, and writing ``1`` to its ``cgroup.kill`` (Linux 5.14+) SIGKILLs every
process in it at once, whatever session or process group it is in.

Where task cgroups go: ``<cgroup2 mount><nymph's own cgroup>/nymph-tasks/<task>`` (under systemd,
``/sys/fs/cgroup/system.slice/nymph.service/nymph-tasks/...``; the unit sets ``Delegate=yes`` so
that sub-tree is nymph's to manage), or under a parent named explicitly. No controller is enabled:
only the core files (``cgroup.procs``, ``cgroup.events``, ``cgroup.kill``) are used, so nymph may
stay in its own cgroup beside ``nymph-tasks`` (the no-internal-processes rule binds only cgroups
with controllers enabled for their children).

:func:`detect` finds the cgroup2 mount (``/proc/self/mountinfo``; on a hybrid host it is
``/sys/fs/cgroup/unified``), nymph's cgroup (``/proc/self/cgroup``, the ``0::`` line), creates
``nymph-tasks`` and proves the whole path works by moving a throw-away ``/bin/sh`` into a probe
cgroup; when anything is missing (cgroup v1 only, a read-only ``/sys/fs/cgroup`` in a container,
a kernel without ``cgroup.kill``) it says why, and the process runner falls back to the process
group (see :mod:`nymph_process`); ``nymph doctor`` reports which.

A task's process joins its cgroup before it runs anything of the task's: the process runner spawns
it through ``/bin/sh -c 'echo $$ > CGROUP/cgroup.procs && exec "$@"'`` (:func:`spawn_prefix`), and
the warm-fork zygote's child writes its own pid there first thing after the fork.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TASKS_DIR = "nymph-tasks"
MOUNTINFO = Path("/proc/self/mountinfo")
SELF_CGROUP = Path("/proc/self/cgroup")
_POLL_S = 0.02
# Joins the cgroups named by $0 (their cgroup.procs, one a line: the cgroup2 one, then a cgroup v1
# hierarchy's where limits live there, nymph.limits), then becomes the command: nothing of the
# task's runs before it is in. A failed write exits 125 without running the command.
_JOIN = 'set -f; IFS="\n"; for f in $0; do echo $$ > "$f" || exit 125; done; unset IFS; exec "$@"'


class CgroupError(OSError):
    """A task cgroup could not be created, joined, killed or removed."""


@dataclass(frozen=True)
class Detected:
    """The outcome of :func:`detect`: ``tree`` when task cgroups work here, else ``problem`` says why."""

    tree: TaskCgroups | None
    problem: str = ""


def cgroup2_mount(mountinfo: Path = MOUNTINFO) -> Path | None:
    """The mount point of the cgroup2 hierarchy, from ``mountinfo``; None when there is none."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            fields = left.split()
            if len(fields) >= 5:
                return Path(fields[4].replace("\\040", " "))
    return None


def own_cgroup(self_cgroup: Path = SELF_CGROUP) -> str | None:
    """This process's cgroup v2 path (``/system.slice/nymph.service``); None without one."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def detect(parent: str | Path | None = None) -> Detected:
    """Task cgroups under ``parent`` (default: nymph's own cgroup), proven to work, or why not."""
    if parent is None:
        mount = cgroup2_mount()
        if mount is None:
            return Detected(None, "no cgroup2 hierarchy is mounted (cgroup v1 only)")
        own = own_cgroup()
        if own is None:
            return Detected(None, "nymph is in no cgroup v2 (no 0:: line in /proc/self/cgroup)")
        base = mount / own.lstrip("/") / TASKS_DIR
    else:
        base = Path(parent)
        if not (base.parent / "cgroup.procs").exists() and not (base / "cgroup.procs").exists():
            return Detected(None, f"{base} is not in a cgroup2 hierarchy")
    try:
        base.mkdir(exist_ok=True)
    except OSError as exc:
        return Detected(None, f"cannot create {base}: {exc.strerror} (is /sys/fs/cgroup writable?)")
    if not (base / "cgroup.kill").exists():
        return Detected(None, f"{base} has no cgroup.kill (Linux 5.14 or later is needed)")
    tree = TaskCgroups(base)
    why = tree.probe()
    return Detected(tree, "") if why is None else Detected(None, why)


class TaskCgroups:
    """The task cgroups under one base directory."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def probe(self) -> str | None:
        """Move a throw-away shell into a fresh cgroup and kill it there; None when all of it works."""
        path = self.base / f"probe-{os.getpid()}"
        try:
            path.mkdir(exist_ok=True)
            out = subprocess.run(
                ["/bin/sh", "-c", _JOIN, str(path / "cgroup.procs"), "true"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if out.returncode != 0:
                return f"cannot move a process into {path}: {out.stderr.strip() or out.returncode}"
            self.kill(path)
            self.remove(path)
        except (OSError, subprocess.SubprocessError) as exc:
            with contextlib.suppress(OSError):
                path.rmdir()
            return f"cannot use {path}: {exc}"
        return None

    def path(self, name: str) -> Path:
        """The cgroup of task ``name`` (a task name: ``nymph-<id>-a<attempt>``)."""
        if not name or "/" in name or name.startswith("."):
            raise CgroupError(errno.EINVAL, f"not a task cgroup name: {name!r}")
        return self.base / name

    def owns(self, path: str | Path) -> bool:
        """True when ``path`` is a task cgroup of this tree (a handle names one)."""
        path = Path(path)
        return path.parent == self.base and bool(path.name) and not path.name.startswith(".")

    def create(self, name: str) -> Path:
        """The cgroup of task ``name``, created unless it exists (a start tried again, or a previous
        life's: the same invocation and attempt, so the same task, never killed here)."""
        path = self.path(name)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(exc.errno, f"cannot create cgroup {path}: {exc.strerror}") from exc
        return path

    @staticmethod
    def procs_file(path: Path) -> Path:
        return path / "cgroup.procs"

    @staticmethod
    def members(path: Path) -> list[int]:
        """The pids in the cgroup (not its zombies); empty when it is gone."""
        try:
            return [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    @staticmethod
    def populated(path: Path) -> bool:
        """True while a live process is in the cgroup (``cgroup.events``)."""
        try:
            for line in (path / "cgroup.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "populated":
                    return value.strip() == "1"
        except OSError:
            return False
        return False

    def signal(self, path: Path, sig: int) -> None:
        """Send ``sig`` to every process in the cgroup (best effort: one may exit or fork meanwhile)."""
        for pid in self.members(path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self, path: Path) -> None:
        """SIGKILL everything in the cgroup at once (``cgroup.kill``); a gone cgroup is fine."""
        try:
            (path / "cgroup.kill").write_text("1")
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cgroup %s: cgroup.kill failed (%s); killing its processes one by one", path, exc)
            self.signal(path, signal.SIGKILL)

    def wait_empty(self, path: Path, limit_s: float) -> bool:
        """Poll until no live process is left (True) or ``limit_s`` passes (False)."""
        deadline = time.monotonic() + limit_s
        while self.populated(path):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    @staticmethod
    def try_remove(path: Path) -> bool:
        """Remove the cgroup if it is empty (no live process left: the common end of a task, and
        one ``rmdir`` where a look at ``cgroup.events`` first would read a file twice); True when it
        is gone, False when something is still in it (``EBUSY``) or it cannot be removed now."""
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    def remove(self, path: Path, limit_s: float = 10.0) -> None:
        """Kill what is left and remove the cgroup; a gone cgroup is fine."""
        if self.try_remove(path):  # empty (or gone already): the common case, one rmdir
            return
        if self.populated(path):
            self.kill(path)
            if not self.wait_empty(path, limit_s):
                log.warning("cgroup %s: processes left %.0f s after cgroup.kill", path, limit_s)
        deadline = time.monotonic() + limit_s
        while True:
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:  # EBUSY: the last process is still on its way out
                if time.monotonic() >= deadline:
                    log.warning("cgroup %s: cannot remove it: %s", path, exc.strerror)
                    return
                time.sleep(_POLL_S)


def spawn_prefix(path: Path, *also: Path) -> list[str]:
    """The argv prefix that runs a command inside cgroup ``path`` (and the ``cgroup.procs`` files
    ``also``) from its first instruction on."""
    return ["/bin/sh", "-c", _JOIN, join_list(path, *also)]


def join_list(path: Path, *also: Path) -> str:
    """The ``cgroup.procs`` files a task joins, one a line: what the spawn prefix and the zygote's
    child take (a cgroup path never holds a newline: nymph names the task's part)."""
    return "\n".join([str(TaskCgroups.procs_file(path)), *(str(p) for p in also)])
