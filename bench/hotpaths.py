"""Every row of issue 34's table (the one-call-at-a-time hot paths) in one paired run: each figure
beside its goal and the same run's hello-world and raw-store baselines, with small sizes so the
whole run takes a few minutes.

Issue 34's goals are printed beside each row; the ones stated against a peer (Ray's warm p50,
Ray's first frame, RQ's fork worker) take the peer's figure from ``bench/peers.py`` in the same
run when Ray / Celery / RQ are installed, else the row says so and shows the issue's figure. The
server CPU per operation (``cpu ms``, psutil) is printed with each control-plane row: it is what
limits a loaded machine, and what a busy one measures more steadily than rates. ``--workers 1,2``
repeats the control-plane rows with ``lakeshore server --workers N``.

``writer`` rows (``bench/writer.py``): the group-commit writer's own CPU per submit, claim and ack
(``store.write_batch`` in process, this thread's CPU), beside the driver alone inserting a row.

It runs the other benches' own functions, so the figures mean what they mean there:

- submits/s and claim+ack/s, SQLite and PostgreSQL (``control_plane.py``: ``lakeshore server`` in
  a subprocess, load from separate processes with ``control_plane.Client``, a raw socket), each two ways: one submit per
  request and a sweep's ``--batch`` per ``POST /v1/producer/submit-batch`` (``UDF.map``; per
  call); a busy nymph's claim path (``max`` slots, each ack on the poll that refills its slot)
  and ``lakeshore worker``'s
  (``--prefetch``, the acks riding on the next poll); baselines: a Starlette hello-world on the
  same HTTP stack, raw ``sqlite3`` / ``psycopg`` inserts (100 per transaction); under the
  single-submits rows, the floors of a durable submit under the same load (``floor.py``: a bare
  ASGI app with no product code over raw ``sqlite3``, on a small table with a commit per submit,
  with lakeshore's own row, table and indexes in group commits, and that after the checks every
  submit must make (token, bounds, ids, the run_config's limits, JSON, content hash); over
  ``psycopg`` with that row, for PostgreSQL);
- frames/s nymph -> live consumer over HTTP and the first frame's latency (``streams.py``'s
  stack: ``lakeshore server`` + ``nymph start --runner process``); baseline: a bare msgpack
  pack+unpack per frame;
- frames/s on the local plane, ``:memory:`` and a SQLite file (``streams.run_stream``);
- the warm path (``warm.py``: ``lakeshore worker --prefetch``, producers in separate processes,
  submit with ``wait_s``): round trip p50 and calls/s; baseline: one hello-world POST; beside it
  the same design's floor in Python (``floor.py``: a bare ASGI app over raw ``sqlite3``, the same
  HTTP stack, messages and two durable commits per call, none of the product's checks);
- nymph's prefork noop round trip (``dispatch.py``): p50 and its ratio to a bare ``python -c
  pass``, and invocations/s at 4 slots beside 4 bare spawns in parallel.

``--profile`` adds where the server's time goes under submit load: ``lakeshore server`` runs under
``bench/_sampler.py`` (stack samples of every thread, waits dropped) while the producers of
``control_plane.py`` submit, and the heaviest functions are printed per thread kind.

Run: ``python bench/hotpaths.py [--pg URL] [--workers 1,2] [--profile] [--tree CHECKOUT]`` (``--tree``: measure
another checkout's code with these benches, e.g. the main branch for a before and after) (PostgreSQL also from
``LAKESHORE_TEST_PG_URL``; skipped without one). The machine's load average is printed with the
table: figures from a loaded machine are lower bounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def _tree() -> Path:
    """``--tree PATH``: the checkout whose code is measured (default this one), read before
    anything imports ``dreamlake``: it goes first on ``sys.path`` and on the children's
    ``PYTHONPATH``, so a run with ``--tree`` of the main checkout and one without are a before
    and after of the same benches on the same machine."""
    if "--tree" in sys.argv:
        return Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
    return ROOT


TREE = _tree()
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(TREE / "runners"))
sys.path.insert(0, str(TREE))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TREE), str(TREE / "runners"), *filter(None, [os.environ.get("PYTHONPATH")])]
)
import _sampler  # noqa: E402
import control_plane as cp  # noqa: E402
import peers  # noqa: E402
import writer  # noqa: E402
from _stats import median_p90  # noqa: E402

import dreamlake.lakeshore  # noqa: E402, F401 - pinned to TREE before a bench inserts its own root
import nymph  # noqa: E402, F401
import nymph_process  # noqa: E402, F401


@dataclass
class Row:
    figure: str
    value: str
    goal: str
    baseline: str


def _rate(x: float) -> str:
    return f"{x:,.0f}"


# issue 34's goals, per store
GOAL_SUBMIT = {"sqlite": 2000, "postgresql": 1500}  # and >= 0.5x the same run's hello-world
GOAL_NYMPH = {"sqlite": 1500, "postgresql": 1000}
GOAL_WORKER = {"sqlite": 3000, "postgresql": 2000}
GOAL_BATCH = {"sqlite": 10000, "postgresql": 5000}
# the peers' figures in issue 34 (2 cores), used when bench/peers.py cannot run them here
ISSUE_RAY_P50_MS = 4.1
ISSUE_RAY_FIRST_MS = 2.9
ISSUE_RQ_FORK = 50.6
PEERS = peers.PeerFigures()  # filled by the "peers" step when it runs


def _peer(value: float | None, issue: float, unit: str) -> str:
    """A peer's figure of this run, else issue 34's (said so)."""
    if value is not None:
        return f"{value:,.1f} {unit} (this run)"
    return f"{issue:,.1f} {unit} (issue 34's; peer not run here)"


def control_plane_rows(args: argparse.Namespace, tmp: Path) -> list[Row]:
    hello, hello_cpu = cp.hello_rate(args.producers, max(200, args.jobs // args.producers))
    import floor  # the same load on the floor of a durable submit (a bare ASGI app over raw sqlite3)

    per = max(200, args.jobs // args.producers)
    low, low_cpu = floor.floor_submit_rate(args.producers, per)
    row_low, row_cpu = floor.floor_submit_rate(args.producers, per, "row")
    checked_low, checked_cpu = floor.floor_submit_rate(args.producers, per, "checked")
    floors = {
        "sqlite": [
            ("bare ASGI + sqlite3, a small table, 1 commit each", low, low_cpu),
            ("bare ASGI + sqlite3, lakeshore's row and table, group commit", row_low, row_cpu),
            ("the same + the checks every submit must make", checked_low, checked_cpu),
        ]
    }
    if args.pg:
        pg_low, pg_cpu = floor.floor_submit_rate(args.producers, per, "row", args.pg)
        floors["postgresql"] = [
            ("bare ASGI + psycopg, lakeshore's row and table, group commit", pg_low, pg_cpu)
        ]
    rows = []
    raw_sq = cp.raw_sqlite(tmp / "raw.db", 3000, 100)
    raws = {"sqlite": raw_sq}
    stores = ["sqlite"]
    if args.pg:
        with cp.pg_database(args.pg) as pg:
            raws["postgresql"] = cp.raw_psycopg(pg, 3000, 100)
        stores.append("postgresql")
    for n in args.workers:
        ns = argparse.Namespace(
            jobs=args.jobs,
            producers=args.producers,
            daemons=args.daemons,
            poll_max=args.poll_max,
            workers=n,
            reps=1,
            batch=args.batch,
        )
        for kind in stores:
            if n > 1 and kind == "sqlite" and not args.sqlite_workers:
                continue  # one file's write lock: rarely worth it (pass --sqlite-workers)
            if kind == "sqlite":
                f = cp.control_plane(str(tmp / f"cp-{n}.db"), tmp / f"cp-{kind}-{n}", ns)
            else:  # a fresh database each time: the server bootstraps its tokens into it
                with cp.pg_database(args.pg) as pg:
                    f = cp.control_plane(pg, tmp / f"cp-{kind}-{n}", ns)
            base = (
                f"hello {_rate(hello)} req/s ({hello_cpu:.2f} cpu ms); raw {kind} {_rate(raws[kind])} rows/s"
            )
            tag = f"{kind}, --workers {n}" if len(args.workers) > 1 or n > 1 else kind
            half = f.submit_rate / hello if hello else 0.0
            rows.append(
                Row(
                    f"submits/s, {tag}, one per request",
                    f"{_rate(f.submit_rate)} = {half:.2f}x hello; {f.submit_cpu_ms:.2f} cpu ms",
                    f">= {GOAL_SUBMIT[kind]:,}, >= 0.5x hello",
                    base,
                )
            )
            if n == args.workers[0]:
                for name, rate, cpu in floors[kind]:
                    rows.append(
                        Row(
                            f"  floor of a durable submit (bench/floor.py: {name})",
                            f"{_rate(rate)} = {rate / hello if hello else 0.0:.2f}x hello; {cpu:.2f} cpu ms",
                            "(none of the product's features: the most 0.5x hello can ask)",
                            base,
                        )
                    )
            if f.batch_rate:
                rows.append(
                    Row(
                        f"submits/s, {tag}, map: {args.batch} per submit-batch (per call)",
                        f"{_rate(f.batch_rate)}; {f.batch_cpu_ms:.3f} cpu ms",
                        f">= {GOAL_BATCH[kind]:,}",
                        base,
                    )
                )
            rows.append(
                Row(
                    f"claim+ack/s, {tag}, nymph: {args.poll_max} slots, each ack on the poll refilling it",
                    f"{_rate(f.claim_rate)}; {f.claim_cpu_ms:.2f} cpu ms",
                    f">= {GOAL_NYMPH[kind]:,}",
                    base,
                )
            )
            if f.worker_rate:
                rows.append(
                    Row(
                        f"claim+ack/s, {tag}, lakeshore worker: prefetch {args.poll_max}, acks on the poll",
                        f"{_rate(f.worker_rate)}; {f.worker_cpu_ms:.2f} cpu ms",
                        f">= {GOAL_WORKER[kind]:,}",
                        base,
                    )
                )
    if not args.pg:
        rows.append(Row("PostgreSQL rows", "skipped", "", "pass --pg URL or set LAKESHORE_TEST_PG_URL"))
    return rows


def writer_rows(args: argparse.Namespace, tmp: Path) -> list[Row]:
    """The group-commit writer's CPU per write (bench/writer.py), batches of 1 and 8."""
    urls = [("sqlite", str(tmp / "writer.db"))]
    pg_ctx = None
    if args.pg:
        pg_ctx = cp.pg_database(args.pg)
        urls.append(("postgresql", pg_ctx.__enter__()))
    rows = []
    try:
        for kind, url in urls:
            f = writer.measure(url, args.writer_n)
            for size in sorted(f.submit_us):
                rows.append(
                    Row(
                        f"writer CPU per write, {kind}, batch {size}: submit / claim / ack",
                        f"{f.submit_us[size]:.0f} / {f.claim_us[size]:.0f} / {f.ack_us[size]:.0f} us",
                        "(where the store's share goes)",
                        f"driver alone {f.raw_us[size]:.0f} us per inserted row",
                    )
                )
    finally:
        if pg_ctx is not None:
            pg_ctx.__exit__(None, None, None)
    return rows


