"""What a call's pip environment costs at start-up (issue 33), measured in one run.

A real ``lakeshore server`` and ``nymph start --allow-pip`` (process runner, prefork) on loopback,
with a find-links directory of hand-made wheels (no index, no network: the figures are nymph's and
uv's, not a download's). Each line is submit-and-wait wall time (``SyncQueue.call``), median and
p90 in ms, with the goal beside it:

- a bare call (no pip environment): the baseline;
- a pip environment's first call: resolve (``uv pip compile``) + build (``uv pip install
  --target``) + seal, then the call; every sample asks for another version, so each one builds;
- a cached call of the same environment: the lock read, the directory found, then the call.

    .venv/bin/python bench/pip_envs.py                 # 20 calls each, 5 builds; about 30 s
    .venv/bin/python bench/pip_envs.py --calls 50 --builds 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dreamlake.lakeshore as dls  # noqa: E402
from bench import bench_fns  # noqa: E402
from bench._stats import median_p90  # noqa: E402
from dreamlake.lakeshore.devstack import LocalStack  # noqa: E402
from tests.pip_kit import make_wheel  # noqa: E402

GOALS_MS = {
    "bare call": None,
    "pip env, first call (build)": 2000.0,
    "pip env, cached call": "bare + 20",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--builds", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lakeshore-bench-pip-"))
    wheels, empty = work / "wheels", work / "no-index"
    empty.mkdir()
    for v in range(args.builds + 1):
        make_wheel(wheels, "lsbench", f"1.{v}", {"lsbench/__init__.py": f"VERSION = {v}\n"})
    flags = ["--allow-pip", "--pip-find-links", str(wheels), "--pip-index-url", empty.as_uri()]
    with LocalStack(queues=["bench"], quiet=True, nymph_args=flags, pythonpath=[ROOT]) as stack:
        plane = stack.plane()

        def timed(udf: dls.UDF, *a: object) -> float:
            started = time.perf_counter()
            out = udf.call(*a, _dispatch=plane, _timeout=300)
            took = (time.perf_counter() - started) * 1000
            assert out is not None
            return took

        bare = dls.udf(queue="bench", code=None)(bench_fns.import_probe)
        timed(bare, "json")  # warm: the zygote, the connections
        rows = {"bare call": [timed(bare, "json") for _ in range(args.calls)]}
        first = []
        for v in range(1, args.builds + 1):
            udf = dls.udf(queue="bench", code=None, pip=[f"lsbench==1.{v}"])(bench_fns.import_probe)
            first.append(timed(udf, "lsbench"))
        rows["pip env, first call (build)"] = first
        cached = dls.udf(queue="bench", code=None, pip=["lsbench==1.1"])(bench_fns.import_probe)
        rows["pip env, cached call"] = [timed(cached, "lsbench") for _ in range(args.calls)]
    base = median_p90(rows["bare call"])[0]
    print(f"{'':32} {'median ms':>10} {'p90 ms':>10} {'vs bare':>9}  goal")
    for name, samples in rows.items():
        med, p90 = median_p90(samples)
        goal = GOALS_MS[name]
        print(f"{name:32} {med:10.1f} {p90:10.1f} {med - base:+8.1f}  {goal if goal is not None else '-'} ms")


if __name__ == "__main__":
    main()
