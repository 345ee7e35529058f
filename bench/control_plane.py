"""Control-plane throughput over loopback HTTP, SQLite and PostgreSQL, beside the goals and the
same run's raw baselines.

The server is ``lakeshore server`` in a subprocess (``--workers N`` to try several); the load comes
from separate processes with a cheap client (:class:`Client`: a raw socket, one keep-alive
connection each, msgpack bodies), so the client never shares the server's core or interpreter. Figures:

- submit/s: ``--producers`` processes submitting ``--jobs`` invocations in all, as fast as answered;
- claim+ack/s: ``--daemons`` processes draining the queue as a busy nymph with ``--poll-max``
  slots does: a first poll claims that many, then each call's ack rides on the poll that refills
  its slot (``max`` 1, no wait): one request per call;
- the same pair through the batched paths: submits in ``--batch`` per ``POST
  /v1/producer/submit-batch`` (as ``UDF.map`` sends a sweep; per call), drained by ``lakeshore
  worker`` loops (``max`` as its ``--prefetch``, the acks of one poll's claims riding on the next
  poll: one request claims and acks);
- baselines of the same run: a Starlette hello-world on the same HTTP stack (uvicorn with
  uvloop and httptools when installed, else asyncio and h11, no access log, as ``lakeshore
  server`` uses) under the same load processes;
  raw ``sqlite3`` (WAL, ``synchronous=NORMAL``, as the store) and raw ``psycopg`` inserts, one row
  per transaction and 100 rows per transaction.

The code under test is whatever ``dreamlake`` the interpreter imports: to compare two trees run
``PYTHONPATH=<tree> python bench/control_plane.py`` for each (this script imports nothing of it).

Run: ``python bench/control_plane.py [--producers 4] [--daemons 4] [--jobs 2000] [--workers 1]
[--pg URL]`` (PostgreSQL also from ``LAKESHORE_TEST_PG_URL``; a database is created and dropped).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Any

import msgpack

GOAL_SUBMIT = {"sqlite": 2000, "postgresql": 3000}
GOAL_CLAIM_ACK = {"sqlite": 2000, "postgresql": 3000}
MSGPACK = "application/x-msgpack"
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

HELLO = """
import sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
async def hello(request):
    await request.body()
    return Response(b"\\x81\\xa2ok\\xc3", media_type="application/x-msgpack")
app = Starlette(routes=[Route("/", hello, methods=["GET", "POST"])])
loop = "uvloop" if {uvloop} else "asyncio"
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop=loop, http="{http}",
            access_log=False)
