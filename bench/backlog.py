"""Claim cost against the backlog: one claim transaction at 1,000, 100,000 and 1,000,000 queued.

The goal (issue 10, "claims stay flat"): a claim costs at most 1.5x its cost at 1,000 queued
invocations, at any backlog and with many queues and priorities. Each figure is printed beside the
same run's figure at the smallest size (the baseline) and that goal.

Layouts:

- ``1 queue``: every row in one queue at one priority (the old plan sorted all of them per claim).
- ``100 queues x 10 pri``: rows spread over 100 queues and 10 priorities; claims from one queue
  and from four (the merge of each queue's first rows).

Each size of a layout is its own store (a scratch database on PostgreSQL), all open at once; the
timed claims take turns across the sizes, so a burst of other load on the machine touches every
size alike. Rows are bulk-inserted straight into ``invocations`` (``executemany`` on SQLite,
``COPY`` on PostgreSQL, then ``VACUUM ANALYZE`` as autovacuum would, and a ``CHECKPOINT``), not
submitted one by one. A timed claim takes one invocation (``store.claim(..., limit=1)``: its own
write transaction); the claimed row is then put back to queued by a one-row UPDATE by primary key in
its own transaction, so every claim runs against exactly its backlog. That UPDATE is timed too and
printed as the floor: what any write transaction on that store costs in the same run.

Backends: ``sqlite-file`` and ``postgresql`` (when ``LAKESHORE_TEST_PG_URL`` is set: a scratch
database is created and dropped); ``sqlite-memory`` on request.

    .venv/bin/python bench/backlog.py                      # 1e3, 1e5, 1e6 queued; 200 claims each
    .venv/bin/python bench/backlog.py --quick               # 1e3, 1e4; 30 claims
    .venv/bin/python bench/backlog.py --sizes 1000,30000 --backends sqlite-file
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _stats import median_p90

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests.contract.conftest (the scratch PostgreSQL database)

from dreamlake.lakeshore.store import open_store, schema  # noqa: E402
from dreamlake.lakeshore.store.sql import SqlStore  # noqa: E402

PG_ENV = "LAKESHORE_TEST_PG_URL"
GOAL = 1.5  # times the figure at the smallest size
WARMUP = 3  # claims per store and pattern not counted (the first compile the statement)
FULL_SIZES = (1_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000)
COLUMNS = [c.name for c in schema.invocations.c]
FUNCTION = json.dumps({"module": "bench.jobs", "qualname": "work", "kind": "function"})
# layout -> (queue count, priority count, the queue lists claims are timed on)
LAYOUTS: dict[str, tuple[int, int, list[list[str]]]] = {
    "1 queue": (1, 1, [["q000"]]),
    "100 queues x 10 pri": (100, 10, [["q007"], ["q007", "q031", "q058", "q090"]]),
}


def rows(start: int, count: int, queues: int, priorities: int) -> Iterator[tuple[Any, ...]]:
    """``count`` queued invocations rows (every column of ``invocations``, in order) from id ``start``."""
    rnd = random.Random(start)
    base = 1_700_000_000.0
    for i in range(start, start + count):
        queue = f"q{rnd.randrange(queues):03d}"
        values = {
            "invocation_id": f"bl-{i:09d}",
            "queue": queue,
            "state": "queued",
            "priority": rnd.randrange(priorities),
            "function_key": "bench",
            "function": FUNCTION,
            "args_blob": b"x" * 64,
            "run_config": json.dumps({"queue": queue}),
            "code_context": "{}",
            "namespace": "default",
            "content_hash": f"h{i}",
            "attempt": 0,
            "max_attempts": 3,
            "parent_invocation_id": None,
            "root_invocation_id": None,
            "idempotency_key": None,
            "worker_id": None,
            "submitted_at": base + i * 1e-3,
            "started_at": None,
            "finished_at": None,
            "lease_expires_at": None,
            "result_blob": None,
            "error": None,
            "cancel_requested": False,
            "args_ref": None,
            "result_ref": None,
            "not_before": None,  # due: a retry waiting for its backoff is not in the claim index
            "frames_attempt": None,
            "frames_base": None,
            "shape": "",  # the plain shape: needs no GPUs, selector or concurrency key
        }
        yield tuple(values[c] for c in COLUMNS)


def bulk_queue(store: SqlStore, count: int, queues: int, priorities: int) -> None:
    """Insert ``count`` queued rows on the store's own connection, in one transaction."""
    data = rows(0, count, queues, priorities)
    with store.db.tx(write=True) as conn:
        raw: Any = conn.connection.driver_connection
        if store.kind == "postgresql":
            with raw.cursor().copy(f"COPY invocations ({', '.join(COLUMNS)}) FROM STDIN") as copy:
                for row in data:
                    copy.write_row(row)
        else:
            marks = ", ".join("?" * len(COLUMNS))
            raw.executemany(f"INSERT INTO invocations ({', '.join(COLUMNS)}) VALUES ({marks})", data)
    if store.kind == "postgresql":  # what autovacuum would do next; then flush, so no load lingers
        with store.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE invocations")
            conn.exec_driver_sql("CHECKPOINT")


