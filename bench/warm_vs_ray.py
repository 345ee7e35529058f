"""The warm round trip against Ray's, paired: rounds alternated on one machine, both stacks up.

Issue 34's goal for the one-call-at-a-time path is a ratio: lakeshore's warm round trip at most
0.8x Ray's ``ray.get(f.remote())`` p50, measured in the same run. ``bench/hotpaths.py`` measures
the two one after the other, a minute apart, and this project's 2-core machines swing by half
within a minute (Ray's own p50 moved 1.45 -> 2.41 ms between two runs of ten seconds each): one
such pair says little. Here both stacks are started once and kept up, and the measuring windows
alternate, Ray then lakeshore, then lakeshore then Ray, ...; what is compared is each round's
pair, measured seconds apart: its ratio, the median of the ratios, and in how many rounds the
goal was met.

- Ray: a driver in a process of its own (Ray's own benchmark shape: the driver times
  ``ray.get(f.remote())`` of a noop), warmed up once, answering each round on its stdin;
- lakeshore: ``lakeshore server`` over a SQLite file and ``lakeshore worker --prefetch 8``
  (``bench/warm.py``'s), each round's ``--calls`` sequential ``submit?wait`` noops from a fresh
  process with the cheap client (``bench/warm.py``'s ``_latency``: 20 calls to warm its connection,
  then the measured ones).

While one side is measured the other idles: Ray's raylet and workers (its own background work
included), lakeshore's server and worker in a long poll.

Run: ``python bench/warm_vs_ray.py [--rounds 8] [--calls 500]``, in a venv where Ray is
installed (none of the peers is a dependency: docs/performance.md has the one-line set-up); without
Ray it prints one skip line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

GOAL = 0.8  # lakeshore's p50 at most this many times Ray's, in the same round


def _noop() -> None:
    return None


def ray_driver() -> None:
    """``--ray-driver``: a warm Ray driver; each line on stdin is a number of calls to time, each
    answer a JSON list of their seconds."""
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="ERROR")
    try:
        f = ray.remote(_noop)
        ray.get([f.remote() for _ in range(50)])  # workers started and warm
        print("ready", flush=True)
        for line in sys.stdin:
            times = []
            for _ in range(int(line)):
                t = time.perf_counter()
                ray.get(f.remote())
                times.append(time.perf_counter() - t)
            print(json.dumps(times), flush=True)
    finally:
        ray.shutdown()


class _Ray:
    def __init__(self) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--ray-driver"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the Ray driver did not start")

    def round(self, calls: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{calls}\n")
        self.proc.stdin.flush()
        return list(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=500, help="sequential calls per side per round")
    ap.add_argument("--ray-driver", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ray_driver:
        ray_driver()
        return
    if importlib.util.find_spec("ray") is None:
        print("warm round trip vs Ray: skipped (Ray is not installed in this venv: pip install ray)")
        return

    import warm
    from control_plane import lakeshore_server

    ray = _Ray()
    pairs: list[tuple[float, float]] = []
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            lakeshore_server(str(Path(tmp) / "warm.db"), Path(tmp) / "sq", 1) as (port, token, _pid),
            warm.lakeshore_worker(port, token, 8),
        ):
            warm.in_processes(warm._latency, [(port, token, 100, True)])  # warm-up
            print(
                f"warm round trip, lakeshore (submit?wait, lakeshore worker) against Ray "
                f"(ray.get(f.remote())): {args.rounds} alternated rounds of {args.calls} calls each, "
                f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
            )
            for r in range(args.rounds):
                got: dict[str, float] = {}
                for side in ("ray", "lakeshore") if r % 2 == 0 else ("lakeshore", "ray"):
                    if side == "ray":
                        times = ray.round(args.calls)
                    else:
                        ((times, _),) = warm.in_processes(warm._latency, [(port, token, args.calls, True)])
                    got[side] = statistics.median(times)
                ratio = got["lakeshore"] / got["ray"]
                pairs.append((got["lakeshore"], got["ray"]))
                print(
                    f"round {r:2d}  Ray p50 {got['ray'] * 1e3:.3f} ms  lakeshore p50 "
                    f"{got['lakeshore'] * 1e3:.3f} ms  ratio {ratio:.2f}x"
                )
    finally:
        ray.close()
    ratios = sorted(ls / ry for ls, ry in pairs)
    met = sum(1 for x in ratios if x <= GOAL)
    print(
        f"median of rounds: Ray {statistics.median(ry for _, ry in pairs) * 1e3:.3f} ms, lakeshore "
        f"{statistics.median(ls for ls, _ in pairs) * 1e3:.3f} ms; ratio {statistics.median(ratios):.2f}x "
        f"(rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x); goal <= {GOAL}x: met in {met} of {len(ratios)} rounds"
    )


if __name__ == "__main__":
    main()
