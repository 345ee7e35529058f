"""The warm path for short calls: round trip and throughput of a noop through ``lakeshore worker``,
beside the same run's raw HTTP round trip.

The stack is real processes on loopback: ``lakeshore server`` over a SQLite file and either
``lakeshore worker start --queue warm --prefetch N`` (the SDK's long-lived worker) or ``nymph start
--warm --queue warm --concurrency S`` (nymph's process runner in warm mode, docs/nymph.md "Warm
mode"; its cold prefork path is ``bench/dispatch.py``'s), each against a server of its own. The load comes from separate processes
with a cheap client (``control_plane.Client``: a raw socket, one keep-alive connection each, msgpack bodies, envelopes
built before the clock starts). Each call is a ref noop (``bench/bench_fns.py``).

Rows, each beside its goal (<= 3 ms p50, >= 500/s) and the same run's baseline:

- ``hello``: one POST to a Starlette hello-world on the same HTTP stack (uvicorn, uvloop when
  installed, h11): the floor of one request; a warm call is at least two (the producer's and the
  worker's), so ``x hello`` is printed beside each round trip;
- ``submit + await``: two requests per call (``/v1/producer/submit``, then ``/v1/producer/await``);
- ``submit?wait``: one request per call (``/v1/producer/submit`` with ``wait_s``: submit and await
  in one request);
- ``calls/s``: ``--producers`` processes calling at once (closed loop, ``submit?wait``), one worker.
- ``SDK f.call()`` (``lakeshore worker`` only): what a user's call takes, from a process of its own
  through the SDK (``dls.udf(queue="warm")`` on the same noop: its Envelope, code record, client);
- ``nymph cold prefork``: the same nymph without ``--warm`` (a zygote forks each call), the
  reference the warm mode is measured against;
- ``where it goes``: for the sequential ``submit?wait`` calls, the p50 of each part of the round
  trip, from the producer's clock and the store's ``submitted_at``, ``started_at`` (the claim) and
  ``finished_at`` (the ack).

Also printed: the CPU ms per call of the server and of the worker (psutil; for nymph, nymph
itself and its warm workers apart).

Run: ``python bench/warm.py [--calls 300] [--producers 8] [--per-producer 150] [--prefetch 8]
[--nymph-slots 4] [--only worker|nymph] [--profile]`` (``--profile``: the server's stack samples
under the worker rows, ``bench/_sampler.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _sampler
from _stats import median_p90

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from control_plane import (  # noqa: E402
    HELLO,
    Client,
    _process,
    cpu_seconds,
    free_port,
    has,
    hello_parser,
    lakeshore_server,
)

QUEUE = "warm"
GOAL_P50_MS = 3.0
GOAL_RATE = 500.0


def _envelopes(n: int) -> list[tuple[str, bytes]]:
    """``n`` noop envelopes (id, bytes), built before the clock starts."""
    import bench_fns

    from dreamlake.lakeshore.envelope import Envelope, fn_for

    out = []
    for _ in range(n):
        env = Envelope.create(fn_for(bench_fns.noop, "ref"), (), {})
        out.append((env.id, env.to_bytes()))
    return out


def _body(inv: str, blob: bytes, wait_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "invocation_id": inv,
        "queue": QUEUE,
        "function": {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"},
        "args_blob": blob,
        "run_config": {"queue": QUEUE, "priority": 0.0, "key": None},
        "code_context": {},
    }
    if wait_s is not None:
        body["wait_s"] = wait_s
    return body


def _check(answer: Any, inv: str) -> None:
    if not isinstance(answer, dict) or answer.get("state") != "succeeded":
        raise RuntimeError(f"noop {inv} answered {answer!r}")


def call(c: Client, inv: str, blob: bytes, one_request: bool) -> None:
    """One noop call, submit-and-wait in one request, or submit then await (also when the server
    predates ``wait_s`` and answers no ``outcome``: a tree compared with ``--tree``)."""
    status, answer = c.post("/v1/producer/submit", _body(inv, blob, 60.0 if one_request else None))
    if status != 200:
        raise RuntimeError(f"submit answered {status}: {answer}")
    if one_request and "outcome" in answer:
        _check(answer["outcome"], inv)
        return
    status, answer = c.post("/v1/producer/await", {"invocation_id": inv, "timeout_s": 60})
    if status != 200:
        raise RuntimeError(f"await answered {status}: {answer}")
    _check(answer, inv)


def _latency(port: int, token: str, n: int, one_request: bool, go: Any, out: Any) -> None:
    c = Client(port, token)
    calls = _envelopes(n + 20)
    go.wait()
    for inv, blob in calls[:20]:  # warm-up: connections, imports, the worker's module cache
        call(c, inv, blob, one_request)
    times, stamps = [], []
    for inv, blob in calls[20:]:
        w0, t0 = time.time(), time.perf_counter()
        call(c, inv, blob, one_request)
        times.append(time.perf_counter() - t0)
        stamps.append((inv, w0, time.time()))
    out.put((times, stamps))


def _sdk_latency(port: int, token: str, n: int, go: Any, out: Any) -> None:
    """What a user's ``f.call()`` takes: the SDK's own client, Envelope, code record and all."""
    os.environ["LAKESHORE_URL"] = f"http://127.0.0.1:{port}"
    os.environ["LAKESHORE_TOKEN"] = token
    import bench_fns

    import dreamlake.lakeshore as dls

    f = dls.udf(queue=QUEUE)(bench_fns.noop)
    go.wait()
    for _ in range(20):  # warm-up, as _latency's
        f.call()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f.call()
        times.append(time.perf_counter() - t0)
    out.put((times, []))


def _closed_loop(port: int, token: str, n: int, go: Any, out: Any) -> None:
    c = Client(port, token)
    calls = _envelopes(n)
    go.wait()
    t0 = time.perf_counter()
    for inv, blob in calls:
        call(c, inv, blob, True)
    out.put((t0, time.perf_counter(), n))


def _hello(port: int, n: int, go: Any, out: Any) -> None:
    c = Client(port, None)
    go.wait()
    for _ in range(20):
        c.post("/", {"x": 1})
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.post("/", {"x": 1})
        times.append(time.perf_counter() - t0)
    out.put(times)


def in_processes(target: Any, arglists: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``target(*args, go, out)`` in one process per arglist, started together; their outputs."""
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, go, out)) for a in arglists]
    for p in procs:
        p.start()
    time.sleep(0.3)
    go.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"a load process failed (exit {p.exitcode})")
    return results


