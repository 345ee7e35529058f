"""Store hot paths: per-operation median / p90 (µs) on each backend.

Operations: ``submit``, ``claim+ack`` (one claim of one invocation, then its ack), ``append_frame``,
``read_frames(100)``, ``get``, ``heartbeat`` (one running invocation), ``topic_post`` and
``open_store`` of an already-migrated store (a new ``SqlStore`` on the same URL, closed again; and
in a new interpreter, imports included).
Backends: ``sqlite-file``, ``sqlite-memory`` and ``postgresql`` (when ``LAKESHORE_TEST_PG_URL`` is
set; a scratch database is created and dropped).

Printed beside a raw ``sqlite3`` INSERT of a similar invocation row (one transaction, WAL,
synchronous=NORMAL) measured in the same run: the floor an SQLite write pays.

    .venv/bin/python bench/store.py             # 300 reps per operation
    .venv/bin/python bench/store.py --reps 100 --backends sqlite-file
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _stats import median_p90

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests.contract.conftest (the scratch PostgreSQL database)

from dreamlake.lakeshore.store import open_store  # noqa: E402
from dreamlake.lakeshore.store.api import SubmitRequest  # noqa: E402

PG_ENV = "LAKESHORE_TEST_PG_URL"
FUNCTION = {"module": "bench.jobs", "qualname": "work", "kind": "function"}


def timed(fn: Callable[[int], object], reps: int) -> list[float]:
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def raw_sqlite_insert(path: Path, reps: int) -> list[float]:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(
        "CREATE TABLE inv (id TEXT PRIMARY KEY, queue TEXT, state TEXT, priority INTEGER,"
        " function TEXT, args BLOB, run_config TEXT, submitted_at REAL)"
    )
    fn = json.dumps(FUNCTION)

    def one(i: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO inv VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (f"raw-{i}", "bench", "queued", 0, fn, b"x" * 64, '{"queue": "bench"}', time.time()),
        )
        conn.execute("COMMIT")

    try:
        return timed(one, reps)
    finally:
        conn.close()


def req(i: int, tag: str) -> SubmitRequest:
    return SubmitRequest(
        invocation_id=f"{tag}-{i:06d}",
        queue="bench",
        function=FUNCTION,
        args_blob=b"x" * 64,
        run_config={"queue": "bench", "priority": 0},
    )


def bench_backend(url: str, reps: int, opens: int) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {}
    store = open_store(url)
    try:
        res["submit"] = timed(lambda i: store.submit(req(i, "s")), reps)

        def claim_ack(_i: int) -> None:
            (inv,) = store.claim("w1", ["bench"], limit=1)
            store.ack(
                inv.invocation_id,
                "succeeded",
                attempt=inv.attempt,
                worker_id="w1",
                result_blob=b"r",
                error=None,
            )

        res["claim+ack"] = timed(claim_ack, reps)
        store.submit(req(0, "hb"))
        (hb,) = store.claim("w2", ["bench"], limit=1)
        store.register_worker("w2", {})
        res["heartbeat"] = timed(lambda _i: store.heartbeat("w2", [(hb.invocation_id, hb.attempt)]), reps)
        res["get"] = timed(lambda i: store.get(f"s-{i:06d}"), reps)
        owner = "s-000000"
        payload = b"f" * 48
        res["append_frame"] = timed(lambda i: store.append_frame(owner, i, payload, False, attempt=1), reps)
        for i in range(reps, reps + 200):
            store.append_frame(owner, i, payload, False)
        res["read_frames(100)"] = timed(lambda i: store.read_frames(owner, since=i % 100, limit=100), reps)
        res["topic_post"] = timed(lambda _i: store.topic_post("bench", b"v" * 32), reps)
    finally:
        store.close()

    def reopen(_i: int) -> None:
        open_store(url).close()

    if url != ":memory:":
        res["open_store"] = timed(reopen, opens)
        res["open_store (new process)"] = timed(lambda _i: cold_open(url), max(3, opens // 3))
    return res


def cold_open(url: str) -> None:
    """A fresh interpreter that imports the store and opens ``url`` (what a CLI start pays)."""
    code = "import sys; from dreamlake.lakeshore.store import open_store; open_store(sys.argv[1]).close()"
    subprocess.run([sys.executable, "-c", code, url], check=True, cwd=Path(__file__).resolve().parent.parent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--opens", type=int, default=15)
    ap.add_argument("--backends", default="sqlite-file,sqlite-memory,postgresql")
    args = ap.parse_args()
    wanted = args.backends.split(",")
    rows: list[tuple[str, str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        med, p90 = (x * 1e6 for x in median_p90(raw_sqlite_insert(Path(tmp) / "raw.db", args.reps)))
        rows.append(("raw sqlite3", "INSERT (baseline)", med, p90))
        for backend in wanted:
            if backend == "sqlite-file":
                ctx: contextlib.AbstractContextManager[str] = contextlib.nullcontext(
                    str(Path(tmp) / "store.db")
                )
            elif backend == "sqlite-memory":
                ctx = contextlib.nullcontext(":memory:")
            elif backend == "postgresql":
                base = os.environ.get(PG_ENV)
                if not base:
                    print(f"postgresql: skipped (set {PG_ENV})")
                    continue
                from tests.contract.conftest import pg_database  # a scratch database, dropped after

                ctx = pg_database()
            else:
                raise SystemExit(f"unknown backend {backend!r}")
            with ctx as url:
                for op, samples in bench_backend(url, args.reps, args.opens).items():
                    rows.append((backend, op, *(x * 1e6 for x in median_p90(samples))))
    print(f"{'backend':<14} {'operation':<26} {'median µs':>10} {'p90 µs':>10}")
    for backend, op, med, p90 in rows:
        print(f"{backend:<14} {op:<26} {med:>10.0f} {p90:>10.0f}")


if __name__ == "__main__":
    main()
