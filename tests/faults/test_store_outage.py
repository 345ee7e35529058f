"""PostgreSQL stopped for 30 s under load (issue 32, items 2-4).

The control plane runs over a PostgreSQL cluster of the test's own (started on a free port with
scripts/services/postgres.sh, stopped and started again by the test, removed at the end: never
the shared one other tests use). While a producer keeps submitting and a generator streams,
PostgreSQL is stopped for 30 s, then started again:

- no client sees a 500: every request meets a ``503 store unavailable: ...`` with ``Retry-After``
  (or a refused connection) and retries it;
- every submit that was answered is stored and every call ends ``succeeded``, each run once (a
  heartbeat the store could not take costs no attempt: lease expiry pauses meanwhile), the
  generator on attempt 1 with every frame in order;
- ``/healthz`` answers 503 with the cause during the outage and 200 after;
- the server logs the outage once, with the count of 503s, and no traceback per request.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dreamlake.lakeshore import wire
from tests.conftest import ROOT, require
from tests.faults.stack import Nymph, Producer, Server, Tally, free_port, kill_leftovers, ref, until, wait_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(150)]

OUTAGE_S = 30.0
SCRIPT = ROOT / "scripts" / "services" / "postgres.sh"


class PrivatePostgres:
    """A PostgreSQL cluster of this test's own on a free port (scripts/services/postgres.sh)."""

    def __init__(self) -> None:
        self.port = free_port()
        # not under pytest's 0700 tmp dir: the cluster runs as the postgres user, who must reach it
        self.base = Path(tempfile.mkdtemp(prefix="lakeshore-pg-outage-", dir="/tmp"))
        os.chmod(self.base, 0o755)
        self.data = self.base / f"pg-{self.port}" / "data"
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        env = {**os.environ, "LAKESHORE_SERVICES_DIR": str(self.base)}
        out = subprocess.run(
            ["bash", str(SCRIPT), str(self.port)], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]

    def _pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        cmd = [str(bins[-1]), "-D", str(self.data), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("-m", mode, "-w", "stop")

    def remove(self) -> None:
        if self.data.exists():
            self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    require(shutil.which("bash") is not None and SCRIPT.exists(), "scripts/services/postgres.sh")
    require(
        bool(list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))),
        "PostgreSQL server binaries (scripts/services/postgres.sh installs them)",
    )
    pg = PrivatePostgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


def health(server: Server) -> tuple[int, dict[str, object]]:
    try:
        resp = httpx.get(server.url + "/healthz", timeout=10)
    except httpx.HTTPError:
        return 0, {}
    return resp.status_code, resp.json()


def test_postgres_stopped_for_30s_under_load_is_a_503_and_costs_no_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the expiry sweep ten times a second: once the store is back it would expire every lease that
    # lapsed meanwhile before a heartbeat lands, unless expiry waits (a lease's length) for them
    monkeypatch.setenv("LAKESHORE_EXPIRE_EVERY_S", "0.1")
    with private_postgres() as pg:
        server = Server(tmp_path / "cp", "--db", pg.url)
        nymph: Nymph | None = None
        stop_load = threading.Event()
        try:
            server.start()
            marks = tmp_path / "marks"
            marks.mkdir()
            os.chmod(marks, 0o777)
            nymph = Nymph(server, tmp_path / "n", "--concurrency", "4", "--heartbeat-s", "1.0").start()
            producer = Producer(server)
            tally = Tally("postgres-outage", marks)
            warm = producer.submit(ref("double", str(marks), "warm", 1))
            tally.add(warm, "warm", 2)
            assert producer.await_(warm, 60.0)["state"] == "succeeded", nymph.output()[-3000:]

            # a generator that streams through the outage: 45 values, one a second
            stream = producer.submit(ref("count", str(marks), "stream", 45, 1.0))
            tally.keys[stream] = "stream"
            until(lambda: producer.frames(stream, -1, 1.0), "the generator's first frame")
            frames: list[wire.Frame] = []

            def follow() -> None:
                while not frames or frames[-1].kind == wire.FRAME_VALUE:
                    got = producer.frames(stream, frames[-1].seq if frames else -1, 2.0)
                    frames.extend(f for f in got if f.kind != wire.FRAME_LOG)

            def load() -> None:  # a call every 0.2 s, through the outage (each retried till stored)
                i = 0
                while not stop_load.is_set():
                    inv = producer.submit(ref("double", str(marks), f"k{i}", i))
                    tally.add(inv, f"k{i}", 2 * i)
                    i += 1
                    time.sleep(0.2)

            reader = threading.Thread(target=follow, daemon=True)
            submitter = threading.Thread(target=load, daemon=True)
            reader.start()
            submitter.start()
            until(lambda: len(tally.expected) > 5, "some load before the outage")

            pg.stop()
            stopped = time.monotonic()
            _, body = until(lambda: (h := health(server))[0] == 503 and h, "/healthz to say 503", 20)
            assert "store unavailable" in str(body.get("error")), body
            while time.monotonic() - stopped < OUTAGE_S:
                time.sleep(0.5)
            assert health(server)[0] == 503
            pg.start()
            until(lambda: health(server)[0] == 200, "/healthz to say 200 again", 30)
            time.sleep(3.0)  # some load after the outage
            stop_load.set()
            submitter.join(90)
            reader.join(90)
            assert not reader.is_alive(), "the stream did not end"

            wait_all(producer, tally, 90.0)
            counts = tally.report()
            print(f"[fault postgres-outage] statuses={dict(producer.statuses)} errors={producer.errors}")
            assert counts["lost"] == 0 and counts["wrong"] == 0 and counts["duplicated"] == 0, counts
            assert set(counts["executions_per_call"]) == {1}, counts  # none ran twice
            assert 500 not in producer.statuses, producer.errors
            assert producer.statuses[503] > 0 and b"store unavailable" in producer.errors[503]

            values = [f for f in frames if f.kind == wire.FRAME_VALUE]
            assert [wire.unpack(f.body) for f in values] == list(range(45)), frames[-3:]
            assert frames[-1].kind == wire.FRAME_END, frames[-1]
            out = until(
                lambda: (o := producer.status(stream))["state"] != "running" and o, "the stream's ack"
            )
            assert out["state"] == "succeeded" and out["attempt"] == 1, out
            assert tally.executions(stream) == 1

            until(lambda: "store is back after" in server.output(), "the end of the outage logged", 30)
            log = server.output()
            assert "Traceback" not in log, log[-6000:]
            assert 1 <= log.count("store unavailable:") <= 3, log[-6000:]
            assert "store is back after" in log, log[-6000:]
            assert log.count("wake-up relay: NOTIFY failed") <= 1, log[-6000:]  # once, not per retry
            assert log.count("wake-up relay: LISTEN connection failed") <= 1, log[-6000:]
            nlog = nymph.output()
            assert "HTTP 500" not in nlog and "Traceback" not in nlog, nlog[-6000:]
            assert "store unavailable" in nlog, nlog[-6000:]  # its one "went away" line names the cause
            producer.close()
        finally:
            stop_load.set()
            if nymph is not None:
                nymph.stop()
            server.stop()
            kill_leftovers(tmp_path)
