"""The group-commit writer's own CPU per write: ``store.write_batch`` in process, no HTTP.

What the control plane's writer thread spends per submit, per ack and per poll pass (claim), on
SQLite (a file) and PostgreSQL, in batches of 1 (an idle server) and 8 (a loaded one), measured
as this thread's CPU time (``time.thread_time``), so a loaded machine slows it less than it slows
wall-clock figures. Beside it the same run's raw-store baseline: the same row inserted with the
driver alone (``sqlite3`` / ``psycopg``, prepared, one transaction per batch).

Then the warm call's two transactions on SQLite (``bench/warm.py``'s ``submit?wait``): a submit
with the waiting poll's pass it was handed (the insert and the claim, one transaction), then the
ack. Three rows, CPU per call: the store's ``write_batch``; the same statements on the store's own
``invocations`` table with ``sqlite3`` alone (a whole row inserted, claimed by id with ``RETURNING
*``, acked by a conditional ``UPDATE``); and ``bench/floor.py``'s table and statements. The first
less the second is the store's Python per warm call; the second less the third, the row's columns
and indexes.

Run: ``python bench/writer.py [--pg URL] [--n 2000]`` (PostgreSQL also from
``LAKESHORE_TEST_PG_URL``). ``PYTHONPATH=OTHER_CHECKOUT python bench/writer.py`` measures another
checkout's store with the same code (a before and after on one machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

FN = {"module": "bench_fns", "qualname": "noop", "version": "v1"}


@dataclass
class WriterFigures:
    submit_us: dict[int, float]  # batch size -> writer CPU µs per submit
    claim_us: dict[int, float]  # batch size -> per claimed invocation (poll pass of that limit)
    ack_us: dict[int, float]  # batch size -> per ack
    raw_us: dict[int, float]  # batch size -> the driver alone, per inserted row


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure(url: str, n: int, sizes: tuple[int, ...] = (1, 8)) -> WriterFigures:
    from dreamlake.lakeshore.ids import new_ulid
    from dreamlake.lakeshore.store import open_store
    from dreamlake.lakeshore.store.api import AckRequest, PollRequest, SubmitRequest

    store = open_store(url)
    figs = WriterFigures({}, {}, {}, {})
    try:
        for size in sizes:
            queue = f"w{size}-{new_ulid()[-6:]}"
            ids: list[str] = []
            per_sub: list[float] = []
            for _ in range(max(1, n // size)):
                reqs = [SubmitRequest(new_ulid(), queue, FN, b"x" * 64, {}) for _ in range(size)]
                t = time.thread_time()
                out = store.write_batch(reqs)
                per_sub.append((time.thread_time() - t) / size)
                ids += [r.invocation_id for r in out]  # type: ignore[union-attr]
            claimed: list[tuple[str, int]] = []
            per_claim: list[float] = []
            while len(claimed) < len(ids):
                t = time.thread_time()
                (got,) = store.write_batch([PollRequest("bench-w", [queue], limit=size, exec_jobs=False)])
                invs = got.invocations  # type: ignore[union-attr]
                if not invs:
                    break
                per_claim.append((time.thread_time() - t) / len(invs))
                claimed += [(i.invocation_id, i.attempt) for i in invs]
            per_ack: list[float] = []
            for k in range(0, len(claimed), size):
                reqs2 = [
                    AckRequest(i, "succeeded", a, "bench-w", b"r" * 32) for i, a in claimed[k : k + size]
                ]
                t = time.thread_time()
                store.write_batch(reqs2)
                per_ack.append((time.thread_time() - t) / len(reqs2))
            figs.submit_us[size] = _median(per_sub) * 1e6
            figs.claim_us[size] = _median(per_claim) * 1e6
            figs.ack_us[size] = _median(per_ack) * 1e6
            figs.raw_us[size] = _raw(store, n, size) * 1e6
    finally:
        store.close()
    return figs


def _raw(store: Any, n: int, size: int) -> float:
    """The driver alone: one prepared insert per row of a 3-column scratch table, ``size`` rows
    per transaction; this thread's CPU per row."""
    db = store.db
    raw = db.engine.raw_connection()
    try:
        drv = raw.driver_connection
        pg = db.dialect == "postgresql"
        cur = drv.cursor()
        if pg:
            cur.execute("CREATE TEMP TABLE IF NOT EXISTS bench_raw (id text primary key, q text, b bytea)")
            drv.commit()
            sql = "INSERT INTO bench_raw VALUES (%s, %s, %s) ON CONFLICT DO NOTHING"
        else:
            cur.execute("CREATE TEMP TABLE IF NOT EXISTS bench_raw (id text primary key, q text, b blob)")
            sql = "INSERT INTO bench_raw VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
        per: list[float] = []
        k = 0
        for _ in range(max(1, n // size)):
            rows = [(f"r{k + j}-{size}", "q", b"x" * 64) for j in range(size)]
            k += size
            t = time.thread_time()
            if not pg:
                cur.execute("BEGIN IMMEDIATE")
            for row in rows:
                cur.execute(sql, row)
            if pg:
                drv.commit()
            else:
                cur.execute("COMMIT")
            per.append((time.thread_time() - t) / size)
        return _median(per)
    finally:
        raw.close()


WARM_ARGS = b"\x93\x90\x80\xc0" * 40  # an Envelope's size of a noop call


def _timed_cycles(n: int, cycle: Any) -> float:
    """This thread's CPU per ``cycle()``, the median of ``n`` after 200 untimed."""
    for _ in range(200):
        cycle()
    per: list[float] = []
    for _ in range(n):
        t = time.thread_time()
        cycle()
        per.append(time.thread_time() - t)
    return _median(per)


def warm_cycle(path: Path, n: int) -> tuple[float, float, float]:
    """CPU per warm call's two transactions on SQLite (module docstring): the store's, the same
    statements raw on its table, the floor's."""
    import sqlite3

    from dreamlake.lakeshore.ids import new_ulid
    from dreamlake.lakeshore.store import open_store
    from dreamlake.lakeshore.store.api import AckRequest, PollRequest, SubmitRequest

    store = open_store(f"sqlite:///{path / 'store.db'}")
    try:
        run_config = {"queue": "warm", "priority": 0.0, "key": None}

        def store_cycle() -> None:
            inv = new_ulid()
            poll = PollRequest("bench-w", ["warm"], 8, exec_jobs=False, duties=False, handed=(inv,))
            out = store.write_batch([SubmitRequest(inv, "warm", FN, WARM_ARGS, run_config), poll])
            (claimed,) = out[1].invocations  # type: ignore[union-attr]
            (acked,) = store.write_batch([AckRequest(inv, "succeeded", claimed.attempt, "bench-w", b"\xc0")])
            assert acked.ok, acked  # type: ignore[union-attr]

        store_us = _timed_cycles(n, store_cycle) * 1e6
    finally:
        store.close()

    db = sqlite3.connect(path / "store.db", isolation_level=None)
    for pragma in ("journal_mode = WAL", "synchronous = NORMAL", "wal_autocheckpoint = 16384"):
        db.execute(f"PRAGMA {pragma}")
    cols = [r[1] for r in db.execute("PRAGMA table_info(invocations)")]
    insert = (
        f"INSERT INTO invocations ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
        "ON CONFLICT DO NOTHING RETURNING invocation_id"
    )
    claim = (
        "UPDATE invocations SET state = 'running', worker_id = ?, started_at = ?, lease_expires_at = ?, "
        "attempt = attempt + 1 WHERE invocation_id = ? RETURNING *"
    )
    ack = (
        "UPDATE invocations SET state = 'succeeded', finished_at = ?, lease_expires_at = NULL, "
        "result_blob = ? WHERE invocation_id = ? AND worker_id = ? AND state = 'running' AND attempt = ?"
    )
    fn, rc = json.dumps(FN), json.dumps(run_config)

    def raw_cycle() -> None:
        inv, now = new_ulid(), time.time()
        row = dict.fromkeys(cols)
        row.update(
            invocation_id=inv, queue="warm", state="queued", priority=0, function_key="k" * 64, function=fn,
            args_blob=WARM_ARGS, run_config=rc, code_context="{}", namespace="default", content_hash="h" * 64,
            attempt=0, max_attempts=1, submitted_at=now, cancel_requested=0, shape="", preemptions=0,
            handbacks=0,
        )  # fmt: skip
        db.execute("BEGIN IMMEDIATE")
        db.execute(insert, [row[c] for c in cols]).fetchall()
        db.execute(claim, ("bench-w", now, now + 30.0, inv)).fetchall()
        db.execute("COMMIT")
        db.execute("BEGIN IMMEDIATE")
        if db.execute(ack, (time.time(), b"\xc0", inv, "bench-w", 1)).rowcount != 1:
            raise AssertionError("the raw ack updated no row")
        db.execute("COMMIT")

    try:
        raw_us = _timed_cycles(n, raw_cycle) * 1e6
    finally:
        db.close()

    import floor

    bare = floor.Floor(str(path / "floor.db"))

    def floor_cycle() -> None:
        inv, now = new_ulid(), time.time()
        bare.db.execute("BEGIN IMMEDIATE")
        bare.db.execute(
            "INSERT INTO calls (id, queue, state, args, submitted) VALUES (?, ?, 'queued', ?, ?)",
            (inv, floor.QUEUE, WARM_ARGS, now),
        )
        bare.db.execute(floor.CLAIM_ONE, ("bench-w", now, now + floor.LEASE_S, inv))
        bare.db.execute("COMMIT")
        bare.db.execute("BEGIN IMMEDIATE")
        bare.db.execute(floor.ACK, (b"\xc0", now, inv, "bench-w"))
        bare.db.execute(floor.CLAIM_OLDEST, ("bench-w", now, now + floor.LEASE_S, floor.QUEUE)).fetchone()
        bare.db.execute("COMMIT")

    try:
        floor_us = _timed_cycles(n, floor_cycle) * 1e6
    finally:
        bare.db.close()
    return store_us, raw_us, floor_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg", default=os.environ.get("LAKESHORE_TEST_PG_URL"))
    ap.add_argument("--n", type=int, default=2000, help="writes per figure")
    args = ap.parse_args()
    import dreamlake.lakeshore

    print(
        f"store writer CPU per write (µs, this thread), code of {Path(dreamlake.lakeshore.__file__).parents[2]}"
    )
    print(f"{'store':<11} {'batch':>5} {'submit':>7} {'claim':>7} {'ack':>7} {'raw insert':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        urls = [("sqlite", str(Path(tmp) / "w.db"))]
        if args.pg:
            import control_plane as cp

            ctx = cp.pg_database(args.pg)
            urls.append(("postgresql", ctx.__enter__()))
        for kind, url in urls:
            f = measure(url, args.n)
            for size in sorted(f.submit_us):
                print(
                    f"{kind:<11} {size:>5} {f.submit_us[size]:>7.0f} {f.claim_us[size]:>7.0f}"
                    f" {f.ack_us[size]:>7.0f} {f.raw_us[size]:>10.0f}"
                )
        if args.pg:
            ctx.__exit__(None, None, None)
        store_us, raw_us, floor_us = warm_cycle(Path(tmp), args.n)
    print(
        "\nwarm call's two transactions on SQLite (submit with the waiting poll's claim, then the ack), "
        "CPU µs per call"
    )
    print(f"{'store.write_batch':<44} {store_us:>7.0f}  (its Python: {store_us - raw_us:.0f})")
    print(
        f"{'the same statements, sqlite3 alone, its table':<44} {raw_us:>7.0f}  (the row: {raw_us - floor_us:.0f})"
    )
    print(f"{'bench/floor.py table and statements':<44} {floor_us:>7.0f}")


if __name__ == "__main__":
    main()
