"""The README's main job: a control plane, a nymph, and a real workload through them.

Starts ``lakeshore server`` (embedded SQLite in a temporary data directory) and ``nymph start
--runner process`` as real processes on loopback (their logs go to files in that directory), submits
a plain call, a generator that streams live, a function whose prints are read live, and a failing
call, prints what comes back, and shows what an operator sees with ``lakeshore queues`` and
``lakeshore ls``. Everything is torn down at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402  (the demo's functions; nymph imports them by reference too)

import dreamlake.lakeshore as dls  # noqa: E402
from dreamlake.lakeshore.devstack import LocalStack  # noqa: E402


def ms_since(t0: float) -> str:
    return f"{(time.perf_counter() - t0) * 1000:.0f} ms"


def main() -> int:
    with LocalStack(queues=["demo"], concurrency=2, pythonpath=[HERE], quiet=True) as stack:
        print(f"== control plane: lakeshore server on {stack.url} (SQLite under {stack.dir / 'cp'})")
        print("== nymph: process runner, queue 'demo', 2 slots, registered")
        plane = stack.plane()
        q = dls.SyncQueue("demo", dispatch=plane)

        print("\n-- a plain call: add(2, 3)")
        t0 = time.perf_counter()
        inv = workload.add.submit(2, 3, _dispatch=plane)
        result = q.result(inv, timeout=60)
        print(f"   {inv} -> {result}   ({ms_since(t0)}, the first call includes nymph's start-up)")
        for a, b in [(40, 2), (7, 8)]:
            t0 = time.perf_counter()
            inv = workload.add.submit(a, b, _dispatch=plane)
            print(f"   add({a}, {b}) -> {q.result(inv, timeout=60)}   ({ms_since(t0)} submit to result)")

        print("\n-- a generator, streamed live while it runs: countdown(5)")
        inv = workload.countdown.submit(5, _dispatch=plane)
        for frame in q.stream(inv, timeout=30.0):
            lag_ms = (time.time() - frame["at"]) * 1000
            print(f"   frame {frame['left']}   (yield to consumer: {lag_ms:.0f} ms)")
        print(f"   stream ended at END; the generator returned {q.result(inv, timeout=30)!r}")

        print("\n-- what a function prints, read live while it runs: chatter(4)")
        inv = workload.chatter.submit(4, 0.2, _dispatch=plane)
        for chunk in q.logs(inv, follow=True):
            for line in chunk.text.splitlines():
                print(f"   [{chunk.stream}] {line}")
        print(
            f"   it returned {q.result(inv, timeout=30)!r} (on a plane you keep, `lakeshore logs ID` prints it again)"
        )

        print("\n-- a failure: explode(-1)")
        inv = workload.explode.submit(-1, _dispatch=plane)
        try:
            q.result(inv, timeout=60)
        except dls.DispatchError as exc:
            print(f"   DispatchError: {exc}")
            print("   remote traceback:")
            for line in (exc.traceback or "").rstrip().splitlines():
                print(f"     {line}")
        print(f"   state = {q.status(inv)['state']}")

        env = {**os.environ, "LAKESHORE_URL": stack.url, "LAKESHORE_TOKEN": stack.tokens["admin"]}
        lakeshore = Path(sys.executable).parent / "lakeshore"
        for args in (["queues"], ["ls", "--limit", "3"]):
            print(f"\n-- what an operator sees: lakeshore {' '.join(args)}")
            out = subprocess.run([str(lakeshore), *args], env=env, capture_output=True, text=True, check=True)
            print("\n".join("   " + line for line in out.stdout.rstrip().splitlines()))
    print("\nDone: control plane and nymph stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
