"""Submit-to-result round trip of a noop through the README's stack, beside a bare interpreter spawn.

Usage: ``.venv/bin/python bench/dispatch.py [--runner process,docker,gvisor] [--calls 50]
[--batch 100] [--slots 1,2,4] [--idle-s 60] [--image IMAGE] [--runner-opt KEY=VALUE ...]
[--before DIR]`` (``--runner-opt prefork=false``: the process runner without its warm fork)

The stack is :class:`dreamlake.lakeshore.devstack.LocalStack`: ``lakeshore server`` (embedded SQLite)
and ``nymph start --runner RUNNER`` as real processes on loopback. A producer submits a ref noop
(``bench/bench_fns.py``) over HTTP and awaits its result; nothing is simulated. ``docker`` and
``gvisor`` need the engine and the image (``eval "$(bash scripts/services/docker.sh)"``; the image
is ``--image`` or ``LAKESHORE_TEST_IMAGE``); their nymph gets ``--runner-opt image=IMAGE``.

Rows, all measured in the same run so a loaded machine slows them alike:

- ``bare``: the floor for the runner, interleaved with the round trips: ``python -c pass`` with the
  interpreter nymph spawns (process), ``docker run --rm --network none IMAGE python3 -c pass``
  (docker), the same with ``--runtime=runsc`` (gvisor);
- ``round trip``: submit -> claim -> workdir -> spawn entry -> result -> ack -> await answer, one call
  at a time, one slot (p50 / p90, and the ratio to the bare spawn's);
- ``throughput N slots``: a batch of noops submitted at once and awaited, invocations/s, beside
  N / (bare spawn p50) (N bare spawns in parallel, the ideal for N slots);
- CPU ms per noop invocation over the throughput batch, by part: the server, nymph itself, and
  nymph's children (zygotes with the tasks they reaped; spawned tasks); beside a bare spawn's CPU;
- nymph's idle RSS and CPU time over ``--idle-s`` seconds (psutil on the nymph process).

``--before DIR``: a checkout of the code to compare with (``git archive <rev> | tar -x -C DIR``):
every row is measured for it too, in the same run, its stack (server, nymph, runners, zygote)
importing from ``DIR``; the throughput rows alternate between the two, and a last table gives the
CPU per noop invocation before and after, by part, with the ratio beside the goal (nymph's own
share, nymph + zygote + task, halved: ``<= 0.50x``).

With several runners, a last table has one column per runner: bare p50, round trip p50, and the
runner's overhead over its bare floor (aim for docker / gvisor: under 10 %).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import py_compile
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from _stats import percentile

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "runners"))

import bench_fns  # noqa: E402
import control_plane as cp  # noqa: E402

from dreamlake.lakeshore import ids, wire  # noqa: E402
from dreamlake.lakeshore.devstack import LocalStack  # noqa: E402
from dreamlake.lakeshore.envelope import Envelope, fn_for  # noqa: E402
from nymph.config import parse_runner_opts  # noqa: E402
from nymph_process import default_python  # noqa: E402

QUEUE = "bench"


def _ms(times: list[float]) -> str:
    return f"p50 {statistics.median(times) * 1000:7.1f} ms  p90 {percentile(times, 0.9) * 1000:7.1f} ms"


class Producer:
    """Submit and await over the producer routes with a cheap client (``control_plane.Client``:
    a raw socket, one keep-alive connection per thread), so the producer's own cost is small
    beside what it measures."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.token = token
        self.blob = Envelope.create(fn_for(bench_fns.noop, "ref"), (), {}).to_bytes()
        self._local = threading.local()

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = cp.Client(self.port, self.token)
        status, out = client.post(path, body)
        if status != 200:
            raise SystemExit(f"{path}: HTTP {status}: {str(out)[:300]}")
        assert isinstance(out, dict)
        return out

    def submit(self) -> str:
        body: dict[str, object] = {
            "invocation_id": ids.new_ulid(),
            "queue": QUEUE,
            "function": {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"},
            "args_blob": self.blob,
            "run_config": {"queue": QUEUE, "priority": 0.0, "key": None},
            "code_context": {},
        }
        return str(self._post("/v1/producer/submit", body)["invocation_id"])

    def await_(self, invocation_id: str) -> None:
        out = self._post("/v1/producer/await", {"invocation_id": invocation_id, "timeout_s": 50})
        if out.get("state") != "succeeded":
            raise SystemExit(f"noop {invocation_id} ended {out.get('state')}: {out.get('error')}")
        assert wire.unpack(out["result_blob"]) is None  # type: ignore[arg-type]

    def round_trip(self) -> float:
        t0 = time.perf_counter()
        self.await_(self.submit())
        return time.perf_counter() - t0


def bare_command(runner: str, python: str, image: str) -> list[str]:
    """The floor for ``runner``: the same interpreter (in the same image) doing nothing."""
    if runner == "process":
        return [python, "-c", "pass"]
    runtime = ["--runtime=runsc"] if runner == "gvisor" else []
    return ["docker", "run", "--rm", "--network", "none", *runtime, image, "python3", "-c", "pass"]


def bare_spawn(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=120)
    return time.perf_counter() - t0


def latency(stack: LocalStack, calls: int, bare_cmd: list[str]) -> tuple[list[float], list[float]]:
    producer = Producer(stack.port, stack.tokens["admin"])
    for _ in range(3):  # warm-up: page cache, bytecode, connections
        producer.round_trip()
        bare_spawn(bare_cmd)
    trips: list[float] = []
    bare: list[float] = []
    for _ in range(calls):  # interleaved, so both see the same machine
        trips.append(producer.round_trip())
        bare.append(bare_spawn(bare_cmd))
    return trips, bare


def throughput(stack: LocalStack, batch: int, slots: int) -> float:
    return throughput_cpu(stack, batch, slots)[0]


def _cpu_s(proc: psutil.Process, *, reaped: bool) -> float:
    """User + system CPU seconds of ``proc``; with ``reaped``, also of its children it reaped
    (a zygote's tasks)."""
    t = proc.cpu_times()
    total = t.user + t.system
    if reaped:
        total += t.children_user + t.children_system
    return total


def cpu_parts(stack: LocalStack) -> dict[str, float]:
    """CPU seconds so far of the server, nymph itself, and nymph's children (zygotes with the tasks
    they reaped, and tasks nymph spawned and reaped)."""
    assert stack.server is not None and stack.nymph is not None
    server, nymph = psutil.Process(stack.server.pid), psutil.Process(stack.nymph.pid)
    own = nymph.cpu_times()
    kids = own.children_user + own.children_system
    for child in nymph.children(recursive=False):
        with contextlib.suppress(psutil.Error):
            kids += _cpu_s(child, reaped=True)
    return {"server": _cpu_s(server, reaped=False), "nymph": own.user + own.system, "zygote+tasks": kids}


def _load(port: int, token: str, n: int, go: Any, out: Any) -> None:
    """A load process: submit ``n`` noops, then await each (``control_plane.run_load``)."""
    producer = Producer(port, token)
    go.wait()
    t0 = time.perf_counter()
    invs = [producer.submit() for _ in range(n)]
    for inv in invs:
        producer.await_(inv)
    out.put((t0, time.perf_counter(), n))


def throughput_cpu(stack: LocalStack, batch: int, slots: int) -> tuple[float, dict[str, float]]:
    """Invocations/s of a batch submitted at once, and the CPU ms per invocation of each part
    (``cpu_parts``) over the batch. The load comes from ``2 x slots`` (at least 2) separate
    processes with a cheap client, each submitting its share and then awaiting it: not counted,
    and not in the measured processes' way more than it must be."""
    producer = Producer(stack.port, stack.tokens["admin"])
    producer.round_trip()  # warm-up
    procs = max(2, slots * 2)
    shares = [batch // procs + (1 if i < batch % procs else 0) for i in range(procs)]
    before = cpu_parts(stack)
    rate, _total = cp.run_load(_load, [(stack.port, stack.tokens["admin"], n) for n in shares if n])
    after = cpu_parts(stack)
    return rate, {k: (after[k] - before[k]) * 1000 / batch for k in before}


def bare_spawn_cpu_ms(cmd: list[str], n: int = 10) -> float:
    """CPU ms of one bare spawn (its user + system time, reaped by this process)."""
    t0 = os.times()
    for _ in range(n):
        subprocess.run(cmd, check=True, timeout=120)
    t1 = os.times()
    return ((t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)) * 1000 / n


def bare_throughput(bare_cmd: list[str], batch: int, slots: int) -> float:
    with ThreadPoolExecutor(slots) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda _: bare_spawn(bare_cmd), range(batch)))
        return batch / (time.perf_counter() - t0)