def requeue(store: SqlStore, invocation_id: str) -> None:
    """Put a claimed row back: a one-row UPDATE by primary key in its own write transaction."""
    pg = store.kind == "postgresql"
    with store.db.tx(write=True) as conn:
        conn.exec_driver_sql(
            "UPDATE invocations SET state = 'queued', worker_id = NULL, attempt = 0, started_at = NULL,"
            " lease_expires_at = NULL WHERE invocation_id = " + ("%(id)s" if pg else "?"),
            {"id": invocation_id} if pg else (invocation_id,),
        )


def claim_once(store: SqlStore, queues: list[str]) -> tuple[float, float]:
    """Seconds for one claim transaction, and for the requeue that undoes it (the floor)."""
    t0 = time.perf_counter()
    (got,) = store.claim("bench-worker", queues, limit=1)
    t1 = time.perf_counter()
    requeue(store, got.invocation_id)
    return t1 - t0, time.perf_counter() - t1


Row = tuple[str, str, int, float, float, float]  # layout, claims from, queued, median, p90, floor


def bench_backend(
    databases: Callable[[], contextlib.AbstractContextManager[str]], sizes: list[int], reps: int
) -> list[Row]:
    """Every layout, claim pattern and size; the sizes' stores are all open at once and take turns
    claim by claim, so a burst of load elsewhere on the machine touches every size alike."""
    out: list[Row] = []
    for layout, (queues, priorities, patterns) in LAYOUTS.items():
        with contextlib.ExitStack() as stack:
            stores: dict[int, SqlStore] = {}
            for size in sizes:
                store = open_store(stack.enter_context(databases()))
                stack.callback(store.close)
                t0 = time.perf_counter()
                bulk_queue(store, size, queues, priorities)
                print(
                    f"  ({layout}: {size:,} rows queued in {time.perf_counter() - t0:.1f} s)", file=sys.stderr
                )
                stores[size] = store
            claims: dict[tuple[int, int], list[float]] = {}
            floors: dict[int, list[float]] = {}
            for rep in range(WARMUP + reps):
                for size, store in stores.items():
                    for n, pattern in enumerate(patterns):
                        took, floor = claim_once(store, pattern)
                        if rep >= WARMUP:
                            claims.setdefault((size, n), []).append(took)
                            floors.setdefault(size, []).append(floor)
            for n, pattern in enumerate(patterns):
                for size in sizes:
                    med, p90 = median_p90(claims[size, n])
                    out.append(
                        (layout, f"{len(pattern)} queue(s)", size, med, p90, median_p90(floors[size])[0])
                    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 30 claims each")
    ap.add_argument("--sizes", help="comma-separated queued counts (the first is the baseline)")
    ap.add_argument("--reps", type=int, help="timed claims per size (default 200, 30 with --quick)")
    ap.add_argument("--backends", default="sqlite-file,postgresql")
    args = ap.parse_args()
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else list(QUICK_SIZES if args.quick else FULL_SIZES)
    )
    reps = args.reps or (30 if args.quick else 200)
    results: list[tuple[str, Row]] = []
    with tempfile.TemporaryDirectory() as tmp:
        files = (str(Path(tmp) / f"backlog-{n}.db") for n in itertools.count())
        for backend in args.backends.split(","):
            databases: Callable[[], contextlib.AbstractContextManager[str]]
            if backend == "sqlite-file":
                databases = lambda: contextlib.nullcontext(next(files))  # noqa: E731
            elif backend == "sqlite-memory":
                databases = lambda: contextlib.nullcontext(":memory:")  # noqa: E731
            elif backend == "postgresql":
                if not os.environ.get(PG_ENV):
                    print(f"postgresql: skipped (set {PG_ENV})")
                    continue
                from tests.contract.conftest import pg_database  # scratch databases, dropped after

                databases = pg_database
            else:
                raise SystemExit(f"unknown backend {backend!r}")
            results += [(backend, r) for r in bench_backend(databases, sizes, reps)]
    print(f"claim transaction (limit=1), {reps} claims per row; goal: <= {GOAL}x the {sizes[0]:,} figure;")
    print("floor: a one-row UPDATE by primary key in its own transaction, same store, same run")
    head = (
        f"{'backend':<14} {'layout':<20} {'claims from':<12} {'queued':>10} {'median µs':>10} {'p90 µs':>8}"
    )
    print(f"{head} {'vs base':>8}  {'goal':<8} {'floor µs':>8}")
    base: dict[tuple[str, str, str], float] = {}
    for backend, (layout, pattern, size, med, p90, floor) in results:
        ref = base.setdefault((backend, layout, pattern), med)
        ratio = med / ref
        verdict = "baseline" if size == sizes[0] else ("met" if ratio <= GOAL else "MISSED")
        print(
            f"{backend:<14} {layout:<20} {pattern:<12} {size:>10,} {med * 1e6:>10.0f} {p90 * 1e6:>8.0f}"
            f" {ratio:>7.2f}x  {verdict:<8} {floor * 1e6:>8.0f}"
        )


if __name__ == "__main__":
    main()
