"""A fleet of simulated daemons against a real ``lakeshore server``: wake latency, CPU and memory.

For each fleet size N a fresh ``lakeshore server`` subprocess (or two replicas over one PostgreSQL
database) is started, and this process plays N daemons with a cheap client (raw asyncio streams,
HTTP/1.1 keep-alive, msgpack): each registers, holds a long poll (``timeout_s`` 20, ``max`` 1) on a
connection of its own, heartbeats at the period the server answers (10 s) and acks what it claims
on a second connection. With all N polls waiting, a producer submits one invocation at a time and
the time from sending the submit to the claiming poll's answer is recorded. Printed per N:

- submit -> claim p50 / p99, beside the goal (p99 <= 20 ms at N = 1,000);
- polls woken per submit (by a wake-up, or handed the submit: their pass joins its transaction),
  and poll passes (store transactions run by polls, from
  ``lakeshore_poll_passes``) per submit less the idle fleet's rate (its polls renewing);
- server CPU per submit (psutil, less the idle rate) and idle server CPU (the fleet's heartbeats
  and poll renewals; ``--heartbeat-s 1e9`` leaves the renewals alone);
- server RSS with the fleet waiting, and RSS per idle poll: the RSS growth from before the fleet
  connected to all N polls waiting, over N (it includes each daemon's worker row and its side
  connection while open: the server keeps a silent connection open 30 s, past the heartbeat period);
- this client's own CPU while measuring (% of one core): near 100 % it would be the bottleneck.

The fleet is measured in its steady state: each daemon's first poll ends at a random point of the
poll period, so renewals are spread out as in a fleet that has run a while, and the fleet waits
``--settle-s`` (40 s) first. An idle daemon's renewals and heartbeats are answered from memory, but
each is still written every 30-60 s (``server/idle.py``): the window measured includes those writes.

With ``--replicas 2`` the producer talks to replica 1 and every daemon to replica 2, so each wake
crosses replicas over PostgreSQL LISTEN/NOTIFY. ``--server-root`` runs the server from another
checkout (e.g. the code before the poll hub) for a before/after table.

Run: ``.venv/bin/python bench/fleet.py [--store sqlite|postgresql] [--replicas 1|2] [--quick]``
(PostgreSQL from ``LAKESHORE_TEST_PG_URL``; a scratch database is created and dropped). The figures
depend on the machine and its load: print them, never assert them. On a shared Linux machine with
autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) ``nice`` only ranks processes
of one session: to put the bench ahead of other sessions' work, give it a session of its own with
a raised group priority, as root: ``setsid sh -c 'echo -5 > /proc/self/autogroup; exec nice -n -5
.venv/bin/python bench/fleet.py'``. Not with ``--store postgresql`` on a quiet machine: every
PostgreSQL backend is a session (an autogroup) of its own, so a raised bench group outweighs them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
from _stats import percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dreamlake.lakeshore.ids import new_ulid  # noqa: E402
from tests.integration.conftest import submit_body  # noqa: E402
from tests.stack.ports import free_port  # noqa: E402
from tests.stack.wait import until_async  # noqa: E402

# a daemon's capacity and poll offer as nymph sends them (no GPUs, its automatic labels)
CAPACITY = {"cpus": 8, "memory_mb": 32768, "gpus": [], "arch": "x86_64", "os": "linux"}
OFFER = {"gpus": 0, "labels": {"arch": "x86_64", "os": "linux"}}
POLL_TIMEOUT_S = 20.0
GOAL_P99_S = 0.020
GOAL_N = 1000
PG_ENV = "LAKESHORE_TEST_PG_URL"
MSGPACK = "application/x-msgpack"


# -- a cheap HTTP/1.1 client ------------------------------------------------------------------------


class Conn:
    """One keep-alive connection; one request at a time (callers hold ``lock`` when they share it)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.auth = f"Authorization: Bearer {token}\r\n".encode()
        self.lock = asyncio.Lock()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any, dict[str, str]]:
        """One request; reconnects once when the server closed the idle connection (uvicorn does
        after its keep-alive window), as any keep-alive client does."""
        data = msgpack.packb(body, use_bin_type=True) if body is not None else b""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: {MSGPACK}\r\n"
            f"Content-Length: {len(data)}\r\n"
        ).encode()
        for tries in range(2):
            if self.writer is None or self.writer.is_closing():
                await self.open()
            assert self.reader is not None and self.writer is not None
            try:
                self.writer.write(head + self.auth + b"\r\n" + data)
                raw = await self.reader.readuntil(b"\r\n\r\n")
                break
            except (asyncio.IncompleteReadError, ConnectionError):
                await self.close()
                self.writer = None
                if tries:
                    raise
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("content-type", "").startswith(MSGPACK):
            return status, msgpack.unpackb(payload, raw=False), headers
        return status, payload, headers

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


