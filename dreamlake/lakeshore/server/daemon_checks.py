"""What every daemon route checks of its body: the worker it acts as, and the attempt.

A daemon acts as the workers its token registered (``authz.WorkerBindings``: the first call naming
a worker id binds it; any other token naming it is refused 403) and reports only on the leases
those workers hold (:func:`_worker`, :func:`_attempt`); every refusal is logged (:func:`_refused`).
The routes are :mod:`.daemon` (register, poll, heartbeat), :mod:`.daemon_acks` and
:mod:`.daemon_frames`.
"""

from __future__ import annotations

import logging
from typing import Any

from dreamlake.lakeshore.server import http
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context

log = logging.getLogger("dreamlake.lakeshore.server.daemon")


async def _worker(ctx: Context, caller: Caller, body: dict[str, Any]) -> str:
    """The body's ``worker_id`` (required), once the caller's token is known to act as it."""
    worker_id = http.ulid_field(body, "worker_id")
    assert worker_id is not None
    await ctx.workers.check(caller, worker_id)
    return worker_id


def _attempt(body: dict[str, Any]) -> int:
    attempt: int = http.integer(body, "attempt", hi=http.I32_MAX)
    return attempt


def _refused(caller: Caller, what: str, invocation_id: str, status: int, reason: str) -> None:
    log.warning(
        "%s of %s refused (%d) for token %r: %s", what, invocation_id, status, caller.principal.name, reason
    )
