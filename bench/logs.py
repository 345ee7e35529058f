"""Output capture: print-to-reader latency, print throughput, and what a flood of prints costs a
stream, through ``LocalStack`` (``lakeshore server`` + ``nymph start``, process runner, real
processes on loopback).

Rows:

- latency: ``bench_fns.say`` prints a line with the wall clock every ``--pause-ms``; this process
  follows ``q.logs(inv, follow=True)`` and takes arrival minus the printed time per line (p50 /
  p90; goal p50 <= 50 ms).
- throughput: ``bench_fns.shout`` prints ``--lines`` lines of 100 bytes as fast as it can (under the
  16 MiB cap); the lines/s that reach the reader, beside the function's own print speed into its
  log file (the baseline measured in the same run: what the task pays) and the ratio.
- stream cost: ``bench_fns.noisy_ticks`` (10 prints before each value) against ``bench_fns.ticks``
  (none, the baseline): frames/s of the values (the prints cost the task itself time, so the
  noisy rate is lower) and each value's yield-to-consumer latency (goal p90 <= 50 ms with the
  prints: they never starve the values).

The machine's load moves these figures; compare rows of one run.

    .venv/bin/python bench/logs.py
    .venv/bin/python bench/logs.py --lines 50000 --values 5000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _stats import percentile

from dreamlake.lakeshore.devstack import LocalStack
from dreamlake.lakeshore.envelope import Envelope, fn_for
from dreamlake.lakeshore.queue import SyncQueue

BENCH = Path(__file__).resolve().parent
GOAL_LATENCY_MS = 50.0
GOAL_VALUE_P90_MS = 50.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--say", type=int, default=60, help="lines for the latency row")
    parser.add_argument("--pause-ms", type=float, default=20.0)
    parser.add_argument("--lines", type=int, default=100_000, help="lines for the throughput row")
    parser.add_argument("--values", type=int, default=2000, help="values for the stream-cost row")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH))
    import bench_fns

    with LocalStack(queues=["bench"], concurrency=1, pythonpath=[BENCH], quiet=True) as stack:
        plane = stack.plane()
        q = SyncQueue("bench", plane)

        def submit(fn: Any, *a: Any) -> str:
            return plane.submit(Envelope.create(fn_for(fn, "ref"), a, {}), "bench", {})

        q.result(submit(bench_fns.noop))  # warm: the first spawn, imports

        inv = submit(bench_fns.say, args.say, args.pause_ms / 1e3)
        lat: list[float] = []
        for chunk in q.logs(inv, follow=True):
            now = time.time()
            for line in chunk.text.splitlines():
                _, _, t = line.partition(" ")
                lat.append((now - float(t)) * 1e3)
        assert len(lat) == args.say, f"lines lost: {len(lat)} of {args.say}"
        p50 = percentile(lat, 0.5)
        print(f"print -> reader latency ({args.say} lines): p50 {p50:.1f} ms  p90 {percentile(lat, 0.9):.1f} ms"
              f"  (goal <= {GOAL_LATENCY_MS:g} ms p50)")  # fmt: skip

        inv = submit(bench_fns.shout, args.lines, 100)
        start = time.time()
        got = 0
        for chunk in q.logs(inv, follow=True):
            got += chunk.text.count("\n")
        span = time.time() - start
        own = float(q.result(inv))
        assert got == args.lines, f"lines lost: {got} of {args.lines}"
        print(f"throughput ({args.lines} lines of 100 B): {got / span:.0f} lines/s to the reader "
              f"(incl. start-up); the task printed {args.lines / own:.0f} lines/s into its log "
              f"(baseline); ratio {(got / span) / (args.lines / own):.2f}")  # fmt: skip

        rows = {}
        for label, fn, extra in (("quiet", bench_fns.ticks, ()), ("noisy", bench_fns.noisy_ticks, (10,))):
            inv = submit(fn, args.values, *extra)
            arrivals: list[tuple[float, float]] = []
            for value in q.stream(inv, timeout=120):
                arrivals.append((time.time(), value["t"]))
            assert len(arrivals) == args.values, f"{label}: {len(arrivals)} values of {args.values}"
            lat = [(at - t) * 1e3 for at, t in arrivals]
            fps = (len(arrivals) - 1) / (arrivals[-1][0] - arrivals[0][0])
            rows[label] = (fps, percentile(lat, 0.5), percentile(lat, 0.9))
        for label, (fps, p50, p90) in rows.items():
            what = "baseline" if label == "quiet" else "10 prints per value"
            print(f"stream of {args.values} values, {label} ({what}): {fps:.0f} frames/s, "
                  f"yield -> consumer p50 {p50:.1f} ms p90 {p90:.1f} ms")  # fmt: skip
        print(f"noisy / quiet: frames/s {rows['noisy'][0] / rows['quiet'][0]:.2f} (the task's own prints "
              f"cost it time), value latency p90 {rows['noisy'][2]:.1f} ms (goal <= {GOAL_VALUE_P90_MS:g} ms: "
              "prints never starve the values)")  # fmt: skip


if __name__ == "__main__":
    main()