# -- servers ----------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    profiled: bool = False  # runs under bench/_sampler.py, which writes its samples on SIGINT
    ps: psutil.Process = field(init=False)

    def __post_init__(self) -> None:
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)


def _start_server(db: str, data: Path, server_root: Path, log: Path, profile: Path | None = None) -> Server:
    # a PostgreSQL control plane seals secrets under a key kept outside the database: every server
    # this bench starts shares one, made for the run (its scratch database is dropped after)
    os.environ.setdefault("LAKESHORE_SERVER_KEY", secrets.token_hex(32))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{server_root}:{server_root / 'runners'}"}
    prof = [str(Path(__file__).with_name("_sampler.py")), str(profile)] if profile is not None else []
    cmd = [sys.executable, *prof, "-m", "dreamlake.lakeshore.cli", "--log-level", "warning", "server"]
    cmd += ["--port", str(port), "--data-dir", str(data), "--db", db]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=server_root, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, port, profiled=profile is not None)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"lakeshore server exited ({proc.returncode}); see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"lakeshore server did not listen; see {log}") from None
            time.sleep(0.1)


def _stop(server: Server) -> None:
    if server.profiled:
        server.proc.send_signal(signal.SIGINT)
    else:
        server.proc.terminate()
    try:
        server.proc.wait(15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


@contextlib.contextmanager
def _database(store: str, workdir: Path) -> Iterator[str]:
    if store == "sqlite":
        yield str(workdir / "lakeshore.db")
        return
    if not os.environ.get(PG_ENV):
        raise SystemExit(f"--store postgresql needs {PG_ENV}")
    from tests.contract.conftest import pg_database  # a scratch database, dropped after

    with pg_database() as url:
        yield url


async def _metrics(conn: Conn) -> dict[str, float]:
    """The server's Prometheus samples: ``name`` (summed over labels) and ``name{k="v"}``."""
    from prometheus_client.parser import text_string_to_metric_families

    async with conn.lock:
        status, body, _ = await conn.request("GET", "/metrics")
    assert status == 200, body
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value  # summed over labels
            if s.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


# -- the fleet --------------------------------------------------------------------------------------


class Fleet:
    def __init__(self, host: str, port: int, token: str, queue: str) -> None:
        self.host, self.port, self.token, self.queue = host, port, token, queue
        self.heartbeat_s: float | None = None  # None: the period the server answers
        self.claims: dict[str, asyncio.Future[float]] = {}
        self.in_poll = 0
        self.refused = 0
        self.stopping = False
        self.tasks: list[asyncio.Task[None]] = []
        self.conns: list[Conn] = []

    async def _daemon(self, side: Conn, poll: Conn, ready: asyncio.Event) -> None:
        worker = new_ulid()
        async with side.lock:
            status, out, _ = await side.request(
                "POST",
                "/v1/daemon/register",
                {"worker_id": worker, "queues": [self.queue], "runner": "bench", "capacity": CAPACITY},
            )
        assert status == 200, out
        period = self.heartbeat_s or float(out.get("heartbeat_s", 10.0))
        self.tasks.append(asyncio.create_task(self._heartbeats(side, worker, period)))
        await ready.wait()
        body = {
            "worker_id": worker,
            "queues": [self.queue],
            "max": 1,
            "timeout_s": POLL_TIMEOUT_S,
            "version": "bench",
            "offer": OFFER,  # what nymph's polls carry (docs/protocol.md "Placement")
        }
        # A fleet in its steady state renews its polls at random moments: the first poll of each
        # daemon ends at a random point of the period, as if it had been running for a while (a
        # fleet started at once, all renewing together, is the reconnect case, not this one).
        first = {**body, "timeout_s": POLL_TIMEOUT_S * random.uniform(0.2, 1.0)}
        while not self.stopping:
            self.in_poll += 1
            try:
                status, out, headers = await poll.request("POST", "/v1/daemon/poll", first or body)
                first = None
            finally:
                self.in_poll -= 1
            now = time.perf_counter()
            if status == 503:
                self.refused += 1
                await asyncio.sleep(float(headers.get("retry-after", "5")) * random.uniform(1.0, 1.5))
                continue
            assert status == 200, out
            for cmd in out["commands"]:
                if cmd["kind"] != "run":
                    continue
                inv = cmd["body"]["invocation_id"]
                fut = self.claims.get(inv)
                if fut is not None and not fut.done():
                    fut.set_result(now)
                ack = {
                    "invocation_id": inv,
                    "state": "succeeded",
                    "attempt": cmd["body"]["attempt"],
                    "worker_id": worker,
                    "result_blob": b"\x90",
                }
                async with side.lock:
                    status, out, _ = await side.request("POST", "/v1/daemon/ack", ack)
                assert status == 200, out

    async def _heartbeats(self, side: Conn, worker: str, period: float) -> None:
        await asyncio.sleep(random.uniform(0, period))
        while not self.stopping:
            async with side.lock:
                status, out, _ = await side.request(
                    "POST",
                    "/v1/daemon/heartbeat",
                    {"worker_id": worker, "running": [], "running_exec": [], "free_slots": 1},  # as nymph
                )
            assert status == 200, out
            await asyncio.sleep(period)

    async def start(self, n: int, ready: asyncio.Event) -> None:
        """Open every daemon's connections and register it (polls start when ``ready`` is set)."""
        gate = asyncio.Semaphore(64)

        async def one() -> None:
            side, poll = Conn(self.host, self.port, self.token), Conn(self.host, self.port, self.token)
            async with gate:
                await side.open()
                await poll.open()
            self.conns += [side, poll]
            await self._daemon(side, poll, ready)

        self.tasks += [asyncio.create_task(one()) for _ in range(n)]

    async def stop(self) -> None:
        self.stopping = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)


