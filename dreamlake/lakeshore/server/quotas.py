"""Per-namespace quotas (issue 31): one producer cannot fill the control plane for everyone.

An operator sets a namespace's limits with ``lakeshore namespace quota NS --queued N --topics N
--payload-bytes 10g`` (``store.set_quota``); each is optional. Past one, the request answers
``429`` with ``Retry-After`` and a message naming the quota (the answer's ``quota`` field too:
``max_queued``, ``max_topics`` or ``max_payload_bytes``, which the SDK raises as
:class:`~dreamlake.lakeshore.errors.QuotaExceeded`); nothing of it is stored:

* ``max_queued``: the namespace's queued, due invocations (delayed retries are not), checked at
  submit and submit-batch (``Retry-After`` 5 s: they run and leave), strictly: see below;
* ``max_topics``: the topics the namespace's producers made (a topic belongs to the namespace of
  the post that made it), checked at a post that would make one; posts to a made topic go on;
* ``max_payload_bytes``: the bytes presigned for upload in the namespace within the payload window
  (the blob directory's retention, ``LAKESHORE_BLOBS_RETENTION_S``; 7 days with a bucket, whose
  lifecycle rule is the operator's), checked at a presign ``put``. A presigned PUT is bound to its
  size, so this bounds what the payload store can take for the namespace; the arguments, results
  and checkpoints nymph uploads for the namespace's calls count too.

Cheap on the hot path: the limits of every namespace are read once per :data:`REFRESH_S` (one
small query for all of them), a namespace without a quota costs a dict lookup, and one with a
quota counts off an index, stopping at the quota where it can (``store.count_queued(ns,
up_to=quota)``): the cost is bounded by the quota, never the table.

``max_queued`` holds strictly. The route's check (:meth:`Quotas.check_queued`) is only a cheap
early refusal, read in a transaction of its own (it spares the group commit a flood of doomed
submits); the authoritative one is the store's, in the transaction that inserts the submits: the
route hands the namespace's limit on with each submit (``SubmitRequest.max_queued``; a
submit-batch's items share a ``quota_group``, queued all or none), and the store counts the
namespace's queued invocations there (on PostgreSQL under an advisory lock of the namespace, so
the submits of several server processes cannot pass together) and refuses the ones past the
limit with this 429, each write's refusal its own (store/invocations.py ``_hold_quotas_in``).
Idempotent repeats (answered ``duplicate``) add nothing there. A namespace without a quota passes
no limit and the store does nothing more for it. What stays loose: a quota just set or changed
applies within :data:`REFRESH_S` (each process's cached limit), and a repeat that finds its
namespace full meets the route's early 429 (it cannot tell a repeat without a read).
The other two quotas are checked before the write, as before: concurrent requests may pass
together and overshoot them by the number in flight.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from dreamlake.lakeshore.errors import QuotaExceeded
from dreamlake.lakeshore.humanize import size as human_size
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.store.api import Quota
from dreamlake.lakeshore.store.quotas import QUEUED_RETRY_AFTER_S, queued_refusal, quota_message

REFRESH_S = 5.0  # how stale a quota the operator just set may be (every replica re-reads it)
RETRY_AFTER_S = QUEUED_RETRY_AFTER_S  # queued invocations run and leave: worth asking again soon
RETRY_AFTER_LONG_S = 3600  # topics and payload bytes free up with retention or the operator
DEFAULT_PAYLOAD_WINDOW_S = 7 * 86400.0  # the blob directory's default retention (server/blobdir.py)
MADE_TOPICS_KEPT = 10_000  # topics remembered as made (a post to one then costs no store read)


def refusal(namespace: str, quota: str, limit: int, detail: str, hint: str, retry_after_s: int) -> HTTPError:
    """The 429 of a namespace past ``quota``: its message names the quota and the limit."""
    return HTTPError(
        429,
        quota_message(namespace, quota, limit, detail, hint),
        quota=quota,
        limit=limit,
        retry_after_s=retry_after_s,
    )


def answer(exc: QuotaExceeded) -> HTTPError:
    """The 429 of a store's quota refusal (``max_queued`` in a submit's transaction)."""
    retry_after = RETRY_AFTER_S if exc.retry_after is None else int(exc.retry_after)
    return HTTPError(
        429, str(exc), quota=exc.quota or "max_queued", limit=exc.limit, retry_after_s=retry_after
    )


class Quotas:
    """The quotas of every namespace, re-read every :data:`REFRESH_S`."""

    def __init__(
        self,
        call: Callable[..., Awaitable[Any]],
        store: Any,
        *,
        payload_window: Callable[[], float | None] = lambda: None,
    ) -> None:
        self._call = call  # runs a store method off the loop (Context.call)
        self._store = store
        self._limits: dict[str, Quota] = {}
        self._read_at = float("-inf")
        self._payload_window = payload_window  # the payload store's retention, when it has one
        self._made: set[str] = set()  # topics seen to exist: their posts skip the store read

    @property
    def payload_window_s(self) -> float:
        """How long a presign counts against the payload-bytes quota: the payload retention."""
        return self._payload_window() or DEFAULT_PAYLOAD_WINDOW_S

    async def _quota(self, namespace: str) -> Quota | None:
        if time.monotonic() - self._read_at > REFRESH_S:
            self._limits = await self._call(self._store.quotas)
            self._read_at = time.monotonic()
        return self._limits.get(namespace)

    async def check_queued(self, namespace: str, adding: int) -> int | None:
        """429 when ``adding`` more queued invocations would take ``namespace`` past its quota;
        else the namespace's ``max_queued`` (None: no quota), for the submits to carry to the
        store, which holds them to it in their own transaction (see the module docstring)."""
        quota = await self._quota(namespace)
        limit = None if quota is None else quota.max_queued
        if limit is None or adding <= 0:
            return limit
        queued = await self._call(self._store.count_queued, namespace, limit)
        if queued + adding > limit:
            raise answer(queued_refusal(namespace, limit, queued, adding))
        return limit

    async def check_topic(self, namespace: str, topic: str) -> None:
        """429 when a post would make a new topic in ``namespace`` past its topic quota."""
        quota = await self._quota(namespace)
        limit = None if quota is None else quota.max_topics
        if limit is None or topic in self._made:
            return
        if await self._call(self._store.topic_exists, topic):
            if len(self._made) >= MADE_TOPICS_KEPT:
                self._made.clear()
            self._made.add(topic)
            return
        made = await self._call(self._store.count_topics, namespace, limit)
        if made >= limit:
            raise refusal(
                namespace,
                "max_topics",
                limit,
                f" topics ({made} made; '{topic}' would be one more)",
                "post to one of the namespace's topics",
                RETRY_AFTER_LONG_S,
            )

    async def check_payload(self, namespace: str, size: int) -> None:
        """429 when presigning ``size`` more bytes would take ``namespace`` past its payload quota."""
        quota = await self._quota(namespace)
        limit = None if quota is None else quota.max_payload_bytes
        if limit is None:
            return
        used = await self._call(self._store.payload_bytes, namespace, time.time() - self.payload_window_s)
        if used + size > limit:
            raise refusal(
                namespace,
                "max_payload_bytes",
                limit,
                f" bytes ({human_size(limit)}; {human_size(used)} presigned in the last "
                f"{self.payload_window_s / 86400:g} days, {human_size(size)} more asked)",
                "send a smaller payload, or retry once older payloads have passed the retention",
                RETRY_AFTER_LONG_S,
            )

    async def record_payload(self, namespace: str, key: str, size: int) -> None:
        """Count a presigned upload against ``namespace`` (every namespace: a quota set later sees it)."""
        await self._call(self._store.record_payload, namespace, key, size, keep_s=self.payload_window_s)
