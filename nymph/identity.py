"""The worker's identity: a ULID created once and kept in the state directory."""

from __future__ import annotations

import os
from pathlib import Path

from dreamlake.lakeshore import ids

WORKER_ID_FILE = "worker_id"


def load_or_create_worker_id(state_dir: Path) -> str:
    """Return the worker id stored in ``state_dir``, creating (atomically) a new ULID if absent."""
    path = state_dir / WORKER_ID_FILE
    try:
        return ids.validate(path.read_text().strip(), "worker id in " + str(path))
    except FileNotFoundError:
        pass
    worker_id = ids.new_ulid()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        fh.write(worker_id + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return worker_id
