"""Start-up cost of the in-sandbox entry: a noop invocation vs a bare interpreter, and import times.

Usage: ``.venv/bin/python bench/entry_startup.py [--runs N] [--baseline-root DIR]``

Every row is the wall time of a whole subprocess (median, p90); the cases are run round-robin (one
run of each case per round) so that a loaded machine slows them alike. Ratios are against
``venv -c pass`` and ``bare -S -c pass`` (the venv's base interpreter, the same Python, without site:
the bare interpreter's own site-packages may hold ``.pth`` files that import a lot) and, for the
bundle rows, against ``/usr/bin/python3 -c pass``. Rows:

- ``bare -c pass`` (also ``-S`` and ``-I``): the floor, the base interpreter the venv was made from;
- ``venv -c pass`` (also ``-s`` and ``-I``): what the venv's site (``.pth`` files) adds;
- ``venv import entry``: ``python -c "import dreamlake.lakeshore.daemon.entry"``;
- ``entry noop (ref)``: ``python -m dreamlake.lakeshore.daemon.entry`` running a ref noop in a
  workdir, without and with a ``src_hash`` (what ``fn_for`` ships, so what runs in production);
- ``baseline: entry noop``: the same on another checkout (``--baseline-root``, e.g. a copy of the
  tree before a change: ``cp -r dreamlake /tmp/before``), so a before/after is measured in one run;
- ``/usr/bin/python3 -c pass`` and ``bundle: entry noop (ref)``: a bare system Python with only the
  entry bundle (and the user module) on ``PYTHONPATH``, when ``/usr/bin/python3`` exists.

Then the ``-X importtime`` cumulative microseconds of the entry noop's imports (median of the runs).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _stats import percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dreamlake.lakeshore.daemon.bundle import build_bundle  # noqa: E402
from dreamlake.lakeshore.envelope import Envelope  # noqa: E402

SYSTEM_PYTHON = "/usr/bin/python3"
ENTRY = "dreamlake.lakeshore.daemon.entry"
NOOP = "def noop():\n    return None\n"


class Case:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path, floor: str) -> None:
        self.name, self.cmd, self.env, self.cwd, self.floor = name, cmd, env, cwd, floor
        self.times: list[float] = []

    def run(self) -> None:
        result = self.cwd / "result.msgpack"
        if result.exists():
            result.unlink()
        t0 = time.perf_counter()
        proc = subprocess.run(self.cmd, env=self.env, cwd=self.cwd, capture_output=True)
        self.times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(
                f"{self.name}: {self.cmd} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}"
            )


def _importtimes(python: str, env: dict[str, str], cwd: Path, runs: int) -> dict[str, float]:
    """Median cumulative import microseconds per module the entry noop imports (after site)."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        proc = subprocess.run(
            [python, "-X", "importtime", "-m", ENTRY], env=env, cwd=cwd, capture_output=True, text=True
        )
        lines = proc.stderr.splitlines()
        start = next((i for i, line in enumerate(lines) if line.rstrip().endswith("| site")), -1) + 1
        for line in lines[start:]:
            parts = line.split("|")
            if len(parts) == 3 and parts[1].strip().isdigit():
                name = parts[2].rstrip()
                depth = (len(name) - len(name.lstrip())) // 2
                if depth <= 2:
                    samples.setdefault(name.strip(), []).append(float(parts[1]))
    return {name: statistics.median(v) for name, v in samples.items()}


