"""Start-up cost of the in-sandbox entry: a noop invocation vs a bare interpreter, and import times.

Usage: ``.venv/bin/python bench/entry_startup.py [--runs N]``

Rows (median / p90 wall time of a whole subprocess, ratio to ``python -c pass`` of the same interpreter,
all measured in this run):

- ``python -c pass``: the floor;
- ``import entry``: ``python -c "import dreamlake.lakeshore.daemon.entry"``;
- ``entry noop (ref)``: ``python -m dreamlake.lakeshore.daemon.entry`` running a ref noop in a workdir;
- the same two with ``/usr/bin/python3`` and only the entry bundle on PYTHONPATH, when that exists.

Then the ``-X importtime`` cumulative microseconds of the entry's imports (median of the runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dreamlake.lakeshore.daemon.bundle import build_bundle  # noqa: E402
from dreamlake.lakeshore.envelope import Envelope  # noqa: E402

SYSTEM_PYTHON = "/usr/bin/python3"
ENTRY = "dreamlake.lakeshore.daemon.entry"


def _times(
    cmd: list[str], env: dict[str, str], cwd: Path, runs: int, cleanup: Path | None = None
) -> list[float]:
    out = []
    for _ in range(runs):
        if cleanup is not None and cleanup.exists():
            cleanup.unlink()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True)
        out.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"{cmd} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return out


def _p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.9 * len(xs)) - 1)]


def _importtimes(python: str, env: dict[str, str], cwd: Path, runs: int) -> dict[str, float]:
    """Median cumulative import microseconds per module imported by ``import entry`` (after site)."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        proc = subprocess.run(
            [python, "-X", "importtime", "-c", f"import {ENTRY}"],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    ns = parser.parse_args()
    python = sys.executable  # the venv's interpreter itself (a symlink), never a pyenv shim on PATH
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        mods = tmpdir / "mods"
        mods.mkdir()
        (mods / "bench_mod.py").write_text("def noop():\n    return None\n")
        workdir = tmpdir / "inv"
        workdir.mkdir()
        fn = {"kind": "ref", "module": "bench_mod", "qualname": "noop", "src_hash": None}
        (workdir / "args.msgpack").write_bytes(Envelope.create(fn).to_bytes())
        result = workdir / "result.msgpack"
        base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env = {**base_env, "PYTHONPATH": f"{ROOT}{os.pathsep}{mods}"}

        rows: list[tuple[str, list[float]]] = []
        base = _times([python, "-c", "pass"], base_env, workdir, ns.runs)
        rows.append(("python -c pass", base))
        rows.append(("import entry", _times([python, "-c", f"import {ENTRY}"], env, workdir, ns.runs)))
        rows.append(("entry noop (ref)", _times([python, "-m", ENTRY], env, workdir, ns.runs, result)))

        sys_rows: list[tuple[str, list[float]]] = []
        if os.path.exists(SYSTEM_PYTHON):
            bundle = build_bundle(tmpdir / "lakeshore-entry.zip")
            benv = {**base_env, "PYTHONPATH": f"{bundle}{os.pathsep}{mods}"}
            sys_base = _times([SYSTEM_PYTHON, "-s", "-c", "pass"], base_env, workdir, ns.runs)
            sys_rows.append((f"{SYSTEM_PYTHON} -c pass", sys_base))
            sys_rows.append(
                (
                    "bundle: entry noop (ref)",
                    _times([SYSTEM_PYTHON, "-s", "-m", ENTRY], benv, workdir, ns.runs, result),
                )
            )

        print(f"interpreter: {python} ({sys.version.split()[0]}), runs={ns.runs}")
        print(f"{'case':34} {'median ms':>10} {'p90 ms':>10} {'ratio':>7}")
        for table, floor in ((rows, base), (sys_rows, sys_rows[0][1] if sys_rows else base)):
            for name, xs in table:
                ratio = statistics.median(xs) / statistics.median(floor)
                print(f"{name:34} {statistics.median(xs) * 1e3:10.1f} {_p90(xs) * 1e3:10.1f} {ratio:7.2f}")

        print("\nimport time of the entry's imports (-X importtime, cumulative us, median):")
        imports = _importtimes(python, env, workdir, max(5, ns.runs // 3))
        for name, us in sorted(imports.items(), key=lambda kv: -kv[1])[:20]:
            print(f"  {name:40} {us:9.0f}")


if __name__ == "__main__":
    main()