def idle(stack: LocalStack, seconds: float) -> tuple[float, float]:
    assert stack.nymph is not None
    proc = psutil.Process(stack.nymph.pid)
    time.sleep(1.0)  # let the last job's threads wind down
    cpu0 = proc.cpu_times()
    t0 = time.monotonic()
    time.sleep(seconds)
    cpu1 = proc.cpu_times()
    elapsed = time.monotonic() - t0
    rss = proc.memory_info().rss / 2**20
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return rss, cpu / elapsed


RUNNER_OPTS: dict[str, object] = {}  # --runner-opt


def task_bytecode() -> None:
    """Write the bytecode of the noop's module (``bench/__pycache__``), so that each task imports it
    as it would on any machine that caches bytecode. Where nothing writes it (``PYTHONDONTWRITEBYTECODE``,
    as on the CI machines, or a read-only tree) every task compiles the module from source: about
    1-2 ms of CPU in a zygote's child here (the compiler's pages are copied on write), neither
    nymph's cost nor a user's usual one, and it would blur what the rows measure."""
    py_compile.compile(str(BENCH / "bench_fns.py"), doraise=True)


def _stack(slots: int, runner: str, image: str, code: Path | None = None) -> LocalStack:
    """The stack; ``code``: a checkout its processes import from instead of this one (--before)."""
    task_bytecode()
    tree = [] if code is None else [code, code / "runners"]
    return LocalStack(
        queues=[QUEUE],
        concurrency=slots,
        runner=runner,
        runner_options={**({"image": image, "pull": "never"} if runner != "process" else {}), **RUNNER_OPTS},
        pythonpath=[BENCH, *tree],
        quiet=True,
        nymph_args=["--log-level", "WARNING"],
    )