"""


def ulid() -> str:
    """A ULID (48-bit ms time + 80 random bits, Crockford base32): what the server validates."""
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join(_CROCKFORD[(value >> (5 * i)) & 31] for i in range(25, -1, -1))


def submit_body(queue: str) -> dict[str, Any]:
    return {
        "invocation_id": ulid(),
        "queue": queue,
        "function": {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"},
        "args_blob": b"\x90",
        "run_config": {"queue": queue, "priority": 0.0, "key": None},
        "code_context": {},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Client:
    """One keep-alive HTTP/1.1 connection; msgpack in, msgpack out: the load's cheap client.

    A request is one ``sendall`` of its head and body; the answer is its status line, its headers
    (only ``Content-Length`` and ``Transfer-Encoding`` are looked at) and a body of that length.
    ``http.client`` cost the load about 0.2 ms of CPU a request (a file object per answer, every
    header checked by a regular expression, the head parsed by the ``email`` package), as much as
    the server's hello-world: the bench measured itself. Written out here, not taken from the SDK
    (``dreamlake.lakeshore.keepalive``), because the load must not change with the ``--tree``
    under test. A chunked answer, a closed connection or a malformed head raises."""

    def __init__(self, port: int, token: str | None) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.buf = b""
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.head = f"Host: 127.0.0.1:{port}\r\nContent-Type: {MSGPACK}\r\n{auth}Content-Length: "

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.buf = sock, b""
        return sock

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        sock = self.sock or self._connect()
        data = msgpack.packb(body, use_bin_type=True)
        sock.sendall(f"POST {path} HTTP/1.1\r\n{self.head}{len(data)}\r\n\r\n".encode() + data)
        buf = self.buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv(sock)
        lines = buf[:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                raise RuntimeError(f"the bench client reads Content-Length answers only, not {line!r}")
        buf = buf[end + 4 :]
        while len(buf) < length:
            buf += self._recv(sock)
        payload, self.buf = buf[:length], buf[length:]
        return status, msgpack.unpackb(payload, raw=False) if payload else None

    def _recv(self, sock: socket.socket) -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            sock.close()
            self.sock = None
            raise ConnectionError("the server closed the connection")
        return chunk


# -- load processes ----------------------------------------------------------------------------


def _producer(port: int, token: str, n: int, queue: str, go: Any, out: Any) -> None:
    c = Client(port, token)
    go.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        status, answer = c.post("/v1/producer/submit", submit_body(queue))
        if status != 200:
            raise RuntimeError(f"submit answered {status}: {answer}")
    out.put((t0, time.perf_counter(), n))


def _batch_producer(port: int, token: str, n: int, queue: str, chunk: int, go: Any, out: Any) -> None:
    """``n`` submits in requests of ``chunk`` (``POST /v1/producer/submit-batch``, as ``UDF.map``
    sends a sweep: the fields every call shares once, in ``common``)."""
    c = Client(port, token)
    common = submit_body(queue)
    for name in ("invocation_id", "args_blob"):
        common.pop(name)
    go.wait()
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        items = [{"invocation_id": ulid(), "args_blob": b"\x90"} for _ in range(min(chunk, n - start))]
        status, answer = c.post("/v1/producer/submit-batch", {"common": common, "submits": items})
        if status != 200 or any("error" in r for r in answer["results"]):
            raise RuntimeError(f"submit-batch answered {status}: {str(answer)[:300]}")
    out.put((t0, time.perf_counter(), n))


def _ack_body(cmd: dict[str, Any], worker: str | None) -> dict[str, Any]:
    body = cmd["body"]
    ack = {
        "invocation_id": body["invocation_id"],
        "state": "succeeded",
        "result_blob": b"\xc0",
        "error": None,
        "attempt": body["attempt"],
    }
    if worker is not None:
        ack["worker_id"] = worker
    return ack


def _worker(port: int, token: str, queue: str, poll_max: int, go: Any, out: Any) -> None:
    """``lakeshore worker --prefetch poll_max``'s loop: each poll claims up to ``poll_max`` and
    carries the acks of the ones run since the previous poll (``acks``), one request for both."""
    c = Client(port, token)
    worker, done, acks = ulid(), 0, []
    go.wait()
    t0 = time.perf_counter()
    while True:
        poll = {"worker_id": worker, "queues": [queue], "max": poll_max, "timeout_s": 0, "kinds": ["run"]}
        if acks:
            poll["acks"] = acks
        status, answer = c.post("/v1/daemon/poll", poll)
        if status != 200 or any(not a.get("ok") for a in answer.get("acked") or []):
            raise RuntimeError(f"poll answered {status}: {str(answer)[:300]}")
        done += len(acks)
        acks = [_ack_body(cmd, None) for cmd in answer["commands"]]
        if not acks:
            break
    out.put((t0, time.perf_counter(), done))


def _daemon(port: int, token: str, queue: str, poll_max: int, go: Any, out: Any) -> None:
    """A busy nymph's loop with ``poll_max`` slots: a first poll claims that many; each call, once
    run, frees its slot, and the poll that refills it carries its ack (``max`` 1, no wait). Each
    poll says what nymph's says by default (nymph/poller.py): run commands only (exec jobs are
    its ``--allow-exec`` opt-in) and its offer (a host without GPUs)."""
    c = Client(port, token)
    worker, done = ulid(), 0
    go.wait()
    t0 = time.perf_counter()
    base = {"worker_id": worker, "queues": [queue], "timeout_s": 0, "kinds": ["run"], "offer": {"gpus": 0}}
    poll: dict[str, Any] = {**base, "max": poll_max}
    status, answer = c.post("/v1/daemon/poll", poll)
    if status != 200:
        raise RuntimeError(f"poll answered {status}: {answer}")
    running = list(answer["commands"])
    while running:
        cmd = running.pop(0)
        poll = {**base, "max": 1, "acks": [_ack_body(cmd, worker)]}
        status, answer = c.post("/v1/daemon/poll", poll)
        if status != 200 or any(not a.get("ok") for a in answer.get("acked") or []):
            raise RuntimeError(f"poll answered {status}: {str(answer)[:300]}")
        done += 1
        running += answer["commands"]
    out.put((t0, time.perf_counter(), done))


def _hello(port: int, n: int, go: Any, out: Any) -> None:
    c = Client(port, None)
    go.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        c.post("/", {"x": 1})
    out.put((t0, time.perf_counter(), n))


def run_load(target: Callable[..., None], arglists: list[tuple[Any, ...]]) -> tuple[float, int]:
    """Run ``target(*args, go, out)`` in one process per arglist, started together; (rate/s, total)."""
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, go, out)) for a in arglists]
    for p in procs:
        p.start()
    time.sleep(0.2)  # every process has connected and waits
    go.set()
    results = []
    deadline = time.monotonic() + 600
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1.0))
        except Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.terminate()
                raise RuntimeError(
                    f"a load process failed (exit {failed}) or the load took over 600 s"
                ) from None
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"a load process failed (exit {p.exitcode})")
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    total = sum(r[2] for r in results)
    return total / (end - start), total


# -- servers -----------------------------------------------------------------------------------


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)


@contextlib.contextmanager
def _process(cmd: list[str], port: int, stop: int = signal.SIGTERM) -> Iterator[int]:
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=None)
    try:
        _wait_port(port, proc)
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, stop)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live children (``--workers``)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


@contextlib.contextmanager
def lakeshore_server(
    db: str, data_dir: Path, workers: int, profile: Path | None = None
) -> Iterator[tuple[int, str, int]]:
    """``lakeshore server`` in a subprocess; yields (port, admin token, pid). With ``profile``, the
    server runs under ``bench/_sampler.py``, whose stack samples land in that file at exit."""
    # a PostgreSQL control plane seals secrets under a key kept outside the database: every server
    # this bench starts shares one, made for the run (its scratch database is dropped after)
    os.environ.setdefault("LAKESHORE_SERVER_KEY", secrets.token_hex(32))
    port = free_port()
    prof = [str(Path(__file__).with_name("_sampler.py")), str(profile)] if profile is not None else []
    cmd = [sys.executable, *prof, "-m", "dreamlake.lakeshore.cli", "--log-level", "warning", "server"]
    cmd += ["--port", str(port), "--data-dir", str(data_dir), "--db", db]
    cmd += ["--workers", str(workers)]  # as measured, whatever --workers auto would pick
    # uvicorn re-raises the signal it stopped on: SIGINT's KeyboardInterrupt lets the sampler write
    with _process(cmd, port, signal.SIGINT if profile is not None else signal.SIGTERM) as pid:
        time.sleep(0.5 if workers == 1 else 2.0)  # every worker accepts
        yield port, json.loads((data_dir / "tokens.json").read_text())["admin"], pid


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def hello_parser() -> str:
    """The HTTP parser ``lakeshore server`` serves with here (httptools when installed), for the
    hello-world baseline to use the same stack."""
    wanted = os.environ.get("LAKESHORE_HTTP_PARSER", "").strip().lower()
    return wanted if wanted in ("h11", "httptools") else ("httptools" if has("httptools") else "h11")


def hello_rate(clients: int, n: int) -> tuple[float, float]:
    """Requests/s and server CPU ms per request of the hello-world."""
    port = free_port()
    code = HELLO.format(uvloop=has("uvloop"), http=hello_parser())
    with _process([sys.executable, "-c", code, str(port)], port) as pid:
        cpu = cpu_seconds(pid)
        rate, total = run_load(_hello, [(port, n)] * clients)
        return rate, (cpu_seconds(pid) - cpu) * 1000 / total


# -- raw database baselines --------------------------------------------------------------------


def raw_sqlite(path: Path, rows: int, per_tx: int) -> float:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS t (id TEXT PRIMARY KEY, body BLOB, at REAL)")
    t0 = time.perf_counter()
    for _ in range(0, rows, per_tx):
        db.execute("BEGIN IMMEDIATE")
        db.executemany(
            "INSERT INTO t VALUES (?, ?, ?)", [(ulid(), b"\x90", time.time()) for _ in range(per_tx)]
        )
        db.execute("COMMIT")
    rate = rows / (time.perf_counter() - t0)
    db.close()
    return rate


def raw_psycopg(url: str, rows: int, per_tx: int) -> float:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS raw_t (id TEXT PRIMARY KEY, body BYTEA, at DOUBLE PRECISION)"
        )
        t0 = time.perf_counter()
        for _ in range(0, rows, per_tx):
            batch = [(ulid(), b"\x90", time.time()) for _ in range(per_tx)]
            if per_tx == 1:
                conn.execute("INSERT INTO raw_t VALUES (%s, %s, %s)", batch[0])
            else:
                with conn.transaction(), conn.cursor() as cur:
                    cur.executemany("INSERT INTO raw_t VALUES (%s, %s, %s)", batch)
        rate = rows / (time.perf_counter() - t0)
        conn.execute("DROP TABLE raw_t")
    return rate


@contextlib.contextmanager
def pg_database(base: str) -> Iterator[str]:
    """A fresh database on the server of ``base``; yields its URL, drops it after."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"lakeshore_bench_{secrets.token_hex(4)}"
    admin = make_url(base).set(drivername="postgresql")
    dsn = admin.render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Figures:
    submit_rate: float
    submit_cpu_ms: float  # server CPU per submit
    claim_rate: float
    claim_cpu_ms: float  # server CPU per poll + ack
    # submits through submit-batch (per call), drained by lakeshore worker's loop (acks on the poll)
    batch_rate: float = 0.0
    batch_cpu_ms: float = 0.0
    worker_rate: float = 0.0
    worker_cpu_ms: float = 0.0


