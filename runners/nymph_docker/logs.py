"""A finished container's own output: appended, once, to ``stdout.log`` / ``stderr.log`` in the workdir.

The entry appends the task's output to those files itself while it runs (and the script shim does
for a script: :data:`nymph.runnerkit.SCRIPT_SHIM`), so nymph streams it live; what is left in the
engine's log of the container is what came before that (an interpreter that could not start, a
missing module of the entry). :func:`collect_logs` appends that to the same files when the
container ended, once: a marker (``.container-output``, nymph's own file) keeps a rerun after a
nymph restart from appending it twice. Every file is opened through :mod:`nymph.safeio` (the
workdir is the task user's: a link planted there is refused, never written through);
:func:`nymph.runnerkit.log_tail` then returns the tail that goes into
:class:`~nymph.runner.ExitStatus` and the failure record.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from nymph import safeio

log = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")
COLLECTED = ".container-output"


def collect_logs(api: Any, container_id: str, workdir: Path | None) -> None:
    """Append the container's stdout and stderr to ``workdir/{stdout,stderr}.log``, once.

    ``api`` is a docker ``APIClient``. Nothing is written when ``workdir`` is gone (a container
    collected after its workdir was removed).
    """
    if workdir is None or not workdir.is_dir() or safeio.exists_own(workdir, COLLECTED):
        return
    for stream in STREAMS:
        name = f"{stream}.log"
        chunks = api.logs(container_id, stdout=stream == "stdout", stderr=stream == "stderr", stream=True)
        try:
            safeio.append_stream(workdir, name, chunks, 0o644)
        except OSError as exc:
            log.warning("cannot write %s: %s", workdir / name, exc)
    try:
        safeio.write_file(workdir, COLLECTED, b"")
    except OSError as exc:
        log.warning("cannot write %s: %s", workdir / COLLECTED, exc)
