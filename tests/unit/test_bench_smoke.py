"""Every benchmark that needs no extra service still runs end to end (tiny sizes, figures ignored).

Benchmarks are not run by CI at full size; this keeps them from rotting silently when the code they
drive changes. Nothing here is timed. The sizes are the smallest that drive every code path, and the
bound (:data:`LIMIT_S`) holds on a loaded 2-core machine; each benchmark runs in a session of its
own, and whatever it started is killed when it ends or times out (``run_owned``), so a benchmark
that hangs leaves no ``lakeshore server`` behind.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT, run_owned

LIMIT_S = 240  # per benchmark, on a loaded 2-core machine (the fleet case took over 120 s there)
# each benchmark runs end to end in a subprocess; pytest-timeout past LIMIT_S, so run_owned cleans up
pytestmark = [pytest.mark.slow, pytest.mark.timeout(LIMIT_S + 60)]

# ``script:case`` runs bench/script.py a second way
CASES = {
    "backlog": ["--quick", "--reps", "3", "--backends", "sqlite-memory"],
    "code_archives": ["--files", "5", "--reps", "3"],
    "control_plane": [
        "--producers",
        "2",
        "--daemons",
        "2",
        "--jobs",
        "8",
        "--reps",
        "1",
        "--raw-rows",
        "200",
    ],
    "dispatch": ["--calls", "2", "--batch", "6", "--slots", "2", "--idle-s", "0"],
    "fleet": ["--sizes", "1,2", "--submits", "3", "--idle-s", "0.2"],
    "floor": ["--calls", "5"],
    "floor:submits": ["--submits", "--producers", "2", "--jobs", "40", "--rounds", "2"],  # 200 a process
    "payloads": ["--sizes", "0.25,0.5", "--reps", "1"],
    "preempt": ["--rounds", "1", "--grace-s", "0.5"],
    "logs": ["--say", "3", "--pause-ms", "5", "--lines", "200", "--values", "20"],
    "streams": [
        "--frames",
        "20",
        "--nymph-frames",
        "50",
        "--blobs",
        "2",
        "--first-runs",
        "2",
        "--two-way",
        "10",
    ],
    "store": ["--reps", "5", "--opens", "1", "--backends", "sqlite-memory"],
    "sweep": ["--calls", "300", "--reps", "1", "--local", "200"],
    "warm": ["--calls", "5", "--producers", "2", "--per-producer", "5"],
    "peers": ["--calls", "3"],  # a skip line per peer not installed
    "writer": ["--n", "16", "--pg", ""],
    "hotpaths": [
        "--only",
        "peers,writer,warm,streams",
        "--writer-n",
        "16",
        "--profile",
        "--jobs",
        "40",
        "--pg",
        "",
        "--warm-calls",
        "5",
        "--warm-per-producer",
        "5",
        "--producers",
        "2",
        "--frames",
        "20",
        "--nymph-frames",
        "50",
        "--first-runs",
        "2",
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_and_prints_its_table(name: str) -> None:
    out = run_owned(
        [sys.executable, str(ROOT / "bench" / f"{name.split(':')[0]}.py"), *CASES[name]],
        cwd=ROOT,
        timeout=LIMIT_S,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the benchmark printed no figures"
    if "--profile" in CASES[name]:  # the sampled server wrote its samples and they were read back
        assert "profile: lakeshore server" in out.stdout and "busy samples" in out.stdout, out.stdout[-2000:]
    if name == "writer":  # the warm call's store share, beside the same statements raw and the floor's
        assert "store.write_batch" in out.stdout and "bench/floor.py" in out.stdout, out.stdout[-2000:]
    if name == "floor:submits":  # the three floors and the product's submits, each beside hello-world
        for row in ("lakeshore's row", "the checks every submit must make", "lakeshore server"):
            assert row in out.stdout, out.stdout[-2000:]
        assert "2 rounds" in out.stdout and out.stdout.count(" 1.00x  1.00x  1.00x      2/2") == 1, out.stdout
    if name in ("warm", "hotpaths"):  # a user's f.call() is measured beside the cheap client's
        assert "f.call()" in out.stdout, out.stdout[-2000:]
