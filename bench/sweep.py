"""A sweep end to end: ``f.map`` of many noop calls on two ``lakeshore worker`` processes, from the
first submit to the last result read (``Calls.results()``, which reads outcomes in batches through
``POST /v1/producer/await-batch``), beside Ray's ``ray.get(list)`` of 2,000 calls when ray is
installed.

The stack is real processes on loopback: ``lakeshore server`` over a SQLite file, two ``lakeshore
worker start --queue warm --prefetch N`` processes; the producer is this process, through the SDK
as a user writes it (``noop.map(...)`` then ``calls.results()``). Each call is a ref noop
(``bench/bench_fns.py``, shipped by reference, no code archive).

Rows, each beside the goal (>= 1,500 calls/s, issue 32):

- ``sweep``: calls / (last result read - first submit), per rep, with its median and p90 over reps,
  and the split: how long the submits took (``map``) and how long after them the last result came;
  the server's CPU per call (psutil), whose inverse bounds the rate while the server has one core;
- ``local plane``: the same sweep on ``Dispatch(":memory:")`` with two ``run_worker`` threads
  (``--local N`` calls; 0 skips it);
- ``ray.get(list)``: 2,000 ``@ray.remote`` noops on a 2-CPU local Ray, when ray is installed.

Run: ``python bench/sweep.py [--calls 100000] [--reps 1] [--prefetch 64] [--local 5000]``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from _stats import median_p90

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
os.environ.setdefault("LAKESHORE_CODE", "none")  # the noop is importable on the workers: ship nothing

import bench_fns  # noqa: E402
from control_plane import cpu_seconds, has, lakeshore_server  # noqa: E402
from warm import QUEUE, lakeshore_worker  # noqa: E402

import dreamlake.lakeshore as dls  # noqa: E402
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch  # noqa: E402

GOAL_RATE = 1500.0
RAY_CALLS = 2000

noop = dls.udf(queue=QUEUE, code=None)(bench_fns.noop)


def sweep(plane: object, n: int) -> tuple[float, float]:
    """(seconds from the first submit to the last result, seconds the submits took)."""
    t0 = time.perf_counter()
    calls = noop.starmap((() for _ in range(n)), _dispatch=plane)  # type: ignore[arg-type]
    submitted = time.perf_counter() - t0
    got = sum(1 for _ in calls.results(timeout=600))
    assert got == n, f"{got} results of {n}"
    return time.perf_counter() - t0, submitted


@contextlib.contextmanager
def http_stack(prefetch: int) -> Iterator[tuple[HttpDispatch, int]]:
    with tempfile.TemporaryDirectory(prefix="lakeshore-sweep-") as tmp:
        data = Path(tmp)
        with (
            lakeshore_server(str(data / "sweep.db"), data, 1) as (port, token, pid),
            lakeshore_worker(port, token, prefetch),
            lakeshore_worker(port, token, prefetch),
        ):
            plane = HttpDispatch(f"http://127.0.0.1:{port}", token)
            try:
                quiet = logging.getLogger("dreamlake.lakeshore.dispatch.http")
                quiet.setLevel(logging.ERROR)  # the warm-up may beat the workers' first poll
                sweep(plane, 50)  # both workers polling, connections open
                quiet.setLevel(logging.NOTSET)
                yield plane, pid
            finally:
                plane.close()


def local_sweep(n: int) -> float:
    plane = Dispatch(":memory:")
    stop = threading.Event()
    workers = [
        threading.Thread(
            target=dls.run_worker,
            args=(QUEUE,),
            kwargs={"dispatch": plane, "stop": stop, "poll_timeout": 0.2},
            daemon=True,
        )
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    try:
        return n / sweep(plane, n)[0]
    finally:
        stop.set()
        for w in workers:
            w.join(30)
        plane.close()


def ray_rate() -> str:
    if not has("ray"):
        return "ray not installed (pip install ray)"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        def ray_noop() -> None:
            return None

        ray.get([ray_noop.remote() for _ in range(100)])  # workers started
        t0 = time.perf_counter()
        ray.get([ray_noop.remote() for _ in range(RAY_CALLS)])
        return f"{RAY_CALLS / (time.perf_counter() - t0):,.0f} calls/s"
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--prefetch", type=int, default=64)
    parser.add_argument("--local", type=int, default=5000, help="calls of the local-plane sweep (0: skip)")
    args = parser.parse_args()

    load0 = os.getloadavg()[0]
    rates: list[float] = []
    splits: list[tuple[float, float]] = []
    server_ms: list[float] = []
    with http_stack(args.prefetch) as (plane, pid):
        for _ in range(args.reps):
            cpu = cpu_seconds(pid)
            total, submitted = sweep(plane, args.calls)
            server_ms.append((cpu_seconds(pid) - cpu) * 1000 / args.calls)
            rates.append(args.calls / total)
            splits.append((submitted, total - submitted))
    med, p90 = median_p90(rates)
    low = min(rates)
    print(
        f"sweep of {args.calls:,} noop calls, two `lakeshore worker --prefetch {args.prefetch}`, SQLite; "
        f"{os.cpu_count()} cores, load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after:"
    )
    print(f"  {'':34}{'median':>12}{'p90':>12}{'worst':>12}{'goal':>12}")
    print(
        f"  {'first submit -> last result /s':34}{med:>12,.0f}{p90:>12,.0f}{low:>12,.0f}{GOAL_RATE:>12,.0f}"
    )
    sub = median_p90([s for s, _ in splits])[0]
    rest = median_p90([r for _, r in splits])[0]
    print(f"  split (median): submits {sub:.1f} s, then last result {rest:.1f} s later")
    print(f"  server CPU per call (median): {median_p90(server_ms)[0]:.2f} ms (the rate's ceiling on one core: "
          f"{1000 / median_p90(server_ms)[0]:,.0f}/s)")  # fmt: skip
    print(f"  {'meets the goal' if low >= GOAL_RATE else 'BELOW THE GOAL'} (worst of {args.reps} rep(s))")
    if args.local:
        print(f"local plane (Dispatch(':memory:'), two run_worker threads), {args.local:,} calls: "
              f"{local_sweep(args.local):,.0f} calls/s")  # fmt: skip
    print(f"ray.get(list) of {RAY_CALLS:,} noops, 2 CPUs: {ray_rate()}")


if __name__ == "__main__":
    main()