def rate(results: list[tuple[float, float, int]]) -> float:
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    return sum(r[2] for r in results) / (end - start)


def hello_round_trip(n: int) -> list[float]:
    port = free_port()
    code = HELLO.format(uvloop=has("uvloop"), http=hello_parser())
    with _process([sys.executable, "-c", code, str(port)], port):
        (times,) = in_processes(_hello, [(port, n)])
    return list(times)


TREE = ROOT  # the code under test (``bench/hotpaths.py --tree`` points it at another checkout)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH), str(TREE), str(TREE / "runners"), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


@contextlib.contextmanager
def lakeshore_worker(port: int, token: str, prefetch: int) -> Iterator[int]:
    cmd = [sys.executable, "-m", "dreamlake.lakeshore.cli", "--log-level", "warning", "worker", "start"]
    cmd += ["--server", f"http://127.0.0.1:{port}", "--token", token, "--queue", QUEUE]
    # ``worker start --help`` (not ``worker --help``, the group's, which lists no options): a tree
    # from before the warm path has no --prefetch
    helped = subprocess.run([*cmd, "--help"], env=_env(), capture_output=True, text=True, cwd="/")
    if "--prefetch" in helped.stdout:
        cmd += ["--prefetch", str(prefetch)]
    elif prefetch != 1:
        print(
            f"note: this tree's `lakeshore worker start` has no --prefetch: it runs 1, not {prefetch}",
            file=sys.stderr,
        )
    proc = subprocess.Popen(cmd, env=_env(), start_new_session=True, cwd="/")
    try:
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def nymph_warm(
    port: int, admin: str, data_dir: Path, base: Path, slots: int, warm: bool = True
) -> Iterator[int]:
    """``nymph start --warm`` on the bench queue (``warm`` False: its default, cold prefork path);
    yields its pid."""
    import json

    daemon = json.loads((data_dir / "tokens.json").read_text())["daemon"]
    cmd = [sys.executable, "-m", "nymph", "start", "--server", f"http://127.0.0.1:{port}", "--queue", QUEUE]
    cmd += ["--workdir", str(base / "work"), "--state-dir", str(base / "state")]
    cmd += ["--warm"] if warm else []
    cmd += ["--concurrency", str(slots), "--log-level", "WARNING"]
    if os.geteuid() == 0:  # the bench's tasks run as whoever runs it (root in a CI container)
        cmd += ["--allow-root-tasks"]
    env = {**_env(), "NYMPH_TOKEN": daemon}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, cwd="/")
    try:
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _split_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid`` itself and of its live children with what they reaped
    (nymph; its warm workers, or its zygotes with the tasks they forked)."""
    import psutil

    proc = psutil.Process(pid)
    own = proc.cpu_times()
    kids = 0.0
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = child.cpu_times()
            kids += t.user + t.system + t.children_user + t.children_system
    return own.user + own.system, kids


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


class Row:
    def __init__(
        self,
        name: str,
        times: list[float] | None,
        per_s: float | None,
        hello_p50: float,
        parts: dict[str, float] | None = None,
    ) -> None:
        self.name, self.times, self.per_s, self.hello = name, times, per_s, hello_p50
        self.parts = parts or {}

    def line(self) -> str:
        if self.times:
            p50, p90 = median_p90(self.times)
            lat = f"{ms(p50):>8} {ms(p90):>8} {GOAL_P50_MS:>6.1f} {p50 / self.hello:>7.1f}x"
        else:
            lat = f"{'':>8} {'':>8} {'':>6} {'':>8}"
        rate_s = f"{self.per_s:>9,.0f} {GOAL_RATE:>6,.0f}" if self.per_s else f"{'':>9} {'':>6}"
        line = f"{self.name:<46} {lat} {rate_s}"
        if self.parts:
            line += "\n    where it goes (p50 ms): " + ", ".join(
                f"{k} {ms(v)}" for k, v in self.parts.items()
            )
        return line


def measure(
    port: int, token: str, args: argparse.Namespace, hello_p50: float, label: str, db: Path
) -> list[Row]:
    rows = []
    ((two, _),) = in_processes(_latency, [(port, token, args.calls, False)])
    rows.append(Row(f"{label}: submit + await", two, None, hello_p50))
    ((one, stamps),) = in_processes(_latency, [(port, token, args.calls, True)])
    per = args.per_producer
    got = in_processes(_closed_loop, [(port, token, per)] * args.producers)
    rows.append(Row(f"{label}: submit?wait", one, rate(got), hello_p50, split(db, stamps)))
    return rows


SPLIT = ("producer -> submitted", "submitted -> claimed", "claimed -> acked", "acked -> producer")


STAMPS = "SELECT invocation_id, submitted_at, started_at, finished_at FROM invocations"


def split(db: Path, stamps: list[tuple[str, float, float]], query: str = STAMPS) -> dict[str, float]:
    """Where a sequential call's time goes (p50 of each part, seconds), from the producer's wall
    clock and the invocation's ``submitted_at`` / ``started_at`` (the claim) / ``finished_at``
    (the ack) in the store (``query``: those four columns of each call): the same clock, one host."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        known = {r[0]: r[1:] for r in con.execute(query)}
    finally:
        con.close()
    parts: dict[str, list[float]] = {name: [] for name in SPLIT}
    for inv, t0, t1 in stamps:
        row = known.get(inv)
        if row is None or None in row:
            continue
        points = (t0, *row, t1)
        for name, a, b in zip(SPLIT, points, points[1:], strict=False):
            parts[name].append(b - a)
    return {name: median_p90(v)[0] for name, v in parts.items() if v}


