"""The garbage collector of a ``lakeshore server`` process: rare, short pauses under a fleet.

A collection stops every thread of the process (the event loop and the store threads), so its
pause lands on whatever submit or claim is in flight. With CPython's defaults (thresholds 700,
10, 10) a server holding 1,000 long polls (``bench/fleet.py``) ran about 20 young collections a
second and a full one every 8 s or so; a full one scanned about 200,000 objects (some 80,000 left
by the imports, the rest what the fleet's polls keep alive for their 20 s) and took 250-450 ms on
a loaded 2-CPU machine, 10-90 ms for the middle generation: those pauses made the submit -> claim
p99. Almost every object a request makes is freed by its reference count, not by the collector,
so collecting less often costs little memory:

- :func:`tune` first collects, then freezes what is alive (the modules, the app, its caches: never
  garbage, so never scanned again);
- the young generation is collected after ``THRESHOLDS[0]`` net new container objects instead of
  700, the middle one after ``THRESHOLDS[1]`` young collections, and a full collection runs after
  ``THRESHOLDS[2]`` middle ones (and, as always, only when the survivors grew by a quarter).

A young collection can still be long: the young count is allocations less deallocations of any
generation, so while a fleet's polls renew (old objects die, new ones are born) it stays flat and
the young generation grows until it holds the whole fleet's poll state (140,000 objects at 1,000
polls: 150-190 ms, about once a minute). Collecting on a clock instead (young every 0.1 s, middle
every 0.5 s: pauses of 2-7 ms) was measured and not kept: it cost a tenth of a CPU at 1,000 idle
daemons and did not lower the submit -> claim p99. Every pause is counted in
``lakeshore_gc_pause_seconds{generation}``, so an operator sees what the collector costs.

Call it once the app is built, before serving; a process that embeds the app (tests) keeps its own
settings.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

THRESHOLDS = (20_000, 20, 20)


def tune(observe: Callable[[int, float], None] | None = None) -> None:
    """Freeze what the process holds now and raise the collector's thresholds (module docstring);
    ``observe(generation, seconds)`` is called after every collection from then on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    if observe is not None:
        gc.callbacks.append(_timer(observe))
    log.debug("gc: %d objects frozen, thresholds %s", gc.get_freeze_count(), THRESHOLDS)


def _timer(observe: Callable[[int, float], None]) -> Callable[[str, dict[str, Any]], None]:
    began = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            observe(int(info["generation"]), time.perf_counter() - began[0])

    return callback
