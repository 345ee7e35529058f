"""Pure decisions of the docker runner: which image, which user, which limits, which PYTHONPATH.

Nothing here talks to the engine, so every rule is testable without one:

- :func:`image_allowed` (shared with the kube runner, :mod:`nymph.runnerkit`): the default image is always allowed; ``allowed_images`` entries match an
  image exactly, any tag or digest of a repository (``python`` allows ``python:3.12``), or, when an
  entry ends with ``/``, every image under that registry prefix (``ghcr.io/acme/``).
- :func:`container_user`: ``as_user`` maps to ``uid:gid`` (the runner's ``users`` table first, then
  the host's passwd); without one, the workdir's owner, so the bind-mounted workdir is writable.
- :func:`limits`: parsed :class:`~nymph.resources.Resources` (the task's over the runner's
  defaults, read by :mod:`nymph.resources`) as docker SDK ``create`` keywords.
- :func:`code_paths` / :func:`pythonpath`: the entry bundle first, then the code paths (the
  ``code_dirs``, and the task's own PYTHONPATH entries when they are mounted), each mounted at its
  host path; PYTHONPATH entries that are not mounted mean nothing in a container and are dropped.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from nymph.resources import Resources
from nymph.runner import RunnerError
from nymph.runnerkit import image_allowed

__all__ = ["code_paths", "container_user", "image_allowed", "limits", "pythonpath"]


def limits(wanted: Resources) -> dict[str, Any]:
    """docker SDK ``create`` keywords for ``wanted``.

    Memory also caps swap (``memswap_limit`` = ``mem_limit``), so a memory-hungry task is OOM-killed
    rather than swapping; the reason then reads ``OOMKilled``. ``gpus`` needs nothing here: the
    devices nymph assigned (``task.gpus``) become the container's device request.
    """
    out: dict[str, Any] = {}
    if wanted.millicpus is not None:
        out["nano_cpus"] = wanted.millicpus * 1_000_000
    if wanted.memory is not None:
        out["mem_limit"] = out["memswap_limit"] = wanted.memory
    if wanted.pids is not None:
        out["pids_limit"] = wanted.pids
    if wanted.shm is not None:
        out["shm_size"] = wanted.shm
    return out


def container_user(as_user: str | None, users: Mapping[str, str], workdir: Path) -> str:
    """``uid:gid`` the container runs as: ``as_user`` mapped, or the owner of the workdir."""
    if as_user:
        if as_user in users:
            return users[as_user]
        try:
            pw = pwd.getpwnam(as_user)
        except KeyError as exc:
            raise RunnerError(
                f"as_user {as_user!r} is not a user on this host; add it, or map it in the runner's "
                f"users option (name -> 'uid:gid')"
            ) from exc
        return f"{pw.pw_uid}:{pw.pw_gid}"
    st = os.stat(workdir)
    return f"{st.st_uid}:{st.st_gid}"


def code_paths(code_dirs: Iterable[str], task_pythonpath: str | None) -> list[str]:
    """Host paths to mount read-only at the same place: ``code_dirs`` then existing PYTHONPATH entries."""
    out: list[str] = []
    candidates = [*code_dirs, *(task_pythonpath or "").split(os.pathsep)]
    for entry in candidates:
        if not entry or not os.path.isabs(entry):
            continue
        path = str(Path(entry).resolve())
        if path not in out and os.path.exists(path):
            out.append(path)
    return out


def pythonpath(bundle_target: str, code_dirs: Iterable[str], task_pythonpath: str | None) -> str:
    """PYTHONPATH inside the container; code dirs are mounted at their host paths."""
    dirs = [str(Path(d)) for d in code_dirs]
    entries = [bundle_target, *dirs]
    for entry in (task_pythonpath or "").split(os.pathsep):
        if not entry or entry in entries:
            continue
        if any(entry == d or entry.startswith(d.rstrip("/") + "/") for d in dirs):
            entries.append(entry)
    return os.pathsep.join(entries)
