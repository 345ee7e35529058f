"""The warm round trip of two checkouts, paired: rounds alternated on one machine, each round a
fresh server and worker of one checkout.

A change worth a few percent of the round trip is smaller than what this project's 2-core machines
swing between two runs of the same code (a hello-world's rate moved 9,000 -> 16,000 requests/s
between sessions), so one run of each side says little. Here the two sides take turns, A B, then
B A, ..., and what is compared is each round's pair: the difference of their medians, and in how
many rounds the second checkout was the faster.

Each round, for one checkout: ``lakeshore server`` over a SQLite file and ``lakeshore worker
--prefetch 8`` (``bench/warm.py``'s), both run from that checkout (``PYTHONPATH``); 100 calls to
warm up, then ``--calls`` sequential ``submit?wait`` noops from a separate process with the cheap
client (``bench/warm.py``'s ``_latency``). Printed per round: the p50 and p90, and the CPU ms per
call of the server and of the worker (psutil); then per checkout the median of its rounds, and
the paired differences.

Run: ``python bench/warm_pair.py BEFORE AFTER [--rounds 8] [--calls 1000]`` (two checkouts, e.g.
``git worktree add /tmp/base <rev>`` and this one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import warm  # noqa: E402
from _stats import median_p90  # noqa: E402
from control_plane import cpu_seconds, lakeshore_server  # noqa: E402

WARM_UP = 100


def one_round(tree: Path, calls: int) -> tuple[float, float, float, float]:
    """(p50 s, p90 s, server cpu ms per call, worker cpu ms per call) of ``tree``."""
    warm.TREE = tree
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "runners")])
    with (
        tempfile.TemporaryDirectory() as tmp,
        lakeshore_server(str(Path(tmp) / "warm.db"), Path(tmp) / "sq", 1) as (port, token, pid),
        warm.lakeshore_worker(port, token, 8) as wpid,
    ):
        warm.in_processes(warm._latency, [(port, token, WARM_UP, True)])
        s0, w0 = cpu_seconds(pid), cpu_seconds(wpid)
        ((times, _),) = warm.in_processes(warm._latency, [(port, token, calls, True)])
        n = calls + 20  # ``_latency`` warms its own connection with 20 calls first
        server, worker = (cpu_seconds(pid) - s0) * 1000 / n, (cpu_seconds(wpid) - w0) * 1000 / n
    p50, p90 = median_p90(times)
    return p50, p90, server, worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path, help="a checkout: the baseline")
    ap.add_argument("after", type=Path, help="a checkout: the change")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of each checkout, alternated")
    ap.add_argument("--calls", type=int, default=1000, help="sequential calls per round")
    args = ap.parse_args()
    trees = [args.before.resolve(), args.after.resolve()]
    for tree in trees:
        if not (tree / "dreamlake" / "lakeshore").is_dir():
            ap.error(f"{tree} is not a checkout of this project (no dreamlake/lakeshore in it)")
    rows: dict[int, dict[Path, tuple[float, float, float, float]]] = {}
    print(f"warm round trip, {args.rounds} rounds of {args.calls} calls, {os.cpu_count()} cores")
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            got = rows.setdefault(r, {})[tree] = one_round(tree, args.calls)
            p50, p90, server, worker = got
            side = "before" if tree == trees[0] else "after"
            print(
                f"round {r:>2} {side:<6} p50 {p50 * 1000:.3f} ms  p90 {p90 * 1000:.3f} ms  "
                f"server {server:.3f}  worker {worker:.3f} cpu ms per call",
                flush=True,
            )
    for tree, side in zip(trees, ("before", "after"), strict=True):
        mine = [rows[r][tree] for r in rows]
        print(
            f"{side:<6} {tree}: p50 {statistics.median(m[0] for m in mine) * 1000:.3f} ms (median of rounds), "
            f"server {statistics.median(m[2] for m in mine):.3f}, worker {statistics.median(m[3] for m in mine):.3f} cpu ms"
        )
    diffs = [(rows[r][trees[1]][0] - rows[r][trees[0]][0]) * 1000 for r in rows]
    cpu = [rows[r][trees[1]][2] - rows[r][trees[0]][2] for r in rows]
    faster = sum(d < 0 for d in diffs)
    print(
        f"after - before, paired: p50 {statistics.median(diffs):+.3f} ms at the median "
        f"(after faster in {faster} of {len(diffs)} rounds); server cpu {statistics.median(cpu):+.3f} ms per call"
    )


if __name__ == "__main__":
    main()
