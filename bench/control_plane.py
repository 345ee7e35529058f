"""Control-plane throughput and wake latency over loopback HTTP, for SQLite and PostgreSQL.

Measures, with N simulated daemons (threads, one httpx client each):

- baseline: a bare ``GET /healthz`` round trip (what HTTP itself costs here);
- submit/s: producers submitting as fast as they can;
- claim+ack/s: daemons polling (max 1) and acking until the queue is drained; the median of two
  drains (each poll pass is one store transaction, ``store.poll``);
- poll wake latency: a daemon waits in a long poll; the time from the submit's answer to the
  poll's answer (p50, p90).

Run: ``.venv/bin/python bench/control_plane.py [--daemons 8] [--jobs 400] [--pg URL]``
(PostgreSQL also from ``LAKESHORE_TEST_PG_URL``; the database is created and dropped).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
from _stats import percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body


def _client(cp: ControlPlane, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=cp.url,
        timeout=60,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-msgpack"},
    )


def healthz(cp: ControlPlane, n: int = 200) -> list[float]:
    with httpx.Client(base_url=cp.url) as c:
        c.get("/healthz")
        out = []
        for _ in range(n):
            t = time.perf_counter()
            c.get("/healthz")
            out.append(time.perf_counter() - t)
    return out


def submit_rate(cp: ControlPlane, jobs: int, threads: int, queue: str) -> float:
    def work(k: int) -> None:
        with _client(cp, cp.producer_token) as c:
            for _ in range(k):
                r = c.post("/v1/producer/submit", content=msgpack.packb(submit_body(new_ulid(), queue)))
                assert r.status_code == 200, r.content

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, [jobs // threads] * threads))
    return (jobs // threads * threads) / (time.perf_counter() - t)


def claim_ack_rate(cp: ControlPlane, threads: int, queue: str) -> tuple[float, int]:
    def work(_: int) -> int:
        worker, done = new_ulid(), 0
        with _client(cp, cp.daemon_token) as c:
            while True:
                r = c.post(
                    "/v1/daemon/poll",
                    content=msgpack.packb({"worker_id": worker, "queues": [queue], "max": 1, "timeout_s": 0}),
                )
                answer = msgpack.unpackb(r.content)
                if r.status_code != 200:
                    raise RuntimeError(f"poll answered {r.status_code}: {answer}")
                cmds = answer["commands"]
                if not cmds:
                    return done
                for cmd in cmds:
                    ack = {
                        "invocation_id": cmd["body"]["invocation_id"],
                        "state": "succeeded",
                        "result_blob": b"\xc0",
                        "error": None,
                        "worker_id": worker,
                        "attempt": cmd["body"]["attempt"],
                    }
                    assert c.post("/v1/daemon/ack", content=msgpack.packb(ack)).status_code == 200
                    done += 1

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(work, range(threads)))
    return total / (time.perf_counter() - t), total


def wake_latency(cp: ControlPlane, rounds: int, idle_pollers: int) -> list[float]:
    """Latency from a submit's answer to the waiting poll's answer, with other pollers idling."""
    stop = threading.Event()

    def idle(_: int) -> None:  # pollers on another queue: load on the server, never woken
        worker = new_ulid()
        with _client(cp, cp.daemon_token) as c:
            while not stop.is_set():
                c.post(
                    "/v1/daemon/poll",
                    content=msgpack.packb({"worker_id": worker, "queues": ["idle"], "timeout_s": 1}),
                )

    pool = ThreadPoolExecutor(max(1, idle_pollers))
    for i in range(idle_pollers):
        pool.submit(idle, i)
    out: list[float] = []
    try:
        with _client(cp, cp.daemon_token) as d, _client(cp, cp.producer_token) as p:
            worker = new_ulid()
            for _ in range(rounds):
                got: dict[str, float] = {}

                def wait(got: dict[str, float] = got) -> None:
                    r = d.post(
                        "/v1/daemon/poll",
                        content=msgpack.packb({"worker_id": worker, "queues": ["wake"], "timeout_s": 10}),
                    )
                    got["t"] = time.perf_counter()
                    assert msgpack.unpackb(r.content)["commands"]

                t = threading.Thread(target=wait)
                t.start()
                time.sleep(0.05)  # the poll is waiting by now
                p.post("/v1/producer/submit", content=msgpack.packb(submit_body(new_ulid(), "wake")))
                submitted = time.perf_counter()
                t.join()
                out.append(got["t"] - submitted)
    finally:
        stop.set()
        pool.shutdown(wait=True)
    return out


@contextlib.contextmanager
def _pg(url: str | None) -> Iterator[str | None]:
    if not url:
        yield None
        return
    os.environ["LAKESHORE_TEST_PG_URL"] = url
    from tests.contract.conftest import pg_database

    with pg_database() as db:
        yield db


def run(label: str, store_url: str, daemons: int, jobs: int, rounds: int) -> list[str]:
    rates: list[float] = []
    with running_control_plane(store_url) as cp:
        base = healthz(cp)
        submits: list[float] = []
        for _ in range(2):
            submits.append(submit_rate(cp, jobs, daemons, "bench"))
            rate, total = claim_ack_rate(cp, daemons, "bench")
            assert total == jobs // daemons * daemons
            rates.append(rate)
        wake = wake_latency(cp, rounds, daemons - 1)
    ms = 1000.0
    return [
        f"{label:<11} {percentile(base, 0.5) * ms:>8.2f} {percentile(base, 0.9) * ms:>8.2f}"
        f" {statistics.median(submits):>10.0f} {statistics.median(rates):>12.0f}"
        f" {percentile(wake, 0.5) * ms:>9.2f} {percentile(wake, 0.9) * ms:>9.2f}   (wake mean {statistics.mean(wake) * ms:.2f})"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemons", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=40, help="wake-latency samples")
    ap.add_argument("--pg", default=os.environ.get("LAKESHORE_TEST_PG_URL"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += run("sqlite", str(Path(tmp) / "bench.db"), args.daemons, args.jobs, args.rounds)
    with _pg(args.pg) as pg:
        if pg:
            rows += run("postgresql", pg, args.daemons, args.jobs, args.rounds)
    print(f"control plane, loopback, {args.daemons} daemons, {args.jobs} jobs")
    print(
        f"{'store':<11} {'hz p50ms':>8} {'hz p90ms':>8} {'submit/s':>10} {'claim+ack/s':>12}"
        f" {'wake p50':>9} {'wake p90':>9}"
    )
    for row in rows:
        print(row)
    if not args.pg:
        print("(PostgreSQL skipped: pass --pg URL or set LAKESHORE_TEST_PG_URL)")


if __name__ == "__main__":
    main()