def warm_rows(args: argparse.Namespace) -> tuple[list[float], list[Row], dict[str, float]]:
    """The hello baseline and the rows of each warm path; and the CPU ms per call of each part."""
    hello = hello_round_trip(args.calls)
    hello_p50 = median_p90(hello)[0]
    rows: list[Row] = []
    cpu: dict[str, float] = {}
    calls = 2 * args.calls + 40 + args.producers * args.per_producer
    only = getattr(args, "only", "worker")  # bench/hotpaths.py asks for the worker's rows alone
    profile = Path(tempfile.mkdtemp()) / "server-samples.json" if getattr(args, "profile", False) else None
    if only in (None, "worker"):
        with (
            tempfile.TemporaryDirectory() as tmp,
            lakeshore_server(str(Path(tmp) / "warm.db"), Path(tmp) / "sq", 1, profile) as (port, token, pid),
            lakeshore_worker(port, token, args.prefetch) as wpid,
        ):
            s0, w0 = cpu_seconds(pid), cpu_seconds(wpid)
            label = f"lakeshore worker (prefetch {args.prefetch})"
            rows += measure(port, token, args, hello_p50, label, Path(tmp) / "warm.db")
            cpu["server (worker rows)"] = (cpu_seconds(pid) - s0) * 1000 / calls
            cpu["lakeshore worker"] = (cpu_seconds(wpid) - w0) * 1000 / calls
            # what a user's f.call() takes through the same worker (after the CPU figures: they
            # are the cheap client's)
            ((user, _),) = in_processes(_sdk_latency, [(port, token, args.calls)])
            rows.append(Row(f"{label}: SDK f.call()", user, None, hello_p50))
        if profile is not None:  # written by the sampler as the server stopped
            print(f"profile: lakeshore server under the worker rows ({calls} calls)")
            _sampler.report(str(profile), skip=("threading.py", "thread.py", "runpy", "_sampler"))
    for warm in (True, False) if only in (None, "nymph") else ():
        if not warm and getattr(args, "no_cold", False):
            continue
        with (
            tempfile.TemporaryDirectory() as tmp,
            lakeshore_server(str(Path(tmp) / "warm.db"), Path(tmp) / "sq", 1) as (port, token, pid),
            nymph_warm(port, token, Path(tmp) / "sq", Path(tmp), args.nymph_slots, warm) as npid,
        ):
            s0, (n0, k0) = cpu_seconds(pid), _split_cpu(npid)
            mode = "--warm" if warm else "cold prefork"
            label = f"nymph {mode} ({args.nymph_slots} slots)"
            rows += measure(port, token, args, hello_p50, label, Path(tmp) / "warm.db")
            n1, k1 = _split_cpu(npid)
            cpu[f"server (nymph {mode})"] = (cpu_seconds(pid) - s0) * 1000 / calls
            cpu[f"nymph {mode}"] = (n1 - n0) * 1000 / calls
            cpu["warm workers" if warm else "zygote+tasks"] = (k1 - k0) * 1000 / calls
    return hello, rows, cpu


