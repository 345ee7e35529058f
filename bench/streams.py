"""Generator streams: frames/s and yield-to-consumer latency, on the local plane and over HTTP.

A generator job yields N small values ({"i", "t"}: ``t`` is ``perf_counter()`` at the yield) while a
consumer follows ``q.stream(inv)`` live in the same process, so the latency of each frame is the
consumer's ``perf_counter()`` at arrival minus ``t``. The worker runs in a thread (``run_worker``, pickles allowed: this script is ``__main__``).
Over HTTP the control plane is served by uvicorn on a loopback port over a SQLite file, and the
worker appends every frame with ``POST /v1/daemon/result-chunk``.

Printed beside the cost of a bare msgpack pack+unpack of the same value, measured in the same run,
which is the floor any frame pays.

    .venv/bin/python bench/streams.py            # 2000 frames per plane
    .venv/bin/python bench/streams.py --frames 300
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
from _stats import percentile

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch, Plane


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=2000)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
