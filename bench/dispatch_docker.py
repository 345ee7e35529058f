"""Round trip of a noop through the docker / gvisor runners, beside a bare ``docker run``.

Usage: ``.venv/bin/python bench/dispatch_docker.py [--runs N] [--image IMAGE]``
(needs a Docker engine and the image: ``eval "$(scripts/services/docker.sh)"``)

Rows, per runtime (runc for ``docker``, runsc for ``gvisor`` when registered), run round-robin so a
loaded machine slows them alike, each after one warm-up:

- ``bare: docker run python3 -c pass``: ``docker run --rm --network none IMAGE python3 -c pass``,
  the floor a container costs through the CLI;
- ``cli: docker run entry noop``: the same ``docker run`` with the runner's mounts, running the
  entry on a ref noop (what the runner does, minus the runner);
- ``runner: start->wait->result``: ``runner.start(task)``, ``runner.wait``, reading
  ``result.msgpack``, ``runner.destroy``: the whole dispatch as nymph drives it.

Prints median and p90 in milliseconds and the runner's overhead against the bare row.
"""

from __future__ import annotations

import argparse
import os
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

from dreamlake.lakeshore import ids, wire  # noqa: E402
from dreamlake.lakeshore.envelope import Envelope, fn_for  # noqa: E402
from nymph.runner import Task  # noqa: E402
from nymph_docker import BUNDLE_TARGET, ENTRY_MODULE, WORKDIR_TARGET, DockerRunner  # noqa: E402
from nymph_gvisor import GVisorRunner  # noqa: E402
from tests import docker_fns  # noqa: E402


def _workdir(root: Path, args_blob: bytes) -> tuple[str, Path]:
    invocation_id = ids.new_ulid()
    workdir = root / invocation_id
    workdir.mkdir(mode=0o700)
    (workdir / "args.msgpack").write_bytes(args_blob)
    return invocation_id, workdir


def _docker_run(argv: list[str]) -> None:
    proc = subprocess.run(["docker", "run", "--rm", *argv], capture_output=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"docker run {argv} failed: {proc.stderr.decode()[-1000:]}")


def bench(
    runner: DockerRunner, runtime: str, image: str, runs: int, root: Path
) -> list[tuple[str, list[float]]]:
    args_blob = Envelope.create(fn_for(docker_fns.noop, "ref"), (), {}).to_bytes()
    rt = ["--runtime", runtime]
    bundle = str(runner._bundle_path())

    def bare() -> None:
        _docker_run([*rt, "--network", "none", image, "python3", "-c", "pass"])

    def cli() -> None:
        _, workdir = _workdir(root, args_blob)
        _docker_run(
            [
                *rt,
                "--network=none",
                "--init",
                "-v",
                f"{workdir}:{WORKDIR_TARGET}",
                "-w",
                WORKDIR_TARGET,
                "-v",
                f"{bundle}:{BUNDLE_TARGET}:ro",
                "-v",
                f"{ROOT}:{ROOT}:ro",
                "-e",
                f"PYTHONPATH={BUNDLE_TARGET}:{ROOT}",
                image,
                "python3",
                "-m",
                ENTRY_MODULE,
            ]
        )
        assert (workdir / "result.msgpack").exists()

    def via_runner() -> None:
        invocation_id, workdir = _workdir(root, args_blob)
        task = Task(invocation_id, 1, workdir, {"LAKESHORE_INVOCATION_ID": invocation_id})
        handle = runner.start(task)
        status = runner.wait(handle, 120)
        assert status is not None and status.exit_code == 0, status
        assert wire.unpack((workdir / "result.msgpack").read_bytes()) is None
        runner.destroy(handle)

    cases: list[tuple[str, Callable[[], None]]] = [
        ("bare: docker run python3 -c pass", bare),
        ("cli: docker run entry noop", cli),
        ("runner: start->wait->result", via_runner),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _, fn in cases:
        fn()  # warm-up: page cache, image layers, bytecode
    for _ in range(runs):
        for name, fn in cases:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return [(name, times[name]) for name, _ in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--image", default=os.environ.get("LAKESHORE_TEST_IMAGE", "lakeshore-python:bookworm")
    )
    opts = parser.parse_args()
    kinds: list[tuple[str, DockerRunner]] = [
        ("runc", DockerRunner(image=opts.image, pull="never", code_dirs=[str(ROOT)])),
        ("runsc", GVisorRunner(image=opts.image, pull="never", code_dirs=[str(ROOT)])),
    ]
    root = Path(tempfile.mkdtemp(prefix="bench-dispatch-docker-"))
    try:
        for runtime, runner in kinds:
            try:
                runner.check()
            except Exception as exc:  # a missing runtime skips its rows, it does not end the bench
                print(f"{runner.name}: skipped ({exc})")
                continue
            rows = bench(runner, runtime, opts.image, opts.runs, root)
            floor = statistics.median(rows[0][1])
            print(f"\n{runner.name} runner ({runtime}), image {opts.image}, N={opts.runs}")
            print(f"{'case':<36} {'median ms':>10} {'p90 ms':>10} {'vs bare':>9}")
            for name, times in rows:
                median, p90 = (x * 1000 for x in median_p90(times))
                ratio = statistics.median(times) / floor - 1
                print(f"{name:<36} {median:>10.1f} {p90:>10.1f} {ratio:>+8.1%}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
