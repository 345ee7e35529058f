"""The garbage collector of a ``lakeshore server`` process: short pauses under a fleet.

A collection stops every thread of the process (the event loop and the store threads), so its
pause lands on whatever submit or claim is in flight. Almost every object a request makes is
freed by its reference count; the collector is only needed for cycles (a cancelled task and its
exception, a traceback and its frames), and what it costs is the objects it scans. A server
holding 1,000 long polls (``bench/fleet.py``) keeps some 140,000 objects alive for each poll's 20 s:

- With CPython's thresholds (700, 10, 10) it ran about 20 young collections a second, a middle one
  (10-90 ms) every half second and a full one (250-450 ms on a loaded 2-CPU machine) every 8 s or so.
- With the young threshold raised to 20,000, full collections became rare, but a young collection
  still scanned 140,000 objects and paused the server 150-190 ms: the young generation's count is
  allocations less deallocations *of any generation*, so while the polls renew (old objects die,
  new ones are born) the count stays flat and the young generation grows until it holds the whole
  fleet's poll state.

So the collector runs on a clock instead (:func:`tune`): what is alive at start is frozen (the
modules, the app, its caches: never garbage, never scanned again), automatic collection is off,
and a thread of its own collects the young generation every ``YOUNG_S`` (a few milliseconds:
only what the last tenth of a second left alive), the middle one every ``MIDDLE_S`` (what the
young collections kept for that long), and everything every ``FULL_S`` (cycles that lived long
enough to reach the oldest generation wait that long, at most, to be freed). Each pause is
counted in ``lakeshore_gc_pause_seconds{generation}``.

Call it once the app is built, before serving; a process that embeds the app (tests) keeps its own
settings.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

YOUNG_S = 0.1
MIDDLE_S = 0.5
FULL_S = 300.0

_started = threading.Lock()
_thread: threading.Thread | None = None
_observe: Callable[[int, float], None] | None = None  # (generation, seconds) of each pause


def tune(observe: Callable[[int, float], None] | None = None) -> None:
    """Freeze what the process holds now, stop automatic collection and collect on the clock
    (module docstring). ``observe(generation, seconds)`` is called after each collection."""
    global _thread, _observe
    _observe = observe
    gc.collect()
    gc.freeze()
    gc.disable()
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_collect_on_the_clock, name="lakeshore-gc", daemon=True)
            _thread.start()
    log.debug(
        "gc: %d objects frozen; collecting every %g / %g / %g s",
        gc.get_freeze_count(),
        YOUNG_S,
        MIDDLE_S,
        FULL_S,
    )


def _collect_on_the_clock() -> None:
    now = time.monotonic()
    middle_due, full_due = now + MIDDLE_S, now + FULL_S
    while True:
        time.sleep(YOUNG_S)
        now = time.monotonic()
        generation = 0
        if now >= full_due:
            generation, full_due, middle_due = 2, now + FULL_S, now + MIDDLE_S
        elif now >= middle_due:
            generation, middle_due = 1, now + MIDDLE_S
        began = time.perf_counter()
        gc.collect(generation)
        if _observe is not None:
            _observe(generation, time.perf_counter() - began)
