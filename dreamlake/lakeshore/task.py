"""What a function running as a task may ask about its call: ``dls.attempt()``.

Inside a task nymph sets ``LAKESHORE_ATTEMPT`` (1 for the first attempt; a preempted, retried or
requeued call runs again with the next number). Outside a task (a local call) it is 1.
"""

from __future__ import annotations

import os

ATTEMPT_ENV = "LAKESHORE_ATTEMPT"


def attempt() -> int:
    """Which attempt of the call this is (1-based)."""
    raw = os.environ.get(ATTEMPT_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1
