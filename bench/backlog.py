"""Claim cost against the backlog: one claim transaction at 1,000, 100,000 and 1,000,000 queued.

The goal (issue 10, "claims stay flat"): a claim costs at most 1.5x its cost at 1,000 queued
invocations, at any backlog and with many queues and priorities. Each figure is printed beside the
same run's figure at the smallest size (the baseline) and that goal.

Layouts:

- ``1 queue``: every row in one queue at one priority (the old plan sorted all of them per claim).
- ``100 queues x 10 pri``: rows spread over 100 queues and 10 priorities; claims from one queue,
  from four (the merge of each queue's first rows) and from forty (past the 32 heads one
  statement merges: each group's merge, then the best taken by key).
- ``mixed shapes`` (placement, issue 29): one queue, 10 priorities, rows spread over 60 shapes (10
  resource shapes: 0 to 9 GPUs, times no selector or one of 5: ``pool=a`` .. ``pool=e``), named
  in the ``shapes`` table as submits would; claims from pollers of 3 kinds: one offering nothing
  (the plain head only), one offering 4 GPUs (5 heads) and one offering 8 GPUs and ``pool=a`` (18
  heads: the placed claim's pick, then its take by key).

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
    .venv/bin/python bench/backlog.py --layouts "mixed shapes"   # the placement case only
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

import sqlalchemy as sa
from _stats import median_p90

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests.contract.conftest (the scratch PostgreSQL database)

from dreamlake.lakeshore.store import open_store, schema  # noqa: E402
from dreamlake.lakeshore.store.placement import NO_OFFER, Needs, Offer  # noqa: E402
from dreamlake.lakeshore.store.sql import SqlStore  # noqa: E402

PG_ENV = "LAKESHORE_TEST_PG_URL"
GOAL = 1.5  # times the figure at the smallest size
WARMUP = 3  # claims per store and pattern not counted (the first compile the statement)
FULL_SIZES = (1_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000)
COLUMNS = [c.name for c in schema.invocations.c]


def _default(column: Any) -> Any:
    """What a row the bench does not fill in holds in a column a later migration added: its server
    default ('0', '') or NULL."""
    server = column.server_default
    if server is None:
        return None
    text = str(server.arg.text if hasattr(server.arg, "text") else server.arg).strip("'")
    return int(text) if isinstance(column.type, sa.Integer) and text.lstrip("-").isdigit() else text


DEFAULTS = {c.name: _default(c) for c in schema.invocations.c}
FUNCTION = json.dumps({"module": "bench.jobs", "qualname": "work", "kind": "function"})
# placement's mixed case: 10 resource shapes (0-9 GPUs) x (no selector or one of 5)
SHAPE_NEEDS = [
    Needs(gpus=g, selector=sel) for g in range(10) for sel in [(), *((("pool", p),) for p in "abcde")]
]
SHAPE_KEYS = [n.key() for n in SHAPE_NEEDS]
Pattern = tuple[str, list[str], Offer]  # what the row says, the queues claimed from, the offer
# layout -> (queue count, priority count, shaped rows?, the claims timed)
LAYOUTS: dict[str, tuple[int, int, bool, list[Pattern]]] = {
    "1 queue": (1, 1, False, [("1 queue(s)", ["q000"], NO_OFFER)]),
    "100 queues x 10 pri": (
        100,
        10,
        False,
        [
            ("1 queue(s)", ["q007"], NO_OFFER),
            ("4 queue(s)", ["q007", "q031", "q058", "q090"], NO_OFFER),
            # past MERGED_QUEUES_MAX heads: picked in groups (store/claims.py, head_groups)
            ("40 queue(s)", [f"q{i:03d}" for i in range(0, 80, 2)], NO_OFFER),
        ],
    ),
    "mixed shapes": (
        1,
        10,
        True,
        [
            ("no offer", ["q000"], NO_OFFER),
            ("4 GPUs", ["q000"], Offer.of(4)),
            ("8 GPUs pool=a", ["q000"], Offer.of(8, {"pool": "a"})),
        ],
    ),
}


def rows(
    start: int, count: int, queues: int, priorities: int, shaped: bool = False
) -> Iterator[tuple[Any, ...]]:
    """``count`` queued invocations rows (every column of ``invocations``, in order) from id
    ``start``; ``shaped``: each of one of ``SHAPE_NEEDS`` (its run_config says so)."""
    rnd = random.Random(start)
    base = 1_700_000_000.0
    for i in range(start, start + count):
        queue = f"q{rnd.randrange(queues):03d}"
        k = rnd.randrange(len(SHAPE_NEEDS)) if shaped else -1
        needs = SHAPE_NEEDS[k] if shaped else Needs()
        run_config: dict[str, Any] = {"queue": queue}
        if needs.gpus:
            run_config["resources"] = {"gpus": needs.gpus}
        if needs.selector:
            run_config["selector"] = dict(needs.selector)
        values = {
            "invocation_id": f"bl-{i:09d}",
            "queue": queue,
            "state": "queued",
            "priority": rnd.randrange(priorities),
            "function_key": "bench",
            "function": FUNCTION,
            "args_blob": b"x" * 64,
            "run_config": json.dumps(run_config),
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
            "shape": SHAPE_KEYS[k] if shaped else "",  # '': the plain shape (needs nothing)
        }
        yield tuple(values[c] if c in values else DEFAULTS[c] for c in COLUMNS)


def bulk_queue(store: SqlStore, count: int, queues: int, priorities: int, shaped: bool = False) -> None:
    """Insert ``count`` queued rows on the store's own connection, in one transaction (and, for
    ``shaped`` rows, their shapes in the ``shapes`` table, as their submits would)."""
    data = rows(0, count, queues, priorities, shaped)
    with store.db.tx(write=True) as conn:
        if shaped:
            conn.execute(
                schema.shapes.insert(),
                [
                    {"queue": f"q{q:03d}", "shape": key, "needs": n.as_json(), "created_at": 0.0}
                    for q in range(queues)
                    for key, n in zip(SHAPE_KEYS, SHAPE_NEEDS, strict=True)
                    if key
                ],
            )
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


def claim_once(store: SqlStore, queues: list[str], offer: Offer = NO_OFFER) -> tuple[float, float]:
    """Seconds for one claim transaction, and for the requeue that undoes it (the floor)."""
    t0 = time.perf_counter()
    (got,) = store.claim("bench-worker", queues, limit=1, offer=offer)
    t1 = time.perf_counter()
    requeue(store, got.invocation_id)
    return t1 - t0, time.perf_counter() - t1


Row = tuple[str, str, int, float, float, float]  # layout, claims from, queued, median, p90, floor


def bench_backend(
    databases: Callable[[], contextlib.AbstractContextManager[str]],
    sizes: list[int],
    reps: int,
    layouts: list[str],
) -> list[Row]:
    """Every layout, claim pattern and size; the sizes' stores are all open at once and take turns
    claim by claim, so a burst of load elsewhere on the machine touches every size alike."""
    out: list[Row] = []
    for layout in layouts:
        queues, priorities, shaped, patterns = LAYOUTS[layout]
        with contextlib.ExitStack() as stack:
            stores: dict[int, SqlStore] = {}
            for size in sizes:
                store = open_store(stack.enter_context(databases()))
                stack.callback(store.close)
                t0 = time.perf_counter()
                bulk_queue(store, size, queues, priorities, shaped)
                print(
                    f"  ({layout}: {size:,} rows queued in {time.perf_counter() - t0:.1f} s)", file=sys.stderr
                )
                stores[size] = store
            claims: dict[tuple[int, int], list[float]] = {}
            floors: dict[int, list[float]] = {}
            for rep in range(WARMUP + reps):
                for size, store in stores.items():
                    for n, (_, claimed_from, offer) in enumerate(patterns):
                        took, floor = claim_once(store, claimed_from, offer)
                        if rep >= WARMUP:
                            claims.setdefault((size, n), []).append(took)
                            floors.setdefault(size, []).append(floor)
            for n, (label, _, _) in enumerate(patterns):
                for size in sizes:
                    med, p90 = median_p90(claims[size, n])
                    out.append((layout, label, size, med, p90, median_p90(floors[size])[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 30 claims each")
    ap.add_argument("--sizes", help="comma-separated queued counts (the first is the baseline)")
    ap.add_argument("--reps", type=int, help="timed claims per size (default 200, 30 with --quick)")
    ap.add_argument("--backends", default="sqlite-file,postgresql")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    args = ap.parse_args()
    layouts = [x.strip() for x in args.layouts.split(",")]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layout {unknown[0]!r}: use one of {', '.join(LAYOUTS)}")
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
            results += [(backend, r) for r in bench_backend(databases, sizes, reps, layouts)]
    print(f"claim transaction (limit=1), {reps} claims per row; goal: <= {GOAL}x the {sizes[0]:,} figure;")
    print("floor: a one-row UPDATE by primary key in its own transaction, same store, same run")
    head = (
        f"{'backend':<14} {'layout':<20} {'claims from':<14} {'queued':>10} {'median µs':>10} {'p90 µs':>8}"
    )
    print(f"{head} {'vs base':>8}  {'goal':<8} {'floor µs':>8}")
    base: dict[tuple[str, str, str], float] = {}
    for backend, (layout, pattern, size, med, p90, floor) in results:
        ref = base.setdefault((backend, layout, pattern), med)
        ratio = med / ref
        verdict = "baseline" if size == sizes[0] else ("met" if ratio <= GOAL else "MISSED")
        print(
            f"{backend:<14} {layout:<20} {pattern:<14} {size:>10,} {med * 1e6:>10.0f} {p90 * 1e6:>8.0f}"
            f" {ratio:>7.2f}x  {verdict:<8} {floor * 1e6:>8.0f}"
        )


if __name__ == "__main__":
    main()