HEADER = f"{'path':<46} {'p50 ms':>8} {'p90 ms':>8} {'goal':>6} {'x hello':>8} {'calls/s':>9} {'goal':>6}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="sequential calls per latency row")
    ap.add_argument("--producers", type=int, default=8, help="processes calling at once (calls/s)")
    ap.add_argument("--per-producer", type=int, default=150, help="calls of each of those")
    ap.add_argument("--prefetch", type=int, default=8, help="lakeshore worker --prefetch")
    ap.add_argument("--nymph-slots", type=int, default=4, help="nymph --warm --concurrency")
    ap.add_argument("--only", choices=["worker", "nymph"], help="measure one warm path only")
    ap.add_argument("--no-cold", action="store_true", help="leave out nymph's cold (prefork) rows")
    ap.add_argument("--profile", action="store_true", help="sample the server under the worker rows")
    args = ap.parse_args()
    hello, rows, cpu = warm_rows(args)
    h50, h90 = median_p90(hello)
    print(
        f"warm path, noop, loopback, SQLite file; {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}; {args.calls} sequential calls per row, {args.producers} producers "
        f"x {args.per_producer} for calls/s"
    )
    print(f"baseline: Starlette hello-world on the same stack, one POST: p50 {ms(h50)} ms, p90 {ms(h90)} ms")
    print(HEADER)
    for row in rows:
        print(row.line())
    print("CPU ms per call: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))


if __name__ == "__main__":
    main()
