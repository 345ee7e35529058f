"""One backoff: the pause before the next try of something that failed, exponential with jitter.

The control-plane client's calls retry through tenacity (``client.retrying``); the loops that keep
their own schedule (nymph's lifecycle, health check and recovery sweep, nymph's outbox, the server's
LISTEN/NOTIFY relay) take their pause from :func:`backoff_s` instead of a formula of their own.
"""

from __future__ import annotations

import random


def backoff_s(tries: int, *, base: float, cap: float, doublings: int = 16, jitter: str = "half") -> float:
    """The pause after ``tries`` failures: ``base * 2**tries`` (``tries`` counted up to
    ``doublings``), at most ``cap``, jittered so that many waiters do not come back together:

    * ``"half"``: a uniform draw between half of it and all of it;
    * ``"add"``: plus up to ``min(0.5, cap)`` seconds (the client's tenacity policy's shape).
    """
    pause = min(cap, base * 2 ** min(max(tries, 0), doublings))
    if jitter == "half":
        return float(random.uniform(0.5, 1.0) * pause)
    if jitter == "add":
        return float(pause + random.uniform(0, min(0.5, cap)))
    raise ValueError(f"jitter={jitter!r}: use 'half' or 'add'")