@dataclass
class Row:
    n: int
    p50: float
    p99: float
    passes: float | None  # poll passes per submit, less the idle fleet's rate (poll renewals)
    woken: float | None  # polls woken per submit
    cpu_ms: float
    idle_cpu: float
    rss: int
    rss_per_poll: float
    refused: int
    client_cpu: float  # this process's CPU while measuring, % of one core: is the client the bottleneck?
    # mean seconds from reaching the group commit to the answer, by kind, while measuring
    writes: dict[str, float] = field(default_factory=dict)


async def _measure(
    servers: list[Server],
    tokens: dict[str, str],
    n: int,
    submits: int,
    pg: bool,
    idle_window: float,
    heartbeat_s: float | None,
    settle_s: float,
) -> Row:
    host = "127.0.0.1"
    front, back = servers[0], servers[-1]
    queue = f"fleet-{new_ulid()}"
    admin = [Conn(host, s.port, tokens["admin"]) for s in servers]
    producer = Conn(host, front.port, tokens["admin"])  # an admin token may use every route
    for c in (*admin, producer):
        await c.open()

    async def waiting() -> float:
        samples = [await _metrics(a) for a in admin]
        return sum(m.get("lakeshore_polls_waiting", 0.0) for m in samples)

    async def relays_up() -> bool:
        samples = [await _metrics(a) for a in admin]
        return all(m.get("lakeshore_relay_listening", 1.0) == 1.0 for m in samples)

    async def write_times() -> dict[str, tuple[float, float]]:
        """``lakeshore_write_seconds`` (sum, count) by kind, over every replica."""
        out: dict[str, tuple[float, float]] = {}
        for m in [await _metrics(a) for a in admin]:
            for kind in WRITE_KINDS:
                total, count = out.get(kind, (0.0, 0.0))
                out[kind] = (
                    total + m.get(f'lakeshore_write_seconds_sum{{kind="{kind}"}}', 0.0),
                    count + m.get(f'lakeshore_write_seconds_count{{kind="{kind}"}}', 0.0),
                )
        return out

    async def passes() -> tuple[float, float] | None:
        """Poll passes (store transactions run by polls) so far: all of them, and those of polls
        woken for work (a wake-up, or a hand-off: the pass ran in the submit's transaction)."""
        samples = [await _metrics(a) for a in admin]
        found = [m for m in samples if "lakeshore_poll_passes_total" in m]
        if not found:
            return None
        return sum(m["lakeshore_poll_passes_total"] for m in found), sum(
            m.get(f'lakeshore_poll_passes_total{{reason="{reason}"}}', 0.0)
            for m in found
            for reason in ("woken", "handed")
        )

    has_hub = "lakeshore_polls_waiting" in await _metrics(admin[0])
    if has_hub and pg:
        await until_async(relays_up, "every replica to LISTEN", limit_s=120.0, step_s=0.1)
    rss0 = back.rss()
    fleet = Fleet(host, back.port, tokens["daemon"], queue)
    fleet.heartbeat_s = heartbeat_s
    ready = asyncio.Event()
    started = time.monotonic()
    await fleet.start(n, ready)
    await until_async(lambda: _ready(fleet, n), f"{n} daemons registered", limit_s=120.0, step_s=0.1)
    _progress(f"N={n}: {n} daemons registered after {time.monotonic() - started:.0f} s")
    ready.set()
    if has_hub:
        # polls renew every ~20 s, each with a pass: at any moment a few are not waiting
        await until_async(
            lambda: _equals(waiting, n - n // 50),
            f"{n - n // 50} of {n} polls waiting",
            limit_s=120.0,
            step_s=0.1,
        )
    else:
        await until_async(lambda: _const(fleet.in_poll == n), f"{n} polls sent", limit_s=120.0, step_s=0.1)
        await asyncio.sleep(2.0)
    await asyncio.sleep(1.0)
    rss = back.rss()
    if settle_s > 0:  # idle daemons are written every 30-60 s (server/idle.py): be past the first
        _progress(
            f"N={n}: {n} polls waiting after {time.monotonic() - started:.0f} s; settling {settle_s:g} s"
        )
        await asyncio.sleep(settle_s)
    _progress(f"N={n}: {n} polls waiting after {time.monotonic() - started:.0f} s; measuring")

    for s in servers:  # the profile covers the steady state: the idle fleet, then the submits
        if s.profiled:
            s.proc.send_signal(signal.SIGUSR1)
    cpu0, idle_passes0 = sum(s.cpu_s() for s in servers), await passes()
    await asyncio.sleep(idle_window)
    idle_rate = (sum(s.cpu_s() for s in servers) - cpu0) / idle_window
    idle_passes1 = await passes()
    idle_pass_rate = (
        (idle_passes1[0] - idle_passes0[0]) / idle_window if idle_passes0 and idle_passes1 else 0.0
    )

    loop = asyncio.get_running_loop()
    writes0 = await write_times()
    passes0 = await passes()
    cpu0, t0 = sum(s.cpu_s() for s in servers), time.monotonic()
    me = psutil.Process()
    client0 = sum(me.cpu_times()[:2])
    latencies: list[float] = []
    for _ in range(submits):
        inv = new_ulid()
        fut: asyncio.Future[float] = loop.create_future()
        fleet.claims[inv] = fut
        sent = time.perf_counter()
        async with producer.lock:
            status, out, _ = await producer.request("POST", "/v1/producer/submit", submit_body(inv, queue))
        assert status == 200, out
        latencies.append(await asyncio.wait_for(fut, 60) - sent)
        del fleet.claims[inv]
        await asyncio.sleep(0.02)  # the winner acks and polls again: one submit at a time
        while fleet.in_poll < n:
            await asyncio.sleep(0.005)
    elapsed = time.monotonic() - t0
    client_cpu = (sum(me.cpu_times()[:2]) - client0) / elapsed * 100
    busy = sum(s.cpu_s() for s in servers) - cpu0 - idle_rate * elapsed
    passes1 = await passes()
    writes1 = await write_times()
    writes = {
        kind: (writes1[kind][0] - writes0[kind][0]) / (writes1[kind][1] - writes0[kind][1])
        for kind in WRITE_KINDS
        if writes1[kind][1] > writes0[kind][1]
    }
    await fleet.stop()
    for c in (*admin, producer):
        await c.close()
    return Row(
        n=n,
        p50=percentile(latencies, 0.5),
        p99=percentile(latencies, 0.99),
        passes=(passes1[0] - passes0[0] - idle_pass_rate * elapsed) / submits
        if passes0 and passes1
        else None,
        woken=(passes1[1] - passes0[1]) / submits if passes0 and passes1 else None,
        cpu_ms=max(0.0, busy) / submits * 1000,
        idle_cpu=idle_rate * 100,
        rss=rss,
        rss_per_poll=(rss - rss0) / n,
        refused=fleet.refused,
        client_cpu=client_cpu,
        writes=writes,
    )


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _ready(fleet: Fleet, n: int) -> bool:
    return len(fleet.tasks) >= 2 * n  # each daemon task added its heartbeat task after registering


async def _equals(probe: Any, n: int) -> bool:
    return bool(await probe() >= n)


async def _const(value: bool) -> bool:
    return value


def run(
    store: str,
    replicas: int,
    sizes: list[int],
    submits: int,
    server_root: Path,
    idle_s: float,
    heartbeat_s: float | None,
    profile: bool = False,
    settle_s: float = 0.0,
) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="lakeshore-fleet-") as tmp:
        work = Path(tmp)
        log = work / "server.log"
        for n in sizes:
            with _database(store, work / f"n{n}") as db:
                servers: list[Server] = []
                try:
                    for i in range(replicas):
                        prof = _profile_path(store, n, i) if profile else None
                        servers.append(
                            _start_server(db, work / f"n{n}" / f"replica{i}", server_root, log, prof)
                        )
                    tokens = json.loads((work / f"n{n}" / "replica0" / "tokens.json").read_text())
                    pg = store == "postgresql"
                    rows.append(
                        asyncio.run(_measure(servers, tokens, n, submits, pg, idle_s, heartbeat_s, settle_s))
                    )
                finally:
                    for s in servers:
                        _stop(s)
            _print_row(rows[-1])
            _log_errors(log)
            if profile:
                import _sampler

                for i in range(replicas):
                    print(
                        f"\nprofile: replica {i} at N={n}, the idle fleet and the submits "
                        f"(samples kept in {_profile_path(store, n, i)})"
                    )
                    _sampler.report(
                        str(_profile_path(store, n, i)),
                        top=25,
                        skip=("threading.py", "thread.py", "runpy", "_sampler"),
                    )
    return rows


