"""From SIGTERM to the call running again elsewhere (issue 30): the time a preempted call is away.

A real ``lakeshore server`` (SQLite) and two ``nymph start`` processes (process runner). Per round:
nymph A runs ``sleepy(60)`` (``max_attempts=1``), nymph B is registered and polling; A gets
SIGTERM with ``--grace-s G``; the time from the SIGTERM to the status route showing attempt 2
running (on B) is recorded, then the call is cancelled and both nymphs stop. Printed: median and
p90 over the rounds, beside the goal (the grace, plus at most a second: the ladder, the
``preempted`` ack, the requeue's wake-up and B's claim). A figure, never an assertion.

Run: ``.venv/bin/python bench/preempt.py [--rounds 5] [--grace-s 2]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _stats import percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import preempt_fns  # noqa: E402
from tests.stack.nymph import Nymph  # noqa: E402
from tests.stack.producer import call, envelope, status_of, submit  # noqa: E402
from tests.stack.server import Server  # noqa: E402
from tests.stack.wait import until  # noqa: E402


def one_round(srv: Server, base: Path, grace_s: float) -> float:
    tokens = srv.tokens()
    dirs = [base / "a", base / "b"]
    for d in dirs:
        d.mkdir(parents=True)
    a = Nymph(srv.url, tokens["daemon"], dirs[0], "--grace-s", str(grace_s)).start()
    b: Nymph | None = None
    try:
        inv = submit(srv.url, tokens["admin"], envelope(preempt_fns.sleepy, 60), max_attempts=1)
        until(lambda: (a.workdir / inv / "handle.json").exists(), "attempt 1 on nymph A")
        b = Nymph(srv.url, tokens["daemon"], dirs[1]).start()
        until(lambda: "registered as worker" in b.output(), "nymph B to register")
        sent = time.monotonic()
        a.signal(15)
        until(
            lambda: (
                (s := status_of(srv.url, tokens["admin"], inv))["attempt"] >= 2 and s["state"] == "running"
            ),
            "the call to run again on nymph B",
        )
        away = time.monotonic() - sent
        call(srv.url, tokens["admin"], f"/v1/producer/invocations/{inv}/cancel", {})
        return away
    finally:
        for n in (a, b):
            if n is not None:
                n.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--grace-s", type=float, default=2.0)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp:
        data = Path(tmp) / "cp"
        data.mkdir()
        srv = Server(data)
        srv.start()
        try:
            times = [one_round(srv, Path(tmp) / f"round{i}", opts.grace_s) for i in range(opts.rounds)]
        finally:
            srv.stop()
    times.sort()
    print(f"SIGTERM -> running again elsewhere, {opts.rounds} rounds, --grace-s {opts.grace_s:g}:")
    print(
        f"  median {percentile(times, 0.5):.2f} s   p90 {percentile(times, 0.9):.2f} s   "
        f"(goal: grace + <= 1 s = {opts.grace_s + 1:.2f} s)"
    )


if __name__ == "__main__":
    main()