def _serve_queue(port: int, token: str, queue: str, slots: int) -> None:
    """A registered worker serves ``queue``, as a nymph would (else each submit reads the live
    queues to warn that nobody serves it)."""
    register = {"worker_id": ulid(), "queues": [queue], "slots": slots}
    status, answer = Client(port, token).post("/v1/daemon/register", register)
    if status != 200:
        raise RuntimeError(f"register answered {status}: {answer}")


def _measured(
    pid: int, target: Callable[..., None], arglists: list[tuple[Any, ...]]
) -> tuple[float, int, float]:
    """``run_load`` of ``target``: (rate/s, total, server CPU ms per unit)."""
    cpu = cpu_seconds(pid)
    rate, total = run_load(target, arglists)
    return rate, total, (cpu_seconds(pid) - cpu) * 1000 / max(1, total)


def submit_rate(producers: int, n: int, pg: str | None = None) -> tuple[float, float]:
    """Single submits/s through ``lakeshore server`` (``--workers 1``) on a SQLite file, or with
    ``pg`` in a fresh database of that PostgreSQL server (one per request, ``n`` from each of
    ``producers`` load processes, a registered worker serving the queue) and the server's CPU ms per
    submit: the table's single-submits row alone."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        db = stack.enter_context(pg_database(pg)) if pg else f"sqlite:///{tmp}/submits.db"
        port, token, pid = stack.enter_context(lakeshore_server(db, Path(tmp) / "data", 1))
        _serve_queue(port, token, "submits", 1)
        rate, _total, cpu = _measured(pid, _producer, [(port, token, n, "submits")] * producers)
        return rate, cpu


def control_plane(db: str, data_dir: Path, args: argparse.Namespace) -> Figures:
    """Per rep: single submits drained by busy-nymph-style daemons (each ack on the next poll),
    then (``args.batch`` > 0) as many submits through submit-batch drained by ``lakeshore worker``
    loops (``max`` as prefetch, the acks riding on the next poll)."""
    per = args.jobs // args.producers
    batch = getattr(args, "batch", 0)
    runs: list[Figures] = []
    with lakeshore_server(db, data_dir, args.workers) as (port, token, pid):
        for rep in range(args.reps):
            queue = f"bench{rep}"
            _serve_queue(port, token, queue, args.daemons)
            sub, total, cpu_sub = _measured(pid, _producer, [(port, token, per, queue)] * args.producers)
            rate, drained, cpu_claim = _measured(
                pid, _daemon, [(port, token, queue, args.poll_max)] * args.daemons
            )
            if drained != total:
                raise RuntimeError(f"drained {drained} of {total} invocations")
            fig = Figures(sub, cpu_sub, rate, cpu_claim)
            if batch > 0:
                queue = f"batch{rep}"
                _serve_queue(port, token, queue, args.daemons)
                load = [(port, token, per, queue, batch)] * args.producers
                fig.batch_rate, total, fig.batch_cpu_ms = _measured(pid, _batch_producer, load)
                load = [(port, token, queue, args.poll_max)] * args.daemons
                fig.worker_rate, drained, fig.worker_cpu_ms = _measured(pid, _worker, load)
                if drained != total:
                    raise RuntimeError(f"drained {drained} of {total} batch-submitted invocations")
            runs.append(fig)
    mid = len(runs) // 2
    return Figures(
        *(sorted(getattr(r, f) for r in runs)[mid] for f in Figures.__dataclass_fields__)  # type: ignore[arg-type]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--poll-max", type=int, default=1, help="commands per poll")
    ap.add_argument("--batch", type=int, default=500, help="submits per submit-batch request (0: skip)")
    ap.add_argument("--workers", type=int, default=1, help="lakeshore server --workers")
    ap.add_argument("--reps", type=int, default=2, help="runs per figure (median)")
    ap.add_argument("--raw-rows", type=int, default=5000)
    ap.add_argument("--pg", default=os.environ.get("LAKESHORE_TEST_PG_URL"))
    args = ap.parse_args()
    stack = f"{'uvloop' if has('uvloop') else 'asyncio'} + h11"
    hello, hello_cpu = hello_rate(args.producers, max(200, args.jobs // args.producers))
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        raw1 = raw_sqlite(Path(tmp) / "raw1.db", args.raw_rows // 5, 1)
        raw100 = raw_sqlite(Path(tmp) / "raw100.db", args.raw_rows, 100)
        got = control_plane(str(Path(tmp) / "bench.db"), Path(tmp) / "sq", args)
        rows.append(_row("sqlite", got, raw1, raw100))
        if args.pg:
            with pg_database(args.pg) as pg:
                raw1 = raw_psycopg(pg, args.raw_rows // 5, 1)
                raw100 = raw_psycopg(pg, args.raw_rows, 100)
                got = control_plane(pg, Path(tmp) / "pg", args)
            rows.append(_row("postgresql", got, raw1, raw100))
    print(
        f"control plane over loopback: {args.producers} producer and {args.daemons} daemon processes, "
        f"{args.jobs} jobs, poll max {args.poll_max}, {args.workers} server process(es), "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; median of {args.reps}"
    )
    print(
        f"HTTP stack {stack}: Starlette hello-world {hello:,.0f} requests/s, "
        f"{hello_cpu:.2f} server CPU ms per request ({args.producers} clients)"
    )
    print("  cpu ms: server CPU per submit / per claim+ack (poll + ack); 1-core/s: 1000 / cpu ms")
    print(
        f"  <store> batch: submits through submit-batch ({args.batch} per request), drained by "
        "lakeshore worker loops (poll max as prefetch, acks on the next poll)"
    )
    print(
        f"{'store':<11} {'submit/s':>9} {'goal':>6} {'cpu ms':>7} {'1-core/s':>9}"
        f" {'claim+ack/s':>12} {'goal':>6} {'cpu ms':>7} {'1-core/s':>9}"
        f" {'raw rows/s 1/tx':>16} {'100/tx':>8}"
    )
    for row in rows:
        print(row)
    if not args.pg:
        print("(PostgreSQL skipped: pass --pg URL or set LAKESHORE_TEST_PG_URL)")


def _per_core(cpu_ms: float) -> str:
    """Operations per second one core could serve at ``cpu_ms`` each; ``-`` when too little CPU was
    used to be measured (a run too short for the clock's ticks, as in the smoke test)."""
    return f"{1000 / cpu_ms:>9,.0f}" if cpu_ms > 0 else f"{'-':>9}"


def _row(kind: str, f: Figures, raw1: float, raw100: float) -> str:
    line = (
        f"{kind:<11} {f.submit_rate:>9,.0f} {GOAL_SUBMIT[kind]:>6,} {f.submit_cpu_ms:>7.2f}"
        f" {_per_core(f.submit_cpu_ms)} {f.claim_rate:>12,.0f} {GOAL_CLAIM_ACK[kind]:>6,}"
        f" {f.claim_cpu_ms:>7.2f} {_per_core(f.claim_cpu_ms)} {raw1:>16,.0f} {raw100:>8,.0f}"
    )
    if f.batch_rate:
        line += (
            f"\n{kind + ' batch':<11} {f.batch_rate:>9,.0f} {GOAL_SUBMIT[kind]:>6,} {f.batch_cpu_ms:>7.2f}"
            f" {_per_core(f.batch_cpu_ms)} {f.worker_rate:>12,.0f} {GOAL_CLAIM_ACK[kind]:>6,}"
            f" {f.worker_cpu_ms:>7.2f} {_per_core(f.worker_cpu_ms)}"
        )
    return line


if __name__ == "__main__":
    main()
