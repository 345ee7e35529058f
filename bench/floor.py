"""The floor of the warm round trip: the same design with none of the product, measured beside the
same run's raw HTTP round trip.

The warm round trip (``bench/warm.py``'s ``submit?wait`` row): a producer submits a call and holds
its request open; a long-lived worker, long-polling, claims it, runs a noop, and acks it on its
next poll; the producer's request is answered with the outcome. Here that design runs with nothing
else: a bare ASGI callable (no Starlette, no auth, no metrics, no validation) on the same HTTP stack
as ``lakeshore server`` (uvicorn, uvloop when installed, the parser of ``hello_parser()``, no
access log) over one raw ``sqlite3`` connection with the store's durability (a WAL file,
``synchronous = NORMAL``, ``BEGIN IMMEDIATE`` ... ``COMMIT``), everything on the event loop. Per
call: four messages on the wire (submit in, claim out as a parked poll's answer, ack in on the next
poll, outcome out) and two durable commits (the submit, which claims the row for the parked poll
in the same transaction; the ack, which commits before the producer is answered). Whatever
``lakeshore server`` spends above this is its features; this is the least the design costs in
Python on this machine.

The server is this file (``--serve PORT DB``) in a subprocess; the load comes from separate
processes with ``control_plane.Client`` (a raw socket, one keep-alive connection each, msgpack
bodies): one producer (``--calls`` sequential ``POST /submit`` with ``wait_s``, timed after
``WARMUP`` untimed calls) and one worker (``POST /poll`` with the previous call's ack, a noop
between). Rows:

- ``hello``: one POST to ``warm.py``'s Starlette hello-world on the same stack, the floor of one
  request: ``x hello`` is printed beside the round trip;
- ``floor (bare ASGI + sqlite3, 2 commits)``: p50 and p90 of the round trip, and the floor
  server's CPU ms per call (psutil, over the timed calls);
- ``where it goes``: the p50 of each part of the round trip, from the producer's wall clock and
  the row's ``submitted``, ``started`` (the claim) and ``finished`` (the ack).

``floor_round_trip(calls)`` is the measurement alone, for ``bench/hotpaths.py``;
``floor_submit_rate(producers, n, app)`` the floors of the single-submits row (durable submits, one
per request, from the same load processes), printed beside it: ``floor`` (this design's small
table, a commit per submit), ``row`` (:class:`RowFloor`: lakeshore's own row, table and indexes,
group commits, and still none of the product's code) and ``checked`` (:class:`CheckedFloor`: the
same after the checks every submit must make, made with the product's own check functions: what
any implementation as safe as the seeds ask pays, before the product's own features).

Run: ``python bench/floor.py [--calls 2000]``; ``python bench/floor.py --submits`` prints the three
submit floors and ``lakeshore server``'s single submits beside the same period's hello-world;
``--rounds N`` measures them all N times, alternated, and prints each one's median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _stats import median_p90, percentile  # noqa: E402
from control_plane import (  # noqa: E402
    Client,
    _process,
    cpu_seconds,
    free_port,
    has,
    hello_parser,
    pg_database,
    run_load,
    submit_body,
    ulid,
)
from warm import hello_round_trip, in_processes, ms, split  # noqa: E402

QUEUE = "floor"
WARMUP = 200
LEASE_S = 60.0
NOOP_ARGS = b"\x90"  # msgpack []
NOOP_RESULT = b"\xc0"  # msgpack None
STOP = b"stop"  # the args of the last submit: the worker acks it and exits
SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    id TEXT PRIMARY KEY, queue TEXT NOT NULL, state TEXT NOT NULL, args BLOB, result BLOB,
    worker TEXT, started REAL, finished REAL, lease REAL, submitted REAL
);
CREATE INDEX IF NOT EXISTS calls_queue_state ON calls (queue, state, submitted);
"""
CLAIM_ONE = "UPDATE calls SET state = 'running', worker = ?, started = ?, lease = ? WHERE id = ?"
CLAIM_OLDEST = (
    "UPDATE calls SET state = 'running', worker = ?, started = ?, lease = ? WHERE id = "
    "(SELECT id FROM calls WHERE queue = ? AND state = 'queued' ORDER BY submitted LIMIT 1) "
    "RETURNING id, args"
)
ACK = (
    "UPDATE calls SET state = 'succeeded', result = ?, finished = ? "
    "WHERE id = ? AND worker = ? AND state = 'running'"
)
_EXPIRED = object()  # what a wait's timer hands its future
GATHER_TURNS = 2  # the group commit's wait for more writes on the loop (server/writer.py's)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# -- the floor server ----------------------------------------------------------------------------


