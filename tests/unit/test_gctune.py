"""``lakeshore server`` tunes its garbage collector before serving (``server/gctune.py``): what the
process holds at start is frozen (never scanned again) and collections run far less often than
CPython's defaults, whose full collections paused a server under a fleet for hundreds of ms."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_tune_freezes_the_start_up_heap_raises_the_thresholds_and_times_each_pause() -> None:
    code = (
        "import gc\n"
        "from dreamlake.lakeshore.server import gctune, serve\n"
        "assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0\n"
        "gctune.tune()\n"
        "assert gc.get_threshold() == gctune.THRESHOLDS, gc.get_threshold()\n"
        "assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()\n"
        "assert gctune.THRESHOLDS[0] >= 10_000\n"
        "pauses = []\n"
        "gctune.tune(lambda generation, seconds: pauses.append((generation, seconds)))\n"
        "gc.collect(1)\n"
        "assert pauses and pauses[-1][0] == 1 and 0 <= pauses[-1][1] < 60, pauses\n"
    )
    # a process of its own: the test process keeps CPython's settings
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
