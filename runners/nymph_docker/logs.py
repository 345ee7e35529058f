"""A finished container's output: copied to ``stdout.log`` / ``stderr.log`` in the workdir.

The engine keeps a container's output until the container is removed; nymph keeps the workdir of a
failed invocation. :func:`collect_logs` streams each stream into its file (atomically, so a rerun
after a nymph restart rewrites the same content), and :func:`log_tail` returns the tail that goes
into :class:`~nymph.runner.ExitStatus` and the failure record.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4096
STREAMS = ("stdout", "stderr")


def collect_logs(api: Any, container_id: str, workdir: Path | None) -> None:
    """Write the container's stdout and stderr to ``workdir/{stdout,stderr}.log``.

    ``api`` is a docker ``APIClient``. Nothing is written when ``workdir`` is gone (a container
    collected after its workdir was removed).
    """
    if workdir is None or not workdir.is_dir():
        return
    for stream in STREAMS:
        target = workdir / f"{stream}.log"
        tmp = workdir / f".{stream}.log.tmp"
        chunks = api.logs(container_id, stdout=stream == "stdout", stderr=stream == "stderr", stream=True)
        try:
            with open(tmp, "wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("cannot write %s: %s", target, exc)
            tmp.unlink(missing_ok=True)


def log_tail(workdir: Path | None, limit: int = LOG_TAIL_BYTES) -> str | None:
    """The last ``limit`` bytes of each log file, labelled; None when both are empty or missing."""
    if workdir is None:
        return None
    parts = []
    for stream in STREAMS:
        try:
            with open(workdir / f"{stream}.log", "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - limit))
                data = fh.read().decode("utf-8", "replace")
        except OSError:
            continue
        if data:
            parts.append(f"--- {stream}.log ---\n{data}")
    return "\n".join(parts) or None