def _workdir(parent: Path, name: str, src_hash: str | None) -> Path:
    workdir = parent / name
    workdir.mkdir()
    fn = {"kind": "ref", "module": "bench_mod", "qualname": "noop", "src_hash": src_hash}
    (workdir / "args.msgpack").write_bytes(Envelope.create(fn).to_bytes())
    return workdir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--baseline-root", type=Path, help="another checkout to time the entry noop of")
    ns = parser.parse_args()
    python = sys.executable  # the venv's interpreter itself (a symlink), never a pyenv shim on PATH
    bare = getattr(sys, "_base_executable", python)  # the interpreter the venv was made from
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        mods = tmpdir / "mods"
        mods.mkdir()
        (mods / "bench_mod.py").write_text(NOOP)
        plain = _workdir(tmpdir, "inv", None)
        hashed = _workdir(tmpdir, "inv-hash", "sha256:" + hashlib.sha256(NOOP.encode()).hexdigest()[:16])
        base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env = {**base_env, "PYTHONPATH": f"{ROOT}{os.pathsep}{mods}"}
        floor = "venv -c pass"
        cases = [
            Case("bare -c pass", [bare, "-c", "pass"], base_env, plain, floor),
            Case("bare -S -c pass", [bare, "-S", "-c", "pass"], base_env, plain, floor),
            Case("bare -I -c pass", [bare, "-I", "-c", "pass"], base_env, plain, floor),
            Case("venv -c pass", [python, "-c", "pass"], base_env, plain, floor),
            Case("venv -s -c pass", [python, "-s", "-c", "pass"], base_env, plain, floor),
            Case("venv -I -c pass", [python, "-I", "-c", "pass"], base_env, plain, floor),
            Case("venv import entry", [python, "-c", f"import {ENTRY}"], env, plain, floor),
            Case("entry noop (ref)", [python, "-m", ENTRY], env, plain, floor),
            Case("entry noop (ref, src_hash)", [python, "-m", ENTRY], env, hashed, floor),
        ]
        if ns.baseline_root is not None:
            benv = {**base_env, "PYTHONPATH": f"{ns.baseline_root.resolve()}{os.pathsep}{mods}"}
            baseline = tmpdir / "baseline"
            baseline.mkdir()
            cases.append(Case("baseline: entry noop (ref)", [python, "-m", ENTRY], benv, plain, floor))
            cases.append(Case("baseline: entry noop (src_hash)", [python, "-m", ENTRY], benv, hashed, floor))
        if os.path.exists(SYSTEM_PYTHON):
            bundle = build_bundle(tmpdir / "lakeshore-entry.zip")
            zenv = {**base_env, "PYTHONPATH": f"{bundle}{os.pathsep}{mods}"}
            sys_floor = f"{SYSTEM_PYTHON} -c pass"
            cases += [
                Case(sys_floor, [SYSTEM_PYTHON, "-c", "pass"], base_env, plain, sys_floor),
                Case(
                    f"{SYSTEM_PYTHON} -s -c pass",
                    [SYSTEM_PYTHON, "-s", "-c", "pass"],
                    base_env,
                    plain,
                    sys_floor,
                ),
                Case("bundle: entry noop (ref)", [SYSTEM_PYTHON, "-s", "-m", ENTRY], zenv, plain, sys_floor),
                Case(
                    "bundle: entry noop (src_hash)",
                    [SYSTEM_PYTHON, "-s", "-m", ENTRY],
                    zenv,
                    hashed,
                    sys_floor,
                ),
            ]
        for case in cases:  # warm the page cache and the bytecode caches
            case.run()
            case.times.clear()
        for _ in range(ns.runs):
            for case in cases:
                case.run()

        medians = {case.name: statistics.median(case.times) for case in cases}
        print(f"bare: {bare}\nvenv: {python} ({sys.version.split()[0]}), runs={ns.runs} (round-robin)")
        bare_s = medians["bare -S -c pass"]
        print(f"{'case':34} {'median ms':>10} {'p90 ms':>10} {'x floor':>8} {'x bare -S':>10}  floor")
        for case in cases:
            med = medians[case.name]
            ratio = med / medians[case.floor]
            vs_bare = f"{med / bare_s:10.2f}" if case.floor == floor else " " * 10
            print(
                f"{case.name:34} {med * 1e3:10.1f} {percentile(case.times, 0.9) * 1e3:10.1f} {ratio:8.2f} {vs_bare}"
                f"  {case.floor}"
            )

        print("\nimport time of the entry noop's imports (-X importtime, cumulative us, median):")
        imports = _importtimes(python, env, hashed, max(5, ns.runs // 3))
        for name, us in sorted(imports.items(), key=lambda kv: -kv[1])[:20]:
            print(f"  {name:40} {us:9.0f}")


if __name__ == "__main__":
    main()
