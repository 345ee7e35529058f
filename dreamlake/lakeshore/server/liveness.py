"""Which queues live workers serve, for the warning on a submit to a queue nobody polls.

A worker is live when it registered, polled or heartbeated within ``LIVE_WINDOW_S`` (5 min); the
queues it serves are those of its latest register. :class:`QueueWatch` caches the store's answer
for ``ttl_s`` only while it says "served": a queue that looks unserved is read again at once, so a
nymph that has just started is never reported missing, and the cost (one small query) falls on
submits that are probably mistakes anyway.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from dreamlake.lakeshore.humanize import size as human_size
from dreamlake.lakeshore.labels import label_shown
from dreamlake.lakeshore.store.api import LIVE_WINDOW_S
from dreamlake.lakeshore.store.placement import Needs, Offer

_SHOWN = 10  # queue names a warning lists at most


def no_worker_warning(queue: str, live: dict[str, int], window_s: float = LIVE_WINDOW_S) -> str:
    """``no worker has polled queue 'mnie' in the last 5 min; known queues: demo, default``."""
    window = f"{window_s / 60:g} min" if window_s >= 60 else f"{window_s:g} s"
    names = sorted(live)
    if not names:
        known = f"none (start one: NYMPH_TOKEN=DAEMON_TOKEN nymph start --server URL --queue {queue})"
    else:
        known = ", ".join(names[:_SHOWN]) + (
            f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
        )
    return f"no worker has polled queue {queue!r} in the last {window}; known queues: {known}"


class QueueWatch:
    """The live queues, read through ``read`` (the store's ``live_queues``, run off the loop)."""

    def __init__(self, ttl_s: float = 5.0, window_s: float = LIVE_WINDOW_S) -> None:
        self.ttl_s = ttl_s
        self.window_s = window_s
        self._live: dict[str, int] = {}
        self._read_at = float("-inf")

    async def warning(self, queue: str, read: Callable[[float], Awaitable[dict[str, int]]]) -> str | None:
        """None when a live worker serves ``queue``; otherwise the warning to give the producer."""
        fresh = time.monotonic() - self._read_at < self.ttl_s
        if fresh and self._live.get(queue):
            return None
        self._live = await read(self.window_s)
        self._read_at = time.monotonic()
        if self._live.get(queue):
            return None
        return no_worker_warning(queue, self._live, self.window_s)


def placement_warning(queue: str, needs: Needs, infos: list[dict[str, Any]]) -> str | None:
    """Why no live worker of ``queue`` (``infos``: their registered infos) could ever take a call
    of ``needs``, naming each need no worker meets: ``no live worker of queue 'gpu' offers 4 GPUs
    (largest: 2)``, ``... gives one task 2 CPUs (largest: 1)``, ``... gives one task 64 GiB of
    memory (largest: 21.2 GiB)`` (sizes as the CLI writes them, ``humanize.size``), ``... has the
    labels pool=a``
    (several joined by ``; nor``); when each is met by some worker but none meets them all, the
    needs together. None when one could (or none is live: the no-worker warning says so)."""
    if not infos:
        return None
    offers = _offers(infos)
    if any(o.fits(needs) for o in offers):
        return None
    unmet: list[str] = []
    if needs.gpus and not any(o.fits(Needs(gpus=needs.gpus)) for o in offers):
        unmet.append(f"offers {needs.gpus} GPUs (largest: {max(o.gpus for o in offers)})")
    if needs.memory and not any(o.fits(Needs(memory=needs.memory)) for o in offers):
        largest = max(o.memory for o in offers if o.memory is not None)
        asked, most = human_size(needs.memory), human_size(largest)
        if asked == most:  # too close to tell apart at 3 digits: both in bytes
            asked, most = f"{needs.memory} bytes", f"{largest} bytes"
        most = f"largest: {most}" if largest else "none can limit a task's memory"
        unmet.append(f"gives one task {asked} of memory ({most})")
    if needs.cpus and not any(o.fits(Needs(cpus=needs.cpus)) for o in offers):
        cpus = max(o.cpus for o in offers if o.cpus is not None)
        most = f"largest: {cpus:g}" if cpus else "none can limit a task's CPUs"
        unmet.append(f"gives one task {needs.cpus:g} CPUs ({most})")
    if needs.selector and not any(o.fits(Needs(selector=needs.selector)) for o in offers):
        unmet.append("has the labels " + ", ".join(label_shown(k, v) for k, v in needs.selector))
    if not unmet:  # each need is met somewhere, never all on one worker
        together = Needs(needs.gpus, needs.selector, memory=needs.memory, cpus=needs.cpus).describe()
        unmet.append(f"has all of {together} at once")
    return f"no live worker of queue {queue!r} " + "; nor ".join(unmet)


def _labels(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _offers(infos: list[dict[str, Any]]) -> list[Offer]:
    """What each worker could ever offer: all its GPUs, its labels, and what one task may have
    (``capacity.task``: the memory and CPUs its runner gives one task, when it says)."""
    out = []
    for i in infos:
        capacity = i.get("capacity") or {}
        task = capacity.get("task")
        task = task if isinstance(task, dict) else {}
        memory, cpus = task.get("memory"), task.get("cpus")
        out.append(
            Offer.of(
                len(capacity.get("gpus") or []),
                _labels(i.get("labels")),
                memory if isinstance(memory, int) and not isinstance(memory, bool) else None,
                float(cpus) if isinstance(cpus, (int, float)) and not isinstance(cpus, bool) else None,
            )
        )
    return out


def fitting(needs: Needs, infos: list[dict[str, Any]]) -> int:
    """How many of the workers (``infos``: their registered infos) could ever take a call of ``needs``."""
    return sum(1 for o in _offers(infos) if o.fits(needs))
