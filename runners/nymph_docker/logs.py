"""A finished container's output: copied to ``stdout.log`` / ``stderr.log`` in the workdir.

The engine keeps a container's output until the container is removed; nymph keeps the workdir of a
failed invocation. :func:`collect_logs` streams each stream into its file (atomically, so a rerun
after a nymph restart rewrites the same content, and through :mod:`nymph.safeio`: the workdir is the
task user's, a link planted there is replaced, never written through); :func:`nymph.runnerkit.log_tail` then returns the
tail that goes into :class:`~nymph.runner.ExitStatus` and the failure record.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from nymph import safeio

log = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")


def collect_logs(api: Any, container_id: str, workdir: Path | None) -> None:
    """Write the container's stdout and stderr to ``workdir/{stdout,stderr}.log``.

    ``api`` is a docker ``APIClient``. Nothing is written when ``workdir`` is gone (a container
    collected after its workdir was removed).
    """
    if workdir is None or not workdir.is_dir():
        return
    for stream in STREAMS:
        name = f"{stream}.log"
        chunks = api.logs(container_id, stdout=stream == "stdout", stderr=stream == "stderr", stream=True)
        try:
            safeio.write_stream(workdir, name, chunks, 0o644)
        except OSError as exc:
            log.warning("cannot write %s: %s", workdir / name, exc)
