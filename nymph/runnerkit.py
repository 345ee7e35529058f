"""Small helpers the bundled runners share (and a third-party runner may use).

- :func:`default_python`: nymph's own interpreter, for runners that run the entry with it;
- :func:`option_list`: a list option that may come as a comma-separated string (``--runner-opt``);
- :func:`image_allowed`: the ``allowed_images`` rule of the container runners;
- :func:`log_tail`: the labelled tail of ``stdout.log`` / ``stderr.log`` for an ExitStatus;
- :func:`inferred_exit_code`: the exit code of a task nymph could not reap, read from the workdir.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from nymph.workdir import ERROR, RESULT, STDERR, STDOUT, tail

LOG_TAIL_BYTES = 4096


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