async def _body(receive: Receive) -> bytes:
    """A request's whole body, from its ASGI messages."""
    message = await receive()
    body = message.get("body", b"")
    while message.get("more_body"):
        message = await receive()
        body += message.get("body", b"")
    return bytes(body)


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(_EXPIRED)


class Floor:
    """The bare ASGI app: ``POST /submit`` and ``POST /poll`` over one ``sqlite3`` connection."""

    def __init__(self, db_path: str) -> None:
        self.db = sqlite3.connect(db_path, isolation_level=None)
        # the store's PRAGMAs (dreamlake/lakeshore/store/engine.py, Database._create)
        self.db.execute("PRAGMA busy_timeout = 30000")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA wal_autocheckpoint = 16384")
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(SCHEMA)
        self.parked: dict[str, list[tuple[str, asyncio.Future[Any]]]] = {}  # queue -> polls waiting
        self.outcomes: dict[str, asyncio.Future[Any]] = {}  # call id -> its producer's future

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await _body(receive)
        path = scope["path"]
        try:
            request = msgpack.unpackb(body, raw=False)
            if path == "/submit":
                status, answer = 200, await self.submit(request)
            elif path == "/poll":
                status, answer = 200, await self.poll(request)
            else:
                status, answer = 404, {"error": path}
        except Exception as exc:
            status, answer = 500, {"error": repr(exc)}
        data = msgpack.packb(answer, use_bin_type=True)
        headers = [(b"content-type", b"application/x-msgpack"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    def _rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    async def submit(self, req: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        call_id, queue = req["id"], req["queue"]
        outcome = loop.create_future()
        waiting = self.parked.get(queue)
        poll = None
        while waiting and poll is None:
            worker, fut = waiting.pop(0)
            if not fut.done():
                poll = worker, fut
        now = time.time()
        try:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "INSERT INTO calls (id, queue, state, args, submitted) VALUES (?, ?, 'queued', ?, ?)",
                (call_id, queue, req["args"], now),
            )
            if poll is not None:
                self.db.execute(CLAIM_ONE, (poll[0], now, now + LEASE_S, call_id))
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            if poll is not None:  # the poll stays parked
                waiting = self.parked.setdefault(queue, [])
                waiting.insert(0, poll)
            raise
        self.outcomes[call_id] = outcome
        if poll is not None:
            poll[1].set_result([{"id": call_id, "args": req["args"]}])
        timer = loop.call_later(float(req.get("wait_s") or 0.0), _expire, outcome)
        try:
            result = await outcome
        finally:
            timer.cancel()
            self.outcomes.pop(call_id, None)
        if result is not _EXPIRED:
            return {"id": call_id, "state": "succeeded", "result": result}
        row = self.db.execute("SELECT state, result FROM calls WHERE id = ?", (call_id,)).fetchone()
        return {"id": call_id, "state": row[0], "result": row[1]}

    async def poll(self, req: dict[str, Any]) -> dict[str, Any]:
        worker, queue = req["worker"], req["queue"]
        acked = []
        now = time.time()
        try:
            self.db.execute("BEGIN IMMEDIATE")
            for ack in req.get("acks") or ():
                cur = self.db.execute(ACK, (ack["result"], now, ack["id"], worker))
                if cur.rowcount == 1:
                    acked.append((ack["id"], ack["result"]))
            row = self.db.execute(CLAIM_OLDEST, (worker, now, now + LEASE_S, queue)).fetchone()
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        for call_id, result in acked:  # durable now: their producers may be answered
            fut = self.outcomes.get(call_id)
            if fut is not None and not fut.done():
                fut.set_result(result)
        if row is not None:
            return {"calls": [{"id": row[0], "args": row[1]}]}
        wait_s = float(req.get("wait_s") or 0.0)
        if wait_s <= 0:
            return {"calls": []}
        loop = asyncio.get_running_loop()
        parked = loop.create_future()
        entry = (worker, parked)
        self.parked.setdefault(queue, []).append(entry)
        timer = loop.call_later(wait_s, _expire, parked)
        try:
            calls = await parked
        finally:
            timer.cancel()
            waiting = self.parked.get(queue)
            if waiting and entry in waiting:
                waiting.remove(entry)
        return {"calls": [] if calls is _EXPIRED else calls}


class RowFloor:
    """The floor of a submit of lakeshore's own row: ``POST /submit`` takes the body the product's
    bench sends (``control_plane.submit_body``), encodes its three JSON columns and inserts the
    row the product writes (every column of ``invocations``, through the product's own schema and
    indexes, made by its migrations) in a group commit: the submits that arrived while the previous
    commit ran go into the next transaction together, each answered after it commits. On a SQLite
    file (``db`` a path) the commit runs on the event loop (``BEGIN IMMEDIATE``, the inserts,
    ``COMMIT``), waiting ``GATHER_TURNS`` loop turns for more submits once a batch held several, as
    the product's does; on PostgreSQL (``db`` a URL) it is one multi-row insert in autocommit (one
    round trip), in a thread of its own, as the product's is. No token, no checks, no key or hash,
    no wake-ups, no metrics: what is left is what a durable submit of this row costs in Python,
    whatever the product does around it."""

    def __init__(self, db: str) -> None:
        from dreamlake.lakeshore.store import open_store
        from dreamlake.lakeshore.store.api import SubmitRequest

        self.pg = db.startswith("postgresql")
        store = open_store(db if self.pg else f"sqlite:///{db}")  # the product's schema, its migrations
        body = submit_body(QUEUE)
        prepared = store._prepare_submit(  # the row the product writes for this body
            SubmitRequest(
                body["invocation_id"], QUEUE, body["function"], body["args_blob"], body["run_config"]
            )
        )
        store.close()
        self.template = {**prepared.row, **prepared.texts, "root_invocation_id": None}
        self.columns = list(self.template)
        self.at = self.columns.index("submitted_at")
        self.head = f"INSERT INTO invocations ({', '.join(self.columns)}) VALUES "
        self.pending: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self.committing = False
        self.gather = False  # SQLite: the last batch held several submits (see ``_next``)
        if self.pg:
            import psycopg
            from sqlalchemy.engine import make_url

            url = make_url(db).set(drivername="postgresql").render_as_string(hide_password=False)
            self.conn: Any = psycopg.connect(url, autocommit=True)
            self.pool = ThreadPoolExecutor(max_workers=1)
        else:
            self.conn = sqlite3.connect(db, isolation_level=None)
            for pragma in ("busy_timeout = 30000", "journal_mode = WAL", "synchronous = NORMAL"):
                self.conn.execute(f"PRAGMA {pragma}")

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await _body(receive)
        req = msgpack.unpackb(body, raw=False)
        row = {
            **self.template,
            "invocation_id": req["invocation_id"],
            "args_blob": req["args_blob"],
            "function": json.dumps(req["function"]),
            "run_config": json.dumps(req["run_config"]),
            "code_context": json.dumps(req["code_context"]),
        }
        await self._committed(tuple(row[c] for c in self.columns))
        await _answer(send, {"invocation_id": req["invocation_id"], "queue": req["queue"]})

    async def _committed(self, values: tuple[Any, ...]) -> None:
        """Hand ``values`` (a row, in ``columns``' order) to the next group commit; return once it
        has committed."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending.append((values, fut))
        if not self.committing:
            self.committing = True
            loop.call_soon(self._next, GATHER_TURNS if self.gather else 0)
        await fut

    def _next(self, wait: int = 0) -> None:
        """Commit what is pending (a batch), after ``wait`` more loop turns; when it has committed,
        answer it and take the next."""
        if wait:
            asyncio.get_running_loop().call_soon(self._next, wait - 1)
            return
        batch, self.pending = self.pending, []
        if not batch:
            self.committing = False
            return
        now, at = time.time(), self.at
        rows = [(*p[:at], now, *p[at + 1 :]) for p, _ in batch]
        if self.pg:
            done = asyncio.get_running_loop().run_in_executor(self.pool, self._write_pg, rows)
            done.add_done_callback(lambda f: self._answer(batch, f.exception()))
            return
        self.gather = len(batch) > 1  # the product's gather on the loop (server/writer.py)
        try:
            self._write_sqlite(rows)
        except BaseException as exc:
            self._answer(batch, exc)
            return
        self._answer(batch, None)

    def _answer(self, batch: list[tuple[Any, asyncio.Future[Any]]], exc: BaseException | None) -> None:
        for _, fut in batch:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
        self._next()

    def _write_sqlite(self, rows: list[tuple[Any, ...]]) -> None:
        insert = self.head + f"({', '.join('?' * len(self.columns))}) ON CONFLICT DO NOTHING"
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(insert, rows)
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise

    def _write_pg(self, rows: list[tuple[Any, ...]]) -> None:
        one = "(" + ", ".join(["%s"] * len(self.columns)) + ")"
        insert = self.head + ", ".join([one] * len(rows)) + " ON CONFLICT DO NOTHING"
        self.conn.execute(insert, [v for r in rows for v in r])


class CheckedFloor(RowFloor):
    """:class:`RowFloor` with the checks every submit must make before its row is written, and
    nothing else of the product: what a durable submit costs in Python on this stack once it is
    as safe as the seeds ask, whoever writes it. Per request: the bearer token's digest looked up
    (401; the product's cache), the body bounded (413) and decoded with the product's bounds (400),
    and its fields checked with the product's own checks (the same cost as the product's): the
    invocation_id a ULID, the queue a name, ``function`` and ``code_context`` bounded documents,
    ``args_blob`` bytes, ``run_config``'s keys strings, its size and depth bounded and its limits
    in range, every JSON column JSON data; then the row's derived columns (the function's key, the
    content hash that tells a repeat from a clash, the idempotency key, the priority). Still no
    auth table, quota, wake-up, poll hand-off, metrics, warnings or outage handling. An unknown
    token is taken too (the floor has no token store): only the lookup's cost counts."""

    def __init__(self, db: str) -> None:
        from dreamlake.lakeshore.server import http
        from dreamlake.lakeshore.server.config import ServerConfig
        from dreamlake.lakeshore.store import values
        from dreamlake.lakeshore.store.api import SubmitRequest

        super().__init__(db)
        self.tokens: dict[str, Any] = {}
        self.max_body = ServerConfig().max_body_bytes
        self.checks = (http, values, SubmitRequest)  # the product's own, imported once

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        http, values, SubmitRequest = self.checks
        if scope["type"] != "http":
            return
        secret, declared = b"", 0
        for name, value in scope["headers"]:
            if name == b"authorization":
                secret = value.partition(b" ")[2].strip()
            elif name == b"content-length":
                declared = int(value)
        self.tokens.get(hashlib.sha256(secret).hexdigest())
        if declared > self.max_body:
            raise RuntimeError(f"a body of {declared} bytes: the floor's load sends small ones")
        req = http.decode_msgpack(await _body(receive))
        invocation_id = http.ulid_field(req, "invocation_id")
        run_config = http.field(req, "run_config", dict, default={})
        queue = http.name(req.get("queue") or run_config.get("queue") or "default", "queue")
        function = http.document(req, "function")
        args_blob = http.field(req, "args_blob", bytes)
        code_context = http.document(req, "code_context", default={})
        http.ulid_field(req, "parent_invocation_id", optional=True)
        if not all(isinstance(key, str) for key in run_config):
            raise RuntimeError("run_config keys must be strings")
        values.check_run_config(http.bound_document(run_config, "run_config"))
        run_config, run_config_text = values.json_encoded(run_config, "run_config")
        function, function_text = values.json_encoded(function, "function")
        code_context, code_context_text = values.json_encoded(code_context, "code_context")
        submit = SubmitRequest(invocation_id, queue, function, args_blob, run_config, code_context)
        row = {
            **self.template,
            "invocation_id": invocation_id,
            "queue": queue,
            "args_blob": args_blob,
            "function": function_text,
            "run_config": run_config_text,
            "code_context": code_context_text,
            "function_key": values.function_key(function, function_text),
            "content_hash": values.content_hash(submit, queue, run_config),
            "idempotency_key": values.idempotency_key(run_config),
            "priority": values.normalize_priority(run_config.get("priority")),
        }
        await self._committed(tuple(row[c] for c in self.columns))
        await _answer(send, {"invocation_id": invocation_id, "queue": queue})


async def _answer(send: Send, value: Any) -> None:
    """A 200 of ``value`` in msgpack."""
    data = msgpack.packb(value)
    headers = [(b"content-type", b"application/x-msgpack"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def serve(port: int, db_path: str, app: str = "floor") -> None:
    import uvicorn

    loop = "uvloop" if has("uvloop") else "asyncio"
    uvicorn.run(
        {"row": RowFloor, "checked": CheckedFloor}.get(app, Floor)(db_path),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        loop=loop,
        http=hello_parser(),
        access_log=False,
        lifespan="off",
    )


# -- load processes ------------------------------------------------------------------------------


def _worker(c: Client) -> int:
    """Long-poll, take a call, run the noop, ack it on the next poll; until the STOP call."""
    worker, done = ulid(), 0
    acks: list[dict[str, Any]] = []
    while True:
        status, answer = c.post("/poll", {"worker": worker, "queue": QUEUE, "acks": acks, "wait_s": 5.0})
        if status != 200:
            raise RuntimeError(f"poll answered {status}: {answer}")
        done += len(acks)
        calls = answer["calls"]
        acks = [{"id": call["id"], "result": NOOP_RESULT} for call in calls]  # the noop
        if any(call["args"] == STOP for call in calls):
            c.post("/poll", {"worker": worker, "queue": QUEUE, "acks": acks, "wait_s": 0})
            return done


def _submit(c: Client, call_id: str, args: bytes) -> None:
    status, answer = c.post("/submit", {"id": call_id, "queue": QUEUE, "args": args, "wait_s": 60.0})
    if status != 200 or answer.get("state") != "succeeded" or answer.get("result") != NOOP_RESULT:
        raise RuntimeError(f"submit {call_id} answered {status}: {answer}")


def _producer(
    c: Client, n: int, server_pid: int
) -> tuple[list[float], list[tuple[str, float, float]], float]:
    """``n`` timed calls after ``WARMUP``; their seconds, (id, sent, answered) wall stamps, and the
    server's CPU ms per timed call; then the STOP call."""
    ids = [ulid() for _ in range(WARMUP + n)]
    for call_id in ids[:WARMUP]:
        _submit(c, call_id, NOOP_ARGS)
    times, stamps = [], []
    cpu0 = cpu_seconds(server_pid)
    for call_id in ids[WARMUP:]:
        w0, t0 = time.time(), time.perf_counter()
        _submit(c, call_id, NOOP_ARGS)
        times.append(time.perf_counter() - t0)
        stamps.append((call_id, w0, time.time()))
    cpu = (cpu_seconds(server_pid) - cpu0) * 1000 / n
    _submit(c, ulid(), STOP)
    return times, stamps, cpu


def _load(role: str, port: int, n: int, server_pid: int, go: Any, out: Any) -> None:
    c = Client(port, None)
    go.wait()
    out.put((role, _worker(c) if role == "worker" else _producer(c, n, server_pid)))


# -- the measurement -----------------------------------------------------------------------------


def _measure(calls: int) -> tuple[list[float], float, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "floor.db"
        port = free_port()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port), str(db)]
        with _process(cmd, port) as pid:
            outputs = dict(in_processes(_load, [("worker", port, 0, pid), ("producer", port, calls, pid)]))
            times, stamps, cpu = outputs["producer"]
            if outputs["worker"] != WARMUP + calls:
                raise RuntimeError(f"the worker acked {outputs['worker']} of {WARMUP + calls} calls")
            parts = split(db, stamps, "SELECT id, submitted, started, finished FROM calls")
    return times, cpu, parts


def floor_round_trip(calls: int) -> tuple[list[float], float]:
    """``calls`` sequential round trips through the floor server (seconds each, after a warm-up),
    and the floor server's CPU ms per call over them."""
    times, cpu, _parts = _measure(calls)
    return times, cpu


def _submits(port: int, n: int, app: str, go: Any, out: Any) -> None:
    """``n`` submits one per request, each answered at once: to :class:`Floor` (``app``
    "floor"), a small body with ``wait_s`` 0 (no worker takes them); to :class:`RowFloor` and
    :class:`CheckedFloor` ("row", "checked"), the product bench's body (and, checked, a token)."""
    row = app != "floor"
    c = Client(port, "floor-token" if app == "checked" else None)
    go.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        body = submit_body(QUEUE) if row else {"id": ulid(), "queue": QUEUE, "args": NOOP_ARGS, "wait_s": 0}
        status, answer = c.post("/submit", body)
        if status != 200 or ("invocation_id" not in answer if row else answer.get("state") != "queued"):
            raise RuntimeError(f"submit answered {status}: {answer}")
    out.put((t0, time.perf_counter(), n))


def floor_submit_rate(
    producers: int, n: int, app: str = "floor", pg: str | None = None
) -> tuple[float, float]:
    """Submits/s through a floor server, one per request, from ``producers`` load processes of
    ``n`` each, and the floor server's CPU ms per submit, beside the hello-world that answers
    without writing anything. ``app``: ``floor`` (:class:`Floor`: a ``BEGIN IMMEDIATE``, an insert
    into a small table and a ``COMMIT`` per submit, then its row read back), ``row``
    (:class:`RowFloor`: lakeshore's own row and table, group commits) or ``checked``
    (:class:`CheckedFloor`: that, after the checks every submit must make), on a SQLite file, or
    with ``pg`` (a PostgreSQL URL; ``row`` or ``checked``) in a fresh database of that server."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        db = stack.enter_context(pg_database(pg)) if pg else str(Path(tmp) / "floor.db")
        port = free_port()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port), db, "--app", app]
        pid = stack.enter_context(_process(cmd, port))
        cpu = cpu_seconds(pid)
        rate, total = run_load(_submits, [(port, n, app)] * producers)
        return rate, (cpu_seconds(pid) - cpu) * 1000 / total


HEADER = f"{'path':<42} {'p50 ms':>8} {'p90 ms':>8} {'x hello':>8} {'server cpu ms/call':>19}"


def submit_floors(producers: int, jobs: int, pg: str | None, rounds: int = 1) -> None:
    """``--submits``: the submit floors and lakeshore's single submits (a SQLite file; with ``pg``,
    PostgreSQL too), each beside the same period's hello-world: every server once a round, in an
    order rotated each round, each figure against its own round's hello-world; printed, each
    server's median, range and the rounds it reached 0.5x hello (a single period's ratio swings
    with the machine: 0.31-0.63x for the same floor in four runs)."""
    from control_plane import hello_rate, submit_rate

    per = max(200, jobs // producers)
    print(f"single submits, one per request, {producers} load processes; {os.cpu_count()} cores")
    cases = [
        ("hello-world (Starlette, the same stack)", lambda: hello_rate(producers, per)),
        (
            "floor: bare ASGI + sqlite3, a small table, 1 commit each",
            lambda: floor_submit_rate(producers, per),
        ),
        (
            "floor: bare ASGI + sqlite3, lakeshore's row, group commit",
            lambda: floor_submit_rate(producers, per, "row"),
        ),
        (
            "floor: the same + the checks every submit must make",
            lambda: floor_submit_rate(producers, per, "checked"),
        ),
        ("lakeshore server, SQLite", lambda: submit_rate(producers, per)),
    ]
    if pg:
        cases += [
            (
                "floor: bare ASGI + psycopg, lakeshore's row, group commit",
                lambda: floor_submit_rate(producers, per, "row", pg),
            ),
            ("lakeshore server, PostgreSQL (--workers 1)", lambda: submit_rate(producers, per, pg)),
        ]
    figures = submit_rounds([measure for _, measure in cases], rounds)
    print(
        f"{rounds} rounds, each server once a round in a rotated order; x hello against its own round's "
        "hello-world; goal >= 0.5x"
    )
    print(
        f"{'server':<64} {'req/s p50':>9} {'x hello p50':>11} {'min':>6} {'max':>6} {'>= 0.5x':>8} "
        f"{'cpu ms p50':>10}"
    )
    for (name, _), (rates, ratios, cpus) in zip(cases, figures, strict=True):
        met = sum(r >= 0.5 for r in ratios)
        print(
            f"{name:<64} {percentile(rates, 0.5):>9,.0f} {percentile(ratios, 0.5):>10.2f}x "
            f"{min(ratios):>5.2f}x {max(ratios):>5.2f}x {f'{met}/{rounds}':>8} {percentile(cpus, 0.5):>10.3f}"
        )


def submit_rounds(
    measures: list[Callable[[], tuple[float, float]]], rounds: int
) -> list[tuple[list[float], list[float], list[float]]]:
    """Each of ``measures`` (the first: the hello-world) once a round, the order rotated by one
    each round; per measure its rates, its ratios to the same round's hello-world and its CPU ms."""
    out: list[tuple[list[float], list[float], list[float]]] = [([], [], []) for _ in measures]
    for n in range(rounds):
        order = [(i + n) % len(measures) for i in range(len(measures))]
        got = {i: measures[i]() for i in order}
        for i, (rate, cpu) in got.items():
            out[i][0].append(rate)
            out[i][1].append(rate / got[0][0])
            out[i][2].append(cpu)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="sequential timed calls")
    ap.add_argument("--serve", nargs=2, metavar=("PORT", "DB"), help="run the floor server (internal)")
    ap.add_argument(
        "--app", choices=("floor", "row", "checked"), default="floor", help="which floor --serve runs"
    )
    ap.add_argument("--submits", action="store_true", help="the submit floors beside hello-world")
    ap.add_argument("--producers", type=int, default=4, help="load processes (--submits)")
    ap.add_argument("--jobs", type=int, default=6000, help="submits per figure (--submits)")
    ap.add_argument("--rounds", type=int, default=1, help="alternated rounds of every figure (--submits)")
    ap.add_argument(
        "--pg", default=os.environ.get("LAKESHORE_TEST_PG_URL"), help="PostgreSQL too (--submits)"
    )
    args = ap.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], args.app)
        return
    if args.submits:
        submit_floors(args.producers, args.jobs, args.pg, args.rounds)
        return
    hello = hello_round_trip(args.calls)
    times, cpu, parts = _measure(args.calls)
    h50, h90 = median_p90(hello)
    p50, p90 = median_p90(times)
    print(
        f"floor of the warm round trip, noop, loopback, SQLite file; {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}; {args.calls} sequential calls after {WARMUP} untimed; "
        f"uvicorn ({'uvloop' if has('uvloop') else 'asyncio'}, {hello_parser()})"
    )
    print(f"baseline: Starlette hello-world on the same stack, one POST: p50 {ms(h50)} ms, p90 {ms(h90)} ms")
    print(HEADER)
    name = "floor (bare ASGI + sqlite3, 2 commits)"
    print(f"{name:<42} {ms(p50):>8} {ms(p90):>8} {p50 / h50:>7.1f}x {cpu:>19.2f}")
    print("    where it goes (p50 ms): " + ", ".join(f"{k} {ms(v)}" for k, v in parts.items()))
    print(
        "the floor: the least this design (submit?wait, a long-polling worker, its ack on the next poll; "
        "two durable commits per call) costs in Python on this machine, with none of lakeshore's features"
    )


if __name__ == "__main__":
    main()