def _profile_path(store: str, n: int, replica: int) -> Path:
    """Where a profiled server's samples are kept (``bench/_sampler.py`` JSON, for a closer look)."""
    return Path(tempfile.gettempdir()) / f"lakeshore-fleet-profile-{store}-n{n}-r{replica}.json"


def _log_errors(log: Path) -> None:
    """Say so when the server logged errors (a bench over a failing server measures the failure)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    errors = [line for line in text.splitlines() if "ERROR" in line or line.startswith("Traceback")]
    if errors:
        print(f"  the server logged {len(errors)} error lines; the first: {errors[0][:300]}", flush=True)
        tail = text[text.find(errors[0]) :].splitlines()[:40]
        print("    " + "\n    ".join(tail), flush=True)
    log.write_text("")


WRITE_KINDS = ("submit", "poll", "heartbeat", "ack")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


HEADER = (
    f"{'daemons':>8} | {'submit->claim p50':>17} | {'p99':>9} | {'goal':>16} | {'woken/submit':>12} | "
    f"{'passes/submit':>13} | "
    f"{'CPU/submit':>10} | {'idle CPU':>8} | {'server RSS':>10} | {'RSS/idle poll':>13} | {'client CPU':>10}"
)


def _print_row(r: Row) -> None:
    goal = "-"
    if r.n >= GOAL_N:
        goal = ("met" if r.p99 <= GOAL_P99_S else "MISSED") + " (<=20 ms)"
    passes = f"{r.passes:.2f}" if r.passes is not None else "-"
    woken = f"{r.woken:.2f}" if r.woken is not None else "-"
    refused = f"  ({r.refused} polls refused 503)" if r.refused else ""
    print(
        f"{r.n:>8} | {_ms(r.p50):>17} | {_ms(r.p99):>9} | {goal:>16} | {woken:>12} | {passes:>13} | "
        f"{r.cpu_ms:>7.2f} ms | {r.idle_cpu:>7.1f}% | {r.rss / 2**20:>6.0f} MiB | "
        f"{r.rss_per_poll / 1024:>9.1f} KiB | {r.client_cpu:>9.1f}%{refused}",
        flush=True,
    )
    if r.writes:  # where a submit's and a claim's time goes: the group commit's share
        parts = ", ".join(f"{kind} {_ms(seconds)}" for kind, seconds in r.writes.items())
        print(f"{'':>8}   group commit, queued to answered (mean): {parts}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=["sqlite", "postgresql"], default="sqlite")
    ap.add_argument(
        "--replicas", type=int, default=1, help="PostgreSQL only: 2 puts daemons and producer apart"
    )
    ap.add_argument("--sizes", default=None, help="fleet sizes, comma-separated (default 1,100,1000)")
    ap.add_argument(
        "--submits",
        type=int,
        default=None,
        help="submits measured per size (default 1000: the p99 of 200 is the second-worst value, of "
        "1000 the tenth, so it moves less from run to run)",
    )
    ap.add_argument("--quick", action="store_true", help="sizes 1,100 and 40 submits")
    ap.add_argument(
        "--heartbeat-s", type=float, default=None, help="heartbeat period (default: the server's)"
    )
    ap.add_argument("--idle-s", type=float, default=5.0, help="window the idle CPU is measured over")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="seconds the waiting fleet runs before it is measured (default 40; 0 with --quick): "
        "past the first writes the server makes of each idle daemon, 30-60 s after its last",
    )
    ap.add_argument("--server-root", type=Path, default=ROOT, help="checkout the server runs from")
    ap.add_argument(
        "--profile", action="store_true", help="sample where each server's threads spend their CPU"
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    if args.replicas < 1 or (args.replicas > 1 and args.store != "postgresql"):
        raise SystemExit("--replicas above 1 needs --store postgresql (replicas share one database)")
    sizes = [int(x) for x in (args.sizes or ("1,100" if args.quick else "1,100,1000")).split(",")]
    submits = args.submits or (40 if args.quick else 1000)
    settle_s = args.settle_s if args.settle_s is not None else (0.0 if args.quick else 40.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * max(sizes) + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < need:
        raise SystemExit(f"open-file limit {soft} is below the {need} this fleet needs: raise `ulimit -n`")
    print(
        f"fleet: store {args.store}, {args.replicas} replica(s), {submits} submits one at a time, "
        f"polls timeout_s {POLL_TIMEOUT_S:g}, measured after {settle_s:g} s waiting; server from {args.server_root}; {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at start; open-file limit {soft}"
    )
    print(HEADER)
    run(
        args.store,
        args.replicas,
        sizes,
        submits,
        args.server_root,
        args.idle_s,
        args.heartbeat_s,
        args.profile,
        settle_s,
    )


if __name__ == "__main__":
    main()
