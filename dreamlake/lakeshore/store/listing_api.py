"""The operators' read-only views of the store (``lakeshore queues|workers|ls|show`` and the
dashboard): the :class:`Listing` protocol and its page and row types. Implemented by store/listing.py;
``Store`` (api.py) extends it, and api.py re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .records import Invocation

if TYPE_CHECKING:
    from .activity import Activity, Sweep

# -- listing (store/listing.py): what ``lakeshore queues|workers|ls|show`` and the dashboard read --

LIVE_WINDOW_S = 300.0  # a worker that polled or heartbeated this recently is live
LIST_LIMIT_MAX = 500  # the most rows one page of a listing holds


@dataclass
class QueueStats:
    """One queue: invocations by state, the oldest queued one's submit time, live workers."""

    name: str
    counts: dict[str, int]  # state -> invocations (every state present, 0 when none)
    oldest_queued_at: float | None  # submitted_at of the oldest queued invocation
    workers_live: int  # live workers whose registered queues include this one


@dataclass
class WorkerRow:
    worker_id: str
    info: dict[str, Any]  # the latest register: hostname, version, runner, queues, labels, slots, namespace
    registered_at: float
    last_seen: float  # the latest register, poll or heartbeat
    busy: int  # invocations and exec jobs it holds running
    stopped_at: float | None = None  # when it deregistered (a clean stop); a stopped worker is not live
    free_gpus: int | None = None  # the GPUs its latest poll offered free; None: not known


@dataclass
class WorkerPage:
    workers: list[WorkerRow]  # by worker id
    next_cursor: str | None  # pass as ``cursor`` for the next page; None on the last page


@dataclass
class InvocationPage:
    invocations: list[Invocation]  # newest first; args_blob and result_blob left empty
    next_cursor: str | None  # pass as ``cursor`` for the next page; None on the last page


@dataclass
class FrameStats:
    count: int
    last_seq: int | None
    first_at: float | None  # created_at of the first and the latest journaled frame
    last_at: float | None


class Listing(Protocol):
    """Read-only views for operators. ``namespace`` None: every namespace (an admin's view)."""

    def queue_stats(
        self, namespace: str | None = None, *, live_within: float = LIVE_WINDOW_S
    ) -> list[QueueStats]:
        """Every queue with invocations in ``namespace`` or a live worker serving it (``namespace``
        None: also every queue ever submitted to), by name."""
        ...

    def list_workers(
        self,
        namespace: str | None = None,
        *,
        live_within: float | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> WorkerPage:
        """Workers by id (after ``cursor``): all, or those bound to ``namespace`` or to none; only
        the ones seen within ``live_within`` seconds when given. ``limit`` clamped to
        1..LIST_LIMIT_MAX."""
        ...

    def live_queues(self, live_within: float = LIVE_WINDOW_S) -> dict[str, int]:
        """Queue name -> number of workers serving it that were seen within ``live_within`` s."""
        ...

    def live_workers_of(
        self, queue: str, live_within: float = LIVE_WINDOW_S, *, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        """The registered infos (labels, capacity) of the live workers serving ``queue``."""
        ...

    def count_workers(self, live_within: float | None = LIVE_WINDOW_S) -> int:
        """Workers seen within ``live_within`` seconds (None: every worker ever registered)."""
        ...

    def list_invocations(
        self,
        namespace: str | None = None,
        *,
        queue: str | None = None,
        states: list[str] | None = None,
        since: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
        sweep: str | None = None,
    ) -> InvocationPage:
        """Invocations newest first (by id, a ULID), submitted at or after ``since``, with ids
        before ``cursor``; at most ``limit`` (clamped to 1..LIST_LIMIT_MAX); only the calls of one
        ``map`` when ``sweep`` names it (``run_config.sweep``)."""
        ...

    def frame_stats(self, owner_id: str) -> FrameStats: ...

    def activity(self, namespace: str | None, since: float) -> list[Activity]:
        """Submit, start and finish times of what waited, ran or finished since ``since`` (the
        dashboard's charts; store/activity.py)."""
        ...

    def sweeps(self, namespace: str | None, since: float, limit: int = 20) -> list[Sweep]:
        """The ``map`` sweeps submitted since ``since``, newest first, with counts by state."""
        ...

    def limits(self) -> dict[str, dict[str, int]]:
        """Every fleet-wide limit: ``{"queues": {name: max_running}, "keys": {key: max}}``."""
        ...

    def limit_use(self, queue: str, concurrency_key: str | None) -> list[tuple[str, int, int]]:
        """``(name, max_running, running now)`` of each limit covering a call of ``queue`` (and of
        ``concurrency_key``)."""
        ...

    def key_limit_use(self) -> list[tuple[str, int, int]]:
        """``(concurrency_key, max_concurrency, running now)`` of every key limit, by key."""
        ...
