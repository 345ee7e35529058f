"""Every benchmark that needs no extra service still runs end to end (tiny sizes, figures ignored).

Benchmarks are not run by CI at full size; this keeps them from rotting silently when the code they
drive changes. Nothing here is timed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # each benchmark runs end to end in a subprocess

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
    "fleet": ["--sizes", "1,3", "--submits", "3", "--idle-s", "0.2"],
    "payloads": ["--sizes", "0.25,0.5", "--reps", "1"],
    "logs": ["--say", "3", "--pause-ms", "5", "--lines", "200", "--values", "20"],
    "streams": ["--frames", "20", "--nymph-frames", "50", "--blobs", "2", "--first-runs", "2"],
    "store": ["--reps", "5", "--opens", "1", "--backends", "sqlite-memory"],
    "sweep": ["--calls", "300", "--reps", "1", "--local", "200"],
    "warm": ["--calls", "5", "--producers", "2", "--per-producer", "5"],
    "hotpaths": [
        "--only",
        "warm,streams",
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
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *CASES[name]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the benchmark printed no figures"
    if "--profile" in CASES[name]:  # the sampled server wrote its samples and they were read back
        assert "profile: lakeshore server" in out.stdout and "busy samples" in out.stdout, out.stdout[-2000:]