PARTS = ("server", "nymph", "zygote+tasks")
GOAL_RATIO = 0.5  # issue 10: CPU per noop invocation on nymph's side (nymph + zygote + task) halved


def bench_runner(runner: str, opts: argparse.Namespace, python: str) -> tuple[float, float]:
    """Print the rows for one runner; return (bare p50, round trip p50) in seconds."""
    bare_cmd = bare_command(runner, python, opts.image)
    slot_counts = [int(s) for s in opts.slots.split(",") if s.strip()]
    trees: list[tuple[str, Path | None]] = [("", None)]
    if opts.before is not None:
        trees = [(" (before)", opts.before), (" (after)", None)]
    label = {"process": "python -c pass", "docker": "docker run", "gvisor": "docker run --runtime=runsc"}
    result = (0.0, 0.0)
    for name, code in trees:
        with _stack(1, runner, opts.image, code) as stack:
            trips, bare = latency(stack, opts.calls, bare_cmd)
            ratio = statistics.median(trips) / statistics.median(bare)
            print(f"\n[{runner}{name}] round trip, 1 slot, N={opts.calls}")
            print(f"  bare  {label[runner]:26}  {_ms(bare)}")
            print(f"  submit -> result (noop)         {_ms(trips)}")
            print(
                f"  ratio p50 round trip / bare: {ratio:.2f}x (overhead {(ratio - 1) * 100:+.0f} %; goal <= 2x)"
            )
            if opts.idle_s > 0:
                rss, cpu = idle(stack, opts.idle_s)
                print(
                    f"  nymph idle over {opts.idle_s:g} s: RSS {rss:.1f} MiB, CPU {cpu * 100:.2f}% of one core"
                )
        result = statistics.median(bare), statistics.median(trips)
    if slot_counts and opts.batch > 0:
        print(f"\n[{runner}] throughput, batch of {opts.batch} noops (goal at 4 slots: >= 150 inv/s)")
        print(
            f"  {'slots':>5} {'nymph inv/s':>12} {'bare/s':>13} {'ratio':>7}   "
            "CPU ms per noop: server / nymph / zygote+tasks = total (bare spawn's CPU)"
        )
        bare_cpu = bare_spawn_cpu_ms(bare_cmd)
        cpus: dict[tuple[int, str], list[dict[str, float]]] = {}
        for slots in slot_counts:
            for _round in range(opts.rounds):  # alternating, so both trees see the same machine
                for name, code in trees:
                    with _stack(slots, runner, opts.image, code) as stack:
                        rate, cpu = throughput_cpu(stack, opts.batch, slots)
                    cpus.setdefault((slots, name), []).append(cpu)
                    floor = bare_throughput(bare_cmd, opts.batch, slots)
                    parts = " / ".join(f"{cpu[k]:.1f}" for k in PARTS)
                    print(
                        f"  {slots:>5} {rate:>12.1f} {floor:>13.1f} {floor / rate:>6.2f}x   "
                        f"{parts} = {sum(cpu.values()):.1f} ({bare_cpu:.1f}){name}"
                    )
        if opts.before is not None:
            _before_after(cpus, slot_counts)
    return result


