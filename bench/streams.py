"""Generator streams: frames/s and yield-to-consumer latency, on the local plane, over HTTP and
through nymph.

In-process planes: a generator job yields N small values ({"i", "t"}: ``t`` is ``perf_counter()``
at the yield) while a consumer follows ``q.stream(inv)`` live in the same process, so the latency
of each frame is the consumer's ``perf_counter()`` at arrival minus ``t``. The worker runs in a
thread (``run_worker``, pickles allowed: this script is ``__main__``) and writes frames in batches
(``dispatch/batching.py``). Over HTTP the control plane is served by uvicorn on a loopback port
over a SQLite file.

nymph: ``LocalStack`` (``lakeshore server`` and ``nymph start`` with the process runner, real
processes on loopback); ``bench_fns.ticks`` (``t`` is the wall clock, the processes differ) is
followed live over HTTP by this process. Rows: frames/s and per-frame latency for
``--nymph-frames`` values; the first frame's latency (yield to consumer) over ``--first-runs``
invocations (p50 / p90); and 200 values of 1 MiB (``--blobs``). Two-way (``bench_fns.echo_back``, a
generator that uses its yields, ``--two-way`` round trips): the send -> next-yield round trip,
``s.send(i)`` until the value it returned arrived (p50 / p90; goal: p50 <= 2x the first frame's p50
of the same run), and the sustained two-way rate (round trips per second). For the two long generators:
nymph's peak RSS and the peak size of its outbox directory (sampled every 50 ms), and nymph's own
peak of undelivered stream bytes (``nymph_stream_undelivered_bytes_peak``, when it has it).

Printed beside the cost of a bare msgpack pack+unpack of the same value, measured in the same run,
which is the floor any frame pays, and beside the goals (>= 20,000 frames/s, first frame <= 5 ms).

    .venv/bin/python bench/streams.py                       # 2000 frames per plane, nymph too
    .venv/bin/python bench/streams.py --frames 300 --no-nymph
    .venv/bin/python bench/streams.py --nymph-frames 100000 --blobs 200
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import psutil
from _stats import percentile

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.devstack import LocalStack, free_port
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch, Plane
from dreamlake.lakeshore.envelope import Envelope, fn_for

BENCH = Path(__file__).resolve().parent
MiB = 1024 * 1024
GOAL_FPS = 20_000
GOAL_FIRST_MS = 5.0


@dls.udf(queue="bench")
def ticks(n: int):
    for i in range(n):
        yield {"i": i, "t": time.perf_counter()}


def bare_msgpack_us(reps: int = 20_000) -> float:
    value = {"i": 1, "t": time.perf_counter()}
    t0 = time.perf_counter()
    for _ in range(reps):
        msgpack.unpackb(msgpack.packb(value))
    return (time.perf_counter() - t0) / reps * 1e6


def run_stream(plane: Plane, n: int) -> dict[str, float]:
    q = dls.SyncQueue("bench", dispatch=plane)
    inv = ticks.submit(n, _dispatch=plane)
    stop = threading.Event()
    worker = threading.Thread(
        target=dls.run_worker,
        args=(q,),
        kwargs={"stop": stop, "poll_timeout": 0.5, "allow_pickled": True},
        daemon=True,
    )
    lat: list[float] = []
    t_first = t_last = 0.0
    worker.start()
    try:
        for v in q.stream(inv, timeout=30.0):
            now = time.perf_counter()
            lat.append(now - v["t"])
            if v["i"] == 0:
                t_first = now
            t_last = now
    finally:
        stop.set()
        worker.join(timeout=30)
    assert len(lat) == n, f"lost frames: {len(lat)} of {n}"
    return {
        "fps": (n - 1) / (t_last - t_first) if t_last > t_first else float("nan"),
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p90_ms": percentile(lat, 0.9) * 1e3,
    }


@contextlib.contextmanager
def control_plane(path: Path) -> Iterator[tuple[str, str]]:
    """A control plane on a free loopback port; yields (url, admin token)."""
    import uvicorn

    from dreamlake.lakeshore.server.app import create_app
    from dreamlake.lakeshore.store import open_store

    store = open_store(path)
    token = store.create_token("admin", "bench")
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when proto says TCP;
    # without it every response waits out Nagle + delayed ACK (~40 ms per request on Linux).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(store), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", token
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        store.close()


class Sampler:
    """Peak RSS of nymph's process and peak bytes of its outbox directory, every 50 ms."""

    def __init__(self, pid: int, outbox: Path) -> None:
        self.proc = psutil.Process(pid)
        self.outbox = outbox
        self.rss = self.proc.memory_info().rss
        self.outbox_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(psutil.Error):
                self.rss = max(self.rss, self.proc.memory_info().rss)
            size = 0
            with contextlib.suppress(OSError), os.scandir(self.outbox) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        size += entry.stat().st_size
            self.outbox_bytes = max(self.outbox_bytes, size)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _metric(port: int, name: str) -> float | None:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _follow(plane: HttpDispatch, fn: Any, *args: Any) -> list[tuple[float, Any]]:
    """Submit ``fn(*args)`` to the stack and follow its stream: ``(arrival wall time, value)``."""
    import bench_fns  # noqa: F401 - the entry imports it by reference

    envelope = Envelope.create(fn_for(fn, "ref"), args, {})
    inv = plane.submit(envelope, "bench", {})
    out: list[tuple[float, Any]] = []
    for frame in plane.frames(inv, timeout=120):
        now = time.time()
        if frame.kind == wire.FRAME_VALUE:
            out.append((now, wire.unpack(frame.body)))  # type: ignore[arg-type]
        elif frame.kind == wire.FRAME_ERROR:
            raise RuntimeError(f"the stream failed: {frame.body!r:.300}")
    return out


