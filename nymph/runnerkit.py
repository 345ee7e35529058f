"""Small helpers the bundled runners share (and a third-party runner may use).

- :data:`ENTRY_MODULE`: the module every runner runs (``python -m ENTRY_MODULE``);
  :data:`WORKDIR_TARGET`, :data:`BUNDLE_TARGET`, :data:`CODE_TARGET` and :data:`SCRIPT_SHIM`: where
  the container runners (docker, gvisor, kube) mount the workdir, the entry bundle and the code
  archives a call shipped (:func:`code_mounts`), and how they run a script;
- :func:`task_name`: ``nymph-<invocation id>-a<attempt>``, the deterministic name of a task's
  container, pod or Slurm job, so a start tried again finds the first one;
- :func:`handle_workdir`: the workdir a handle records;
- :func:`default_python`: nymph's own interpreter, for runners that run the entry with it;
- :func:`option_list` / :func:`option_mapping`: a list or table option that may come as a string
  (``--runner-opt code_dirs=/a,/b``, ``users=alice=1000:1000``);
- :func:`image_allowed`: the ``allowed_images`` rule of the container runners;
- :func:`log_tail`: the labelled tail of ``stdout.log`` / ``stderr.log`` for an ExitStatus;
- :func:`inferred_exit_code`: the exit code of a task nymph could not reap, read from the workdir.

``run_config.resources`` is read by :mod:`nymph.resources`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dreamlake.lakeshore.daemon.entry import CODE_PATH_ENV
from nymph.runner import Handle, RunnerError, Task
from nymph.workdir import ERROR, RESULT, STDERR, STDOUT, tail

ENTRY_MODULE = "dreamlake.lakeshore.daemon.entry"
WORKDIR_TARGET = "/work/inv"
BUNDLE_TARGET = "/opt/lakeshore/entry.zip"
CODE_TARGET = "/opt/lakeshore/code"  # + "/<sha256>": one read-only mount per shipped code archive
MOUNT_TARGET = "/mnt/lakeshore"  # + "/<name>": an operator's mount (--mount) the call asked for
# Run the script with bash when the image has it, else with sh: one container, no separate probe.
# Its output is appended to the workdir's logs (the cwd) as it is written, so it streams live; a
# log that cannot be written leaves the output in the container's own log (collected at the end).
# Arguments: sh -c SCRIPT_SHIM sh SCRIPT
SCRIPT_SHIM = (
    "if [ -w stdout.log ]; then exec >>stdout.log; fi; if [ -w stderr.log ]; then exec 2>>stderr.log; fi; "
    'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; fi; exec sh -c "$1"'
)
LOG_TAIL_BYTES = 4096


def code_mounts(task: Task) -> list[tuple[str, str]]:
    """``(host path, container path)`` of each code archive of ``task`` (``Task.code_dirs``)."""
    return [(str(d), f"{CODE_TARGET}/{d.name}") for d in task.code_dirs]


def code_path_env(mounts: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``{LAKESHORE_CODE_PATH: the container paths}`` for ``mounts``; empty when nothing shipped."""
    targets = [target for _, target in mounts]
    return {CODE_PATH_ENV: os.pathsep.join(targets)} if targets else {}


def task_name(task: Task) -> str:
    """``nymph-<invocation id>-a<attempt>``: one name per attempt, valid for docker, Kubernetes and Slurm."""
    return f"nymph-{task.invocation_id.lower()}-a{task.attempt}"


def handle_workdir(handle: Handle) -> Path | None:
    """The workdir recorded in ``handle.data["workdir"]``; None when it records none."""
    raw = handle.data.get("workdir")
    return Path(str(raw)) if raw else None


def default_python() -> str:
    """nymph's interpreter, resolved past symlinks unless it is a venv's.

    A venv's ``bin/python`` is a symlink whose location *is* the venv (resolving it would lose the
    venv's site-packages); any other interpreter is resolved, so no shim sits in front of it.
    """
    if sys.prefix != sys.base_prefix:
        return sys.executable
    return os.path.realpath(sys.executable)


def option_list(value: Iterable[str] | str) -> tuple[str, ...]:
    """A list option; a string (``--runner-opt code_dirs=/a,/b``) is comma separated."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(i).strip() for i in items if str(i).strip())


def option_mapping(value: Mapping[str, Any] | str | None, what: str) -> dict[str, str]:
    """A table option; a string is ``k=v,k2=v2`` (``users=alice=1000:1000``: split at the first ``=``)."""
    if not value:
        return {}
    if isinstance(value, str):
        out: dict[str, str] = {}
        for item in option_list(value):
            key, sep, val = item.partition("=")
            if not sep or not key.strip():
                raise RunnerError(f"{what}: expected key=value, got {item!r}")
            out[key.strip()] = val.strip()
        return out
    return {str(k): str(v) for k, v in value.items()}


def image_allowed(image: str, default: str, allowed: Iterable[str]) -> bool:
    """Whether ``image`` may run: the default, an allowed image or repository (any tag or digest:
    ``python`` allows ``python:3.12``), or every image under an entry ending in ``/``."""
    if image == default:
        return True
    for entry in allowed:
        if entry and (
            image == entry
            or (entry.endswith("/") and image.startswith(entry))
            or image.startswith((entry + ":", entry + "@"))
        ):
            return True
    return False


def log_tail(workdir: Path | None, limit: int = LOG_TAIL_BYTES) -> str | None:
    """The last ``limit`` bytes of ``stdout.log`` and ``stderr.log``, labelled; None when both are empty."""
    if workdir is None:
        return None
    parts = [f"--- {name} ---\n{data}" for name in (STDOUT, STDERR) if (data := tail(workdir / name, limit))]
    return "\n".join(parts) or None


def inferred_exit_code(workdir: Path) -> int:
    """A finished task's exit code from what the entry left: ``result.msgpack`` 0, ``error.json`` 1, else -1."""
    if (workdir / RESULT).exists():
        return 0
    if (workdir / ERROR).exists():
        return 1
    return -1
