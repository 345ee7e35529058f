"""After the suite: fail, listing them, when processes of the suite are still running (issue 32).

``scripts/test.sh`` runs pytest with ``LAKESHORE_SUITE_RUN`` set to a fresh id; every process the
suite starts inherits it (a ``lakeshore server``, a ``nymph start``, an entry, a benchmark). Those
still alive a few seconds after pytest returned are leftovers: a fixture that did not kill what it
started (a test that timed out, a process outside its process group). Matching the id, not names,
keeps this right on a machine where other suites run too.

Usage: ``python scripts/leftovers.py [--wait-s 10]``; exit 1 listing the leftovers (and killing
them, so the next run starts clean), 0 when there are none.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import psutil

ENV = "LAKESHORE_SUITE_RUN"


def leftovers(run_id: str) -> list[psutil.Process]:
    mine = {os.getpid(), os.getppid()}
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in mine:
            continue
        try:
            if proc.environ().get(ENV) == run_id:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wait-s", type=float, default=10.0, help="grace for processes still exiting")
    args = parser.parse_args()
    run_id = os.environ.get(ENV, "")
    if not run_id:
        print(f"leftovers: {ENV} is not set; run through scripts/test.sh", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait_s
    left = leftovers(run_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = leftovers(run_id)
    if not left:
        print("leftovers: no process of the suite is left")
        return 0
    print(f"leftovers: {len(left)} process(es) of the suite outlived it:", file=sys.stderr)
    for proc in left:
        try:
            cmd = " ".join(proc.cmdline())[:300]
            print(f"  pid {proc.pid} (parent {proc.ppid()}): {cmd}", file=sys.stderr)
            proc.kill()
        except (psutil.Error, OSError):
            continue
    return 1


if __name__ == "__main__":
    sys.exit(main())
