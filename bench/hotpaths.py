"""Every row of issue 10's table in one paired run: each figure beside its goal and the same run's
raw baseline, with small sizes so the whole run takes a few minutes.

It runs the other benches' own functions, so the figures mean what they mean there:

- submits/s and claim+ack/s, SQLite and PostgreSQL (``control_plane.py``: ``lakeshore server`` in
  a subprocess, load from separate processes with ``http.client``), each two ways: one submit per
  request and a sweep's ``--batch`` per ``POST /v1/producer/submit-batch`` (``UDF.map``; per
  call); a busy nymph's claim path (``max`` slots, each ack on the poll that refills its slot)
  and ``lakeshore worker``'s
  (``--prefetch``, the acks riding on the next poll); baselines: a Starlette hello-world on the
  same HTTP stack, raw ``sqlite3`` / ``psycopg`` inserts (100 per transaction);
- frames/s nymph -> live consumer over HTTP and the first frame's latency (``streams.py``'s
  stack: ``lakeshore server`` + ``nymph start --runner process``); baseline: a bare msgpack
  pack+unpack per frame;
- frames/s on the local plane, ``:memory:`` and a SQLite file (``streams.run_stream``);
- the warm path (``warm.py``: ``lakeshore worker --prefetch``, producers in separate processes,
  submit with ``wait_s``): round trip p50 and calls/s; baseline: one hello-world POST;
- nymph's prefork noop round trip (``dispatch.py``): p50 and its ratio to a bare ``python -c
  pass``, and invocations/s at 4 slots beside 4 bare spawns in parallel.

``--profile`` adds where the server's time goes under submit load: ``lakeshore server`` runs under
``bench/_sampler.py`` (stack samples of every thread, waits dropped) while the producers of
``control_plane.py`` submit, and the heaviest functions are printed per thread kind.

Run: ``python bench/hotpaths.py [--pg URL] [--profile] [--tree CHECKOUT]`` (``--tree``: measure
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


def control_plane_rows(args: argparse.Namespace, tmp: Path) -> list[Row]:
    ns = argparse.Namespace(
        jobs=args.jobs,
        producers=args.producers,
        daemons=args.daemons,
        poll_max=args.poll_max,
        workers=1,
        reps=1,
        batch=args.batch,
    )
    hello, _cpu = cp.hello_rate(args.producers, max(200, args.jobs // args.producers))
    rows = []
    sq = cp.control_plane(str(tmp / "cp.db"), tmp / "cp-sq", ns)
    raw_sq = cp.raw_sqlite(tmp / "raw.db", 3000, 100)
    figures = {"sqlite": (sq, raw_sq)}
    if args.pg:
        with cp.pg_database(args.pg) as pg:
            raw_pg = cp.raw_psycopg(pg, 3000, 100)
            figures["postgresql"] = (cp.control_plane(pg, tmp / "cp-pg", ns), raw_pg)
    for kind, (f, raw) in figures.items():
        base = f"hello {_rate(hello)} req/s; raw {kind} {_rate(raw)} rows/s (100/tx)"
        goal_s, goal_c = f">= {cp.GOAL_SUBMIT[kind]:,}", f">= {cp.GOAL_CLAIM_ACK[kind]:,}"
        rows.append(Row(f"submits/s, {kind}, one per request", _rate(f.submit_rate), goal_s, base))
        if f.batch_rate:
            what = f"submits/s, {kind}, map: {args.batch} per submit-batch (per call)"
            rows.append(Row(what, _rate(f.batch_rate), goal_s, base))
        what = f"claim+ack/s, {kind}, nymph: {args.poll_max} slots, each ack on the poll refilling it"
        rows.append(Row(what, _rate(f.claim_rate), goal_c, base))
        if f.worker_rate:
            what = f"claim+ack/s, {kind}, lakeshore worker: prefetch {args.poll_max}, acks on the poll"
            rows.append(Row(what, _rate(f.worker_rate), goal_c, base))
    if not args.pg:
        rows.append(Row("PostgreSQL rows", "skipped", "", "pass --pg URL or set LAKESHORE_TEST_PG_URL"))
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
            ">= 20,000; first <= 5 ms p50",
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
    return [
        Row(
            "warm path (lakeshore worker) round trip",
            f"{p50 * 1e3:.2f} ms p50 (p90 {p90 * 1e3:.1f}), {one.per_s:,.0f}/s",
            "<= 3 ms p50, >= 500/s",
            f"hello-world POST p50 {h50 * 1e3:.2f} ms",
        )
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
            "<= 2x bare; >= 150 inv/s",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg", default=os.environ.get("LAKESHORE_TEST_PG_URL"))
    ap.add_argument("--jobs", type=int, default=1200, help="invocations per control-plane figure")
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
    ap.add_argument("--only", default="", help="comma-separated: control,streams,warm,prefork")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose code is measured")
    args = ap.parse_args()
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    started = time.monotonic()
    load = os.getloadavg()[0]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        os.chdir(tmp)  # a child run with ``-m`` puts its cwd first on sys.path: no checkout there
        for name, fn in (
            ("control", lambda: control_plane_rows(args, tmp)),
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
        f"\nissue 10's table, code of {TREE}: {os.cpu_count()} cores, load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end, {time.monotonic() - started:.0f} s"
    )
    w = [max(len(r.figure) for r in rows), max(len(r.value) for r in rows), max(len(r.goal) for r in rows)]
    print(f"| {'figure':<{w[0]}} | {'now':<{w[1]}} | {'goal':<{w[2]}} | same run's baseline |")
    print(f"| {'-' * w[0]} | {'-' * w[1]} | {'-' * w[2]} | --- |")
    for r in rows:
        print(f"| {r.figure:<{w[0]}} | {r.value:<{w[1]}} | {r.goal:<{w[2]}} | {r.baseline} |")


if __name__ == "__main__":
    main()
