"""Per-namespace quotas (issue 31): one producer cannot fill the queue for everyone.

An operator sets a namespace's limit of queued invocations with ``lakeshore namespace quota NS
--max-queued N`` (``store.set_quota``). A submit (or a batch) that would take the namespace past it
answers ``429`` with ``Retry-After`` and a message naming the quota; nothing is queued.

Cheap on the hot path: the limits of every namespace are read once per :data:`REFRESH_S` (one
small query for all of them), a namespace without a quota costs a dict lookup, and one with a
quota counts its due queued invocations off the ``ix_invocations_queued_ns`` index, stopping at
the quota (``store.count_queued(ns, up_to=quota)``): the cost is bounded by the quota, never the
table. The check runs before the group commit, so concurrent submits may pass it together and
overshoot the quota by the number in flight; delayed retries (``not_before``) are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from dreamlake.lakeshore.server.http import HTTPError

REFRESH_S = 5.0  # how stale a quota the operator just set may be (every replica re-reads it)
RETRY_AFTER_S = 5


class Quotas:
    """The quotas of every namespace, re-read every :data:`REFRESH_S`."""

    def __init__(self, call: Callable[..., Awaitable[Any]], store: Any) -> None:
        self._call = call  # runs a store method off the loop (Context.call)
        self._store = store
        self._limits: dict[str, int] = {}
        self._read_at = float("-inf")

    async def check_queued(self, namespace: str, adding: int) -> None:
        """429 (``Retry-After``) when ``adding`` more queued invocations would take ``namespace``
        past its quota."""
        if time.monotonic() - self._read_at > REFRESH_S:
            self._limits = await self._call(self._store.quotas)
            self._read_at = time.monotonic()
        limit = self._limits.get(namespace)
        if limit is None or adding <= 0:
            return
        queued = await self._call(self._store.count_queued, namespace, limit)
        if queued + adding > limit:
            raise HTTPError(
                429,
                f"namespace '{namespace}' is at its quota of {limit} queued invocations (max_queued; "
                f"{queued} queued, {adding} more asked): retry once some have run, or ask the operator "
                "to raise it (lakeshore namespace quota)",
                quota="max_queued",
                limit=limit,
                retry_after_s=RETRY_AFTER_S,
            )