def _before_after(cpus: dict[tuple[int, str], list[dict[str, float]]], slot_counts: list[int]) -> None:
    """CPU ms per noop invocation, before and after (medians over the rounds), by part."""
    print(
        f"\nCPU ms per noop invocation, before -> after (median of rounds; goal: nymph's side <= {GOAL_RATIO:.2f}x)"
    )
    print(f"  {'slots':>5} {'part':>22} {'before':>8} {'after':>8} {'ratio':>7}")
    for slots in slot_counts:
        med = {
            name: {k: statistics.median(c[k] for c in cpus[(slots, name)]) for k in PARTS}
            for name in (" (before)", " (after)")
        }
        rows = [(k, med[" (before)"][k], med[" (after)"][k]) for k in PARTS]
        side = ("nymph + zygote + task", *(sum(m[k] for k in PARTS[1:]) for m in med.values()))
        total = ("total (server too)", *(sum(m.values()) for m in med.values()))
        for part, before, after in [*rows, side, total]:
            goal = f"  goal <= {GOAL_RATIO:.2f}x" if part == side[0] else ""
            print(f"  {slots:>5} {part:>22} {before:>8.1f} {after:>8.1f} {after / before:>6.2f}x{goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runner", default="process", help="comma-separated: process, docker, gvisor (default process)"
    )
    parser.add_argument("--calls", type=int, default=50, help="sequential round trips (default 50)")
    parser.add_argument("--batch", type=int, default=100, help="noops per throughput batch (0: skip)")
    parser.add_argument("--slots", default="1,2,4", help="comma-separated slot counts (default 1,2,4)")
    parser.add_argument("--idle-s", type=float, default=60.0, help="idle window for RSS/CPU (0: skip)")
    parser.add_argument(
        "--image",
        default=os.environ.get("LAKESHORE_TEST_IMAGE", "lakeshore-python:bookworm"),
        help="image for docker / gvisor (default LAKESHORE_TEST_IMAGE)",
    )
    parser.add_argument("--runner-opt", action="append", default=[], help="KEY=VALUE for every runner")
    parser.add_argument(
        "--before", type=Path, default=None, help="a checkout to compare with, measured in the same run"
    )
    parser.add_argument("--rounds", type=int, default=1, help="throughput rounds per slot count (default 1)")
    opts = parser.parse_args()
    RUNNER_OPTS.update(parse_runner_opts(opts.runner_opt))
    python = default_python()
    runners = [r.strip() for r in opts.runner.split(",") if r.strip()]
    unknown = set(runners) - {"process", "docker", "gvisor"}
    if unknown:
        raise SystemExit(f"--runner: unknown {sorted(unknown)} (process, docker, gvisor)")

    print(f"interpreter: {python}; image: {opts.image}; cores: {psutil.cpu_count()}; options: {RUNNER_OPTS}")
    results = {runner: bench_runner(runner, opts, python) for runner in runners}
    if len(results) > 1:
        print("\nnoop round trip, p50, 1 slot")
        print(f"  {'':24}" + "".join(f"{r:>12}" for r in results))
        print(f"  {'bare floor (ms)':24}" + "".join(f"{b * 1000:>12.1f}" for b, _ in results.values()))
        print(f"  {'submit -> result (ms)':24}" + "".join(f"{t * 1000:>12.1f}" for _, t in results.values()))
        print(
            f"  {'overhead over bare':24}"
            + "".join(f"{(t / b - 1) * 100:>+11.0f}%" for b, t in results.values())
        )


if __name__ == "__main__":
    main()