def _two_way(plane: HttpDispatch, rounds: int, first_p50_ms: float) -> str:
    """``rounds`` send -> next-yield round trips into ``bench_fns.echo_back`` (module docstring)."""
    import bench_fns

    envelope = Envelope.create(fn_for(bench_fns.echo_back, "ref"), (rounds + 1,), {})
    inv = plane.submit(envelope, "bench", {"two_way": True})
    s = dls.SyncQueue("bench", dispatch=plane).stream(inv, timeout=60)
    next(s)
    for i in range(5):  # warm: the relay and the entry's wait are running
        s.send(i)
    trips = []
    start = time.perf_counter()
    for i in range(rounds - 5):
        t0 = time.perf_counter()
        assert s.send(i) == i
        trips.append((time.perf_counter() - t0) * 1e3)
    span = time.perf_counter() - start
    s.close()
    p50 = percentile(trips, 0.5)
    return (
        f"p50 {p50:.2f} ms  p90 {percentile(trips, 0.9):.2f} ms  ({p50 / first_p50_ms:.1f}x the first frame; "
        f"goal <= 2x)  sustained {len(trips) / span:.0f} round trips/s"
    )


def nymph_rows(frames: int, blobs: int, first_runs: int, two_way: int = 200) -> list[tuple[str, str]]:
    """The nymph rows (see the module docstring), as (label, figures) pairs."""
    import bench_fns

    port = free_port()
    rows: list[tuple[str, str]] = []
    with LocalStack(
        queues=["bench"],
        concurrency=1,
        pythonpath=[BENCH],
        nymph_args=["--metrics-port", str(port)],
        quiet=True,
    ) as stack:
        plane = stack.plane()
        assert stack.nymph is not None
        _follow(plane, bench_fns.ticks, 1)  # warm: the first spawn, imports
        firsts = []
        for _ in range(first_runs):
            got = _follow(plane, bench_fns.ticks, 1)
            firsts.append((got[0][0] - got[0][1]["t"]) * 1e3)
        rows.append(
            (
                f"first frame ({first_runs} runs)",
                f"p50 {percentile(firsts, 0.5):.2f} ms  p90 {percentile(firsts, 0.9):.2f} ms  (goal <= {GOAL_FIRST_MS:g} ms p50)",
            )
        )
        rows.append(("two-way send -> yield", _two_way(plane, two_way, percentile(firsts, 0.5))))
        outbox = stack.dir / "state" / "outbox"
        for label, fn, args, size in (
            (f"{frames} small values", bench_fns.ticks, (frames,), 0),
            (f"{blobs} values of 1 MiB", bench_fns.blobs, (blobs, MiB), MiB),
        ):
            sampler = Sampler(stack.nymph.pid, outbox)
            start = time.time()
            got = _follow(plane, fn, *args)
            sampler.stop()
            assert len(got) == args[0], f"lost frames: {len(got)} of {args[0]}"
            if size:
                span = got[-1][0] - start
                speed = f"{len(got) / span:.0f} frames/s  {len(got) * size / MiB / span:.0f} MiB/s"
            else:
                lat = [(at - v["t"]) * 1e3 for at, v in got]
                fps = (len(got) - 1) / (got[-1][0] - got[0][0])
                speed = f"{fps:.0f} frames/s (goal >= {GOAL_FPS})  latency p50 {percentile(lat, 0.5):.1f} ms"
            undelivered = _metric(port, "nymph_stream_undelivered_bytes_peak")
            extra = "n/a" if undelivered is None else f"{undelivered / MiB:.1f} MiB"
            rows.append(
                (
                    label,
                    f"{speed}  peak rss {sampler.rss / MiB:.0f} MiB  peak outbox {sampler.outbox_bytes / MiB:.2f} MiB  "
                    f"peak undelivered {extra}",
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--nymph-frames", type=int, default=20_000)
    parser.add_argument("--blobs", type=int, default=200)
    parser.add_argument("--first-runs", type=int, default=20)
    parser.add_argument("--two-way", type=int, default=200, help="send -> yield round trips through nymph")
    parser.add_argument("--no-nymph", action="store_true", help="only the in-process planes")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH))
    rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        local = Dispatch(":memory:")
        rows.append(("local :memory:", run_stream(local, args.frames)))
        local.close()
        local_file = Dispatch(Path(tmp) / "local.db")
        rows.append(("local sqlite file", run_stream(local_file, args.frames)))
        local_file.close()
        with control_plane(Path(tmp) / "server.db") as (url, token):
            http = HttpDispatch(url, token)
            rows.append(("http (live follower)", run_stream(http, args.frames)))
            http.close()
    floor = bare_msgpack_us()
    print(f"{args.frames} small frames per plane; bare msgpack pack+unpack: {floor:.2f} us/frame")
    print(f"{'plane':<22} {'frames/s':>10} {'p50 ms':>9} {'p90 ms':>9} {'us/frame':>10} {'x msgpack':>10}")
    for name, r in rows:
        per = 1e6 / r["fps"]
        print(
            f"{name:<22} {r['fps']:>10.0f} {r['p50_ms']:>9.2f} {r['p90_ms']:>9.2f} {per:>10.0f} {per / floor:>10.0f}"
        )
    if not args.no_nymph:
        print(f"\nnymph (process runner) -> live consumer over HTTP (goal >= {GOAL_FPS} frames/s):")
        for label, figures in nymph_rows(args.nymph_frames, args.blobs, args.first_runs, args.two_way):
            print(f"  {label:<24} {figures}")


if __name__ == "__main__":
    main()
