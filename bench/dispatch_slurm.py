"""Round trip of a noop through the slurm runner, beside a bare ``sbatch --wrap`` polled to completion.

Usage: ``.venv/bin/python bench/dispatch_slurm.py [--runs N] [--poll-interval S]``
(needs a Slurm controller: ``eval "$(scripts/services/slurm.sh)"``)

Rows, run round-robin so a loaded machine slows them alike, each after one warm-up:

- ``bare: sbatch --wrap python -c pass``: ``sbatch --parsable --wrap 'PYTHON -c pass'`` with the
  runner's interpreter (a bare ``python3`` may be a pyenv shim that alone costs 0.7 s), then
  ``scontrol show job`` polled (the runner's schedule: 50 ms growing to the poll interval) until the
  job has ended: the floor Slurm itself costs;
- ``runner: start->wait->result``: ``runner.start(task)``, ``runner.wait``, reading
  ``result.msgpack``, ``runner.destroy``: the whole dispatch as nymph drives it (the entry runs a
  ref noop with nymph's interpreter).

Prints median and p90 in milliseconds and the runner's ratio to the bare row.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _stats import median_p90

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "runners"))

from bench import bench_fns  # noqa: E402
from dreamlake.lakeshore import ids, wire  # noqa: E402
from dreamlake.lakeshore.envelope import Envelope, fn_for  # noqa: E402
from nymph.runner import Task  # noqa: E402
from nymph_slurm import SlurmRunner  # noqa: E402
from nymph_slurm.jobs import parse_record  # noqa: E402


def bare_sbatch(root: Path, python: str, poll_interval_s: float) -> None:
    out = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={root}", "--output=/dev/null", "--wrap", f"{python} -c pass"],
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = out.stdout.strip().split(";")[0]
    delay = 0.05
    while True:
        show = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
        record = parse_record(show.stdout.splitlines()[0])
        if not record.active:
            if record.state != "COMPLETED":
                raise SystemExit(f"bare job {job_id} ended {record.state} {record.fields.get('ExitCode')}")
            return
        time.sleep(delay * random.uniform(0.8, 1.2))
        delay = min(delay * 1.5, poll_interval_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--poll-interval", type=float, default=0.2, help="the runner's poll_interval_s")
    opts = parser.parse_args()
    runner = SlurmRunner(poll_interval_s=opts.poll_interval)
    runner.check()
    root = Path(tempfile.mkdtemp(prefix="bench-dispatch-slurm-"))
    args_blob = Envelope.create(fn_for(bench_fns.noop, "ref"), (), {}).to_bytes()

    def via_runner() -> None:
        invocation_id = ids.new_ulid()
        workdir = root / invocation_id
        workdir.mkdir(mode=0o700)
        (workdir / "args.msgpack").write_bytes(args_blob)
        task = Task(
            invocation_id, 1, workdir, {"LAKESHORE_INVOCATION_ID": invocation_id, "PYTHONPATH": str(ROOT)}
        )
        handle = runner.start(task)
        status = runner.wait(handle, 120)
        assert status is not None and status.exit_code == 0, status
        assert wire.unpack((workdir / "result.msgpack").read_bytes()) is None
        runner.destroy(handle)

    cases: list[tuple[str, Callable[[], None]]] = [
        ("bare: sbatch --wrap python -c pass", lambda: bare_sbatch(root, runner.python, opts.poll_interval)),
        ("runner: start->wait->result", via_runner),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    try:
        for _, fn in cases:
            fn()  # warm-up: page cache, bytecode, the controller's first job
        for _ in range(opts.runs):
            for name, fn in cases:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floor = statistics.median(times[cases[0][0]])
    print(f"slurm runner, N={opts.runs}, poll interval {opts.poll_interval} s")
    print(f"{'case':<38} {'median ms':>10} {'p90 ms':>10} {'ratio':>7}")
    for name, _ in cases:
        median, p90 = (x * 1000 for x in median_p90(times[name]))
        print(f"{name:<38} {median:>10.1f} {p90:>10.1f} {statistics.median(times[name]) / floor:>6.2f}x")


if __name__ == "__main__":
    main()
