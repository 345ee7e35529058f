"""Why a queued call waits, in words an operator acts on (``lakeshore show``, the dashboard).

Checked in the order a claim would meet them: its time has not come (``not_before``: a
``_not_before`` or a retry's backoff), no live worker serves its queue, no live worker of its
queue could ever take it (too few GPUs: the largest offer is named; or labels its selector needs),
a fleet-wide limit is full (the queue's ``max_running`` or its key's ``max_concurrency``), and
otherwise: live workers fit it and it waits for room on one of them (its turn in claim order).
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.liveness import fitting, placement_warning
from dreamlake.lakeshore.store.api import Invocation
from dreamlake.lakeshore.store.claims import KEY_PREFIX
from dreamlake.lakeshore.store.placement import needs_of, shown_key


def _at(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


async def why_waiting(ctx: Context, inv: Invocation, now: float | None = None) -> dict[str, Any] | None:
    """``{"reason": kind, "message": text}`` for a queued invocation; None for any other state.
    Kinds: ``not_before``, ``no_worker``, ``no_fit``, ``limit``, ``busy``."""
    if inv.state != "queued":
        return None
    now = time.time() if now is None else now
    if inv.not_before is not None and inv.not_before > now:
        return {"reason": "not_before", "message": f"not before {_at(inv.not_before)}"}
    # the workers that may claim it: its namespace's own and the shared ones (a worker bound to
    # another namespace never takes it, and what it offers is not this caller's to learn)
    infos = await ctx.call(ctx.store.live_workers_of, inv.queue, namespace=inv.namespace)
    if not infos:
        return {"reason": "no_worker", "message": f"no live worker serves queue {inv.queue!r}"}
    try:
        needs = needs_of(inv.run_config or {}, inv.namespace)
    except PlaneError:  # written before the rule it breaks: nothing placement matches
        needs = needs_of({}, inv.namespace)
    unfit = placement_warning(inv.queue, needs, infos)
    if unfit:
        return {"reason": "no_fit", "message": unfit}
    for name, most, running in await ctx.call(ctx.store.limit_use, inv.queue, needs.concurrency_key):
        if running >= most:
            what = (
                f"concurrency key {shown_key(inv.namespace, name.removeprefix(KEY_PREFIX))!r} "
                "is at its max_concurrency"
                if name.startswith(KEY_PREFIX)
                else f"queue {inv.queue!r} is at its limit (lakeshore queue limit)"
            )
            return {"reason": "limit", "message": f"{what}: {running} of {most} running"}
    fit = fitting(needs, infos)
    return {
        "reason": "busy",
        "message": f"{fit} live worker{'s' if fit != 1 else ''} of queue {inv.queue!r} fit it; "
        "waiting for room on one (its turn in priority order)",
    }
