"""What shipping the code with the call costs (issue 13), measured in one run.

SDK side, per submit (``Thunk.to_envelope``): ``code=None`` (the baseline: nothing ships), ``"auto"``
with the package unchanged (a stat of every file, the archive reused), and ``"auto"`` after an edit
(the package packed and hashed again). nymph side, per invocation (``CodeCache.acquire``): a cache
hit (the sha256's directory exists; inline bytes verified) and a miss (verify, unpack, seal, rename;
the bytecode is written after, in the background). Task side: a fresh interpreter importing the whole package from the cache, less the
same interpreter's start, with the bytecode nymph wrote at unpack and (the baseline) from a copy
without it, where every task compiled the source.
Each line prints the median and p90 in ms, the ratio to the baseline measured in the same run, and
the goal beside it.

    .venv/bin/python bench/code_archives.py                 # a 60-file package, about 10 s
    .venv/bin/python bench/code_archives.py --files 500     # a larger package
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stats import median_p90
from nymph.codecache import CodeCache

GOALS_MS = {  # per operation, for the default 60-file package
    "submit code=None": None,
    "submit auto, unchanged": 2.0,
    "submit auto, edited": 20.0,
    "nymph cache hit": 1.0,
    "nymph cache miss": 30.0,
    "task import, bytecode": None,  # beyond the interpreter's start; the row below is the baseline
    "task import, source": None,
}


def write_package(base: Path, name: str, files: int, size: int) -> None:
    pkg = base / name
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import dreamlake.lakeshore as dls\n\n\n@dls.udf\ndef f(x):\n    return x\n"
    )
    body, j = "", 0  # code, not a comment: what a task's import compiles (or loads as bytecode)
    while len(body) < size:
        body += f"def f{j}(x, y=None):\n    return [x + {j} for _ in range(y or 1)]\n\n\n"
        j += 1
    for i in range(files - 1):
        (pkg / ("sub" if i % 2 else "") / f"m{i}.py").write_text(body)


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    fn()  # warm
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=60, help="files in the package")
    parser.add_argument("--file-bytes", type=int, default=2048, help="bytes per file")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()

    os.environ.pop("LAKESHORE_CODE", None)
    tmp = Path(tempfile.mkdtemp(prefix="bench-code-"))
    try:
        name = "bench_pkg_" + os.urandom(4).hex()
        write_package(tmp / "src", name, args.files, args.file_bytes)
        sys.path.insert(0, str(tmp / "src"))
        udf = importlib.import_module(name).f
        import dreamlake.lakeshore as dls

        none = dls.udf(code=None)(udf.__wrapped__)
        edited = tmp / "src" / name / "m0.py"
        counter = [0]

        def edit_and_submit() -> Any:
            counter[0] += 1
            edited.write_text(f"# edit {counter[0]}\n")
            return udf.thunk(1).to_envelope()

        record = udf.thunk(1).to_envelope().cfg["code"]
        rows: dict[str, list[float]] = {
            "submit code=None": timed(lambda: none.thunk(1).to_envelope(), args.reps),
            "submit auto, unchanged": timed(lambda: udf.thunk(1).to_envelope(), args.reps),
            "submit auto, edited": timed(edit_and_submit, max(10, args.reps // 5)),
        }
        hit_cache = CodeCache(tmp / "hit")
        hit_cache.acquire(record)
        rows["nymph cache hit"] = timed(lambda: hit_cache.acquire(record), args.reps)
        misses: list[float] = []
        for i in range(max(10, args.reps // 5) + 1):  # the first one warms up
            cache = CodeCache(tmp / f"miss{i}")
            t0 = time.perf_counter()
            cache.acquire(record)
            if i:
                misses.append((time.perf_counter() - t0) * 1000)
            cache.compiled(record["sha256"], 120)  # its bytecode, written in the background: not timed
        rows["nymph cache miss"] = misses
        assert hit_cache.compiled(record["sha256"], 120)

        # a task importing the whole shipped package: the cache's bytecode, or (as before nymph
        # wrote it) compiled from source, the copy being no task's to write
        imports = "import " + ", ".join(
            [name] + [f"{name}.{'sub.' if i % 2 else ''}m{i}" for i in range(args.files - 1)]
        )
        bare = [sys.executable, "-c", "import dreamlake.lakeshore"]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(hit_cache.path_for(record["sha256"])), str(Path(__file__).resolve().parents[1])]
        )
        no_pyc = tmp / "no-pyc"
        shutil.copytree(
            hit_cache.path_for(record["sha256"]), no_pyc, ignore=shutil.ignore_patterns("__pycache__")
        )
        env_src = dict(
            env, PYTHONPATH=env["PYTHONPATH"].replace(str(hit_cache.path_for(record["sha256"])), str(no_pyc))
        )
        spawns = max(10, args.reps // 10)
        floor = timed(lambda: subprocess.run(bare, env=env, check=True), spawns)
        rows["task import, bytecode"] = [
            t - statistics.median(floor)
            for t in timed(lambda: subprocess.run([*bare[:2], imports], env=env, check=True), spawns)
        ]
        rows["task import, source"] = [
            t - statistics.median(floor)
            for t in timed(lambda: subprocess.run([*bare[:2], imports], env=env_src, check=True), spawns)
        ]

        base, _ = median_p90(rows["submit code=None"])
        print(
            f"package: {args.files} files of {args.file_bytes} B; archive {record['size']} B "
            f"({'inline' if 'inline' in record else 'ref'}); {args.reps} reps. Shared, loaded machine: "
            "figures are upper bounds"
        )
        print(f"{'case':<26}{'median ms':>11}{'p90 ms':>9}{'vs code=None':>14}{'goal ms':>9}")
        for case, samples in rows.items():
            med, p90 = median_p90(samples)
            goal = GOALS_MS[case]
            ratio = f"{med / base:.1f}x" if case.startswith("submit") else "-"
            print(f"{case:<26}{med:>11.3f}{p90:>9.3f}{ratio:>14}{'' if goal is None else f'< {goal}':>9}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