def stream_rows(args: argparse.Namespace) -> list[Row]:
    import bench_fns
    import streams

    from dreamlake.lakeshore.devstack import LocalStack
    from dreamlake.lakeshore.dispatch import Dispatch

    floor_us = streams.bare_msgpack_us()
    floor = f"bare msgpack {1e6 / floor_us:,.0f} frames/s"
    rows = []
    with LocalStack(queues=["bench"], concurrency=1, pythonpath=[BENCH], quiet=True) as stack:
        plane = stack.plane()
        streams._follow(plane, bench_fns.ticks, 1)  # warm-up: the first spawn, imports
        firsts = []
        for _ in range(args.first_runs):
            got = streams._follow(plane, bench_fns.ticks, 1)
            firsts.append((got[0][0] - got[0][1]["t"]) * 1e3)
        got = streams._follow(plane, bench_fns.ticks, args.nymph_frames)
        fps = (len(got) - 1) / (got[-1][0] - got[0][0])
        plane.close()
    p50, p90 = median_p90(firsts)
    rows.append(
        Row(
            f"frames/s nymph -> live consumer over HTTP ({args.nymph_frames})",
            f"{fps:,.0f}; first frame p50 {p50:.1f} ms (p90 {p90:.1f})",
            f"first <= Ray's: {_peer(PEERS.ray_first_ms, ISSUE_RAY_FIRST_MS, 'ms')}",
            floor,
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        mem = Dispatch(":memory:")
        r_mem = streams.run_stream(mem, args.frames)
        mem.close()
        file = Dispatch(Path(tmp) / "local.db")
        r_file = streams.run_stream(file, args.frames)
        file.close()
    rows.append(
        Row(
            f"frames/s local plane :memory: / file ({args.frames})",
            f"{r_mem['fps']:,.0f} / {r_file['fps']:,.0f}",
            ">= 20,000",
            floor,
        )
    )
    return rows


def warm_rows(args: argparse.Namespace) -> list[Row]:
    import warm

    warm.TREE = TREE

    ns = argparse.Namespace(
        calls=args.warm_calls,
        producers=args.producers,
        per_producer=args.warm_per_producer,
        prefetch=8,
    )
    hello, rows, _cpu = warm.warm_rows(ns)
    h50 = median_p90(hello)[0]
    one = next(r for r in rows if r.name.endswith("submit?wait"))
    assert one.times is not None and one.per_s is not None
    p50, p90 = median_p90(one.times)
    user = next((r for r in rows if r.name.endswith("SDK f.call()")), None)
    import floor

    low, low_cpu = floor.floor_round_trip(args.warm_calls)
    f50, f90 = median_p90(low)
    return [
        Row(
            "warm round trip, one call at a time (lakeshore worker, submit?wait)",
            f"{p50 * 1e3:.2f} ms p50 (p90 {p90 * 1e3:.1f}), {one.per_s:,.0f}/s",
            f"<= {0.8 * (PEERS.ray_p50_ms or ISSUE_RAY_P50_MS):.2f} ms = 0.8x Ray's p50, "
            f"{_peer(PEERS.ray_p50_ms, ISSUE_RAY_P50_MS, 'ms')}",
            f"hello-world POST p50 {h50 * 1e3:.2f} ms",
        ),
        *(
            [
                Row(
                    "  a user's f.call() through the SDK, the same worker",
                    f"{median_p90(user.times)[0] * 1e3:.2f} ms p50 (p90 {median_p90(user.times)[1] * 1e3:.1f})",
                    "(the row above is the bench's cheap client)",
                    f"hello-world POST p50 {h50 * 1e3:.2f} ms",
                )
            ]
            if user is not None and user.times
            else []
        ),
        Row(
            "  the same design's floor in Python (bench/floor.py: bare ASGI + sqlite3, 2 commits)",
            f"{f50 * 1e3:.2f} ms p50 (p90 {f90 * 1e3:.1f}); server {low_cpu:.2f} cpu ms",
            f"lakeshore: {p50 / f50:.1f}x the floor",
            f"hello-world POST p50 {h50 * 1e3:.2f} ms",
        ),
    ]


def prefork_rows(args: argparse.Namespace) -> list[Row]:
    import dispatch

    from nymph_process import default_python

    bare_cmd = dispatch.bare_command("process", default_python(), "")
    with dispatch._stack(1, "process", "") as stack:
        trips, bare = dispatch.latency(stack, args.prefork_calls, bare_cmd)
    with dispatch._stack(4, "process", "") as stack:
        rate = dispatch.throughput(stack, args.prefork_batch, 4)
    floor = dispatch.bare_throughput(bare_cmd, args.prefork_batch, 4)
    t50, b50 = statistics.median(trips), statistics.median(bare)
    return [
        Row(
            "nymph prefork noop round trip",
            f"{t50 * 1e3:.1f} ms p50 = {t50 / b50:.2f}x bare; {rate:,.0f} inv/s at 4 slots",
            f"keep the lead: RQ fork worker {_peer(PEERS.rq_fork_s, ISSUE_RQ_FORK, '/s')}",
            f"python -c pass p50 {b50 * 1e3:.1f} ms; 4 bare in parallel {floor:,.0f}/s",
        )
    ]


def profile_submits(args: argparse.Namespace, tmp: Path) -> None:
    """The server under submit load, sampled (see the module docstring)."""
    out = tmp / "server-samples.json"
    with cp.lakeshore_server(str(tmp / "prof.db"), tmp / "prof", 1, profile=out) as (port, token, _pid):
        register = {"worker_id": cp.ulid(), "queues": ["prof"], "slots": 1}
        cp.Client(port, token).post("/v1/daemon/register", register)
        per = args.jobs // args.producers
        rate, total = cp.run_load(cp._producer, [(port, token, per, "prof")] * args.producers)
    print(
        f"\nprofile: lakeshore server (SQLite file) under {total} submits from {args.producers} processes, {rate:,.0f}/s"
    )
    _sampler.report(str(out), top=args.profile_top, skip=("threading.py", "thread.py", "runpy", "_sampler"))


def _peers(args: argparse.Namespace) -> list[Row]:
    """Run the installed peers first (bench/peers.py): their figures become the goals' peers."""
    global PEERS
    PEERS = peers.measure(args.peer_calls)
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg", default=os.environ.get("LAKESHORE_TEST_PG_URL"))
    ap.add_argument(
        "--jobs", type=int, default=6000, help="invocations per control-plane figure (fewer: noisier rates)"
    )
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--poll-max", type=int, default=8)
    ap.add_argument("--batch", type=int, default=500, help="submits per submit-batch request (0: skip)")
    ap.add_argument("--frames", type=int, default=2000, help="frames per local-plane stream")
    ap.add_argument("--nymph-frames", type=int, default=5000)
    ap.add_argument("--first-runs", type=int, default=10)
    ap.add_argument("--warm-calls", type=int, default=200)
    ap.add_argument("--warm-per-producer", type=int, default=100)
    ap.add_argument("--prefork-calls", type=int, default=20)
    ap.add_argument("--prefork-batch", type=int, default=60)
    ap.add_argument("--profile", action="store_true", help="sample the server under submit load")
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--workers", default="1", help="lakeshore server --workers, comma-separated (e.g. 1,2)")
    ap.add_argument("--sqlite-workers", action="store_true", help="--workers > 1 over SQLite too")
    ap.add_argument("--writer-n", type=int, default=1000, help="writes per writer figure")
    ap.add_argument("--peer-calls", type=int, default=200)
    ap.add_argument("--only", default="", help="comma-separated: peers,control,writer,streams,warm,prefork")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose code is measured")
    args = ap.parse_args()
    args.workers = [int(n) for n in str(args.workers).split(",") if n.strip()]
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    started = time.monotonic()
    load = os.getloadavg()[0]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        os.chdir(tmp)  # a child run with ``-m`` puts its cwd first on sys.path: no checkout there
        for name, fn in (
            ("peers", lambda: _peers(args)),
            ("control", lambda: control_plane_rows(args, tmp)),
            ("writer", lambda: writer_rows(args, tmp)),
            ("streams", lambda: stream_rows(args)),
            ("warm", lambda: warm_rows(args)),
            ("prefork", lambda: prefork_rows(args)),
        ):
            if not only or name in only:
                print(f"[{name}] ...", file=sys.stderr, flush=True)
                rows += fn()
        if args.profile:
            profile_submits(args, tmp)
    print(
        f"\nissue 34's table, code of {TREE}: {os.cpu_count()} cores, load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end, {time.monotonic() - started:.0f} s"
    )
    w = [max(len(r.figure) for r in rows), max(len(r.value) for r in rows), max(len(r.goal) for r in rows)]
    print(f"| {'figure':<{w[0]}} | {'now':<{w[1]}} | {'goal':<{w[2]}} | same run's baseline |")
    print(f"| {'-' * w[0]} | {'-' * w[1]} | {'-' * w[2]} | --- |")
    for r in rows:
        print(f"| {r.figure:<{w[0]}} | {r.value:<{w[1]}} | {r.goal:<{w[2]}} | {r.baseline} |")
    if PEERS.lines:
        print("\npeers (bench/peers.py, same run):")
        for line in PEERS.lines:
            print(f"  {line}")


if __name__ == "__main__":
    main()
