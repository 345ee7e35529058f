"""``lakeshore server`` tunes its garbage collector before serving (``server/gctune.py``): what the
process holds at start is frozen (never scanned again), automatic collection is off, and a thread
collects on a clock, so the young generation never grows to hold a fleet's poll state (a young
collection of 140,000 objects paused a server 150-190 ms); cycles are still freed."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_tune_freezes_the_start_up_heap_and_collects_cycles_on_the_clock() -> None:
    code = (
        "import gc, time, weakref\n"
        "from dreamlake.lakeshore.server import gctune, serve\n"
        "assert gc.isenabled() and gc.get_freeze_count() == 0\n"
        "pauses = []\n"
        "gctune.tune(lambda generation, seconds: pauses.append((generation, seconds)))\n"
        "assert not gc.isenabled() and gc.get_freeze_count() > 10_000, gc.get_freeze_count()\n"
        "class Node: pass\n"
        "a, b = Node(), Node()\n"
        "a.other, b.other = b, a  # a cycle: only the collector frees it\n"
        "gone = weakref.ref(a)\n"
        "del a, b\n"
        "deadline = time.monotonic() + 10\n"
        "while gone() is not None and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "assert gone() is None, 'the cycle was never collected'\n"
        "assert pauses and pauses[0][0] == 0, pauses\n"
        "time.sleep(gctune.MIDDLE_S + 2 * gctune.YOUNG_S)\n"
        "assert {g for g, _ in pauses} >= {0, 1}, pauses\n"
    )
    # a process of its own: the test process keeps CPython's settings
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
