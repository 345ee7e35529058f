"""What a function running as a task may ask about its call: ``dls.attempt()`` and
``dls.checkpoint_dir()``.

Inside a task nymph sets ``LAKESHORE_ATTEMPT`` (1 for the first attempt; a preempted, retried or
requeued call runs again with the next number). Outside a task (a local call) it is 1.
"""

from __future__ import annotations

import os

from dreamlake.lakeshore import envvars

ATTEMPT_ENV = "LAKESHORE_ATTEMPT"
CHECKPOINT_ENV = "LAKESHORE_CHECKPOINT_DIR"  # set by the entry (daemon/entry.py)


def attempt() -> int:
    """Which attempt of the call this is (1-based)."""
    return envvars.integer(ATTEMPT_ENV, minimum=1)


def checkpoint_dir() -> str:
    """A directory whose content the next attempt of this call finds here again (after a
    preemption, a retried failure or a timeout; issue 30), created on first use. Outside a task it
    is ``./checkpoint``. Write what resuming needs (a step number, model weights) and read it at the
    start; keep it small (a larger one is not carried: over nymph's ``checkpoint_max_mb``, default
    1 GiB, or the control plane's ``MAX_PAYLOAD_BYTES``, default 100 MiB) and write files
    atomically (write a temporary name, then ``os.replace``), as the attempt may be stopped at any
    moment."""
    path = envvars.string(CHECKPOINT_ENV, None, None) or os.path.abspath("checkpoint")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
