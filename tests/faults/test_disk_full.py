"""A disk that fills (issue 12, item 1): nymph's workdir and state dir on a 4 MiB tmpfs.

A full disk is an outcome, never a crash: the call that meets it is acked ``failed`` with
``No space left on device`` in its message (not left to burn its leases into ``LeaseExpired``),
nymph says so in one log line, answers 503 on ``/healthz`` and claims nothing while the disk is
full, and resumes by itself once space is back; the calls queued meanwhile all succeed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dreamlake.lakeshore.envelope import Envelope
from tests.conftest import REQUIRE_SERVICES
from tests.faults.stack import Nymph, Producer, Tally, ref, stack, until, wait_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (we are root in CI); skipped where mounting is impossible."""
    where.mkdir(parents=True, exist_ok=True)
    reason = "mounting a tmpfs needs root (CI runs the suite as root)"
    if os.geteuid() == 0:
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        )
        if out.returncode == 0:
            try:
                yield where
            finally:
                subprocess.run(["umount", "-l", str(where)], capture_output=True)
            return
        reason = f"mount -t tmpfs failed: {out.stderr.decode(errors='replace').strip()}"
    if REQUIRE_SERVICES and os.geteuid() == 0:
        pytest.fail(f"the disk-full fault test cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte with one file; return it."""
    filler = disk / "filler"
    with open(filler, "wb") as fh:
        chunk = b"\0" * 65536
        with contextlib.suppress(OSError):
            while True:
                fh.write(chunk)
                fh.flush()
        with contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 512)
                fh.flush()
        with contextlib.suppress(OSError):
            fh.close()
    assert shutil.disk_usage(disk).free < 64 * 1024
    return filler


def test_a_full_disk_fails_the_call_it_meets_pauses_claims_and_resumes(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk") as disk, stack(tmp_path) as (server, nymphs, marks):
        # floor 0: the pre-claim check lets the first call through, so it meets ENOSPC in prepare
        n = Nymph(
            server, tmp_path / "n", "--min-free-mb", "0", "--concurrency", "2",
            workdir=disk / "work", state_dir=disk / "state",
        )  # fmt: skip
        nymphs.append(n.start())
        producer = Producer(server)
        warm = producer.submit(ref("double", str(marks), "warm", 1))
        assert producer.await_(warm)["state"] == "succeeded", n.output()[-3000:]
        until(lambda: n.health()[0] == 200, "nymph to be ready")

        gate = tmp_path / "gate"
        running = producer.submit(ref("hold", str(marks), "running", 1, str(gate)))
        until(lambda: (marks / "running").exists(), "a call to run before the disk fills")
        filler = fill(disk)
        first = producer.submit(ref("double", str(marks), "first", 2))  # meets ENOSPC in prepare
        out = producer.await_(first, 30.0)
        assert out["state"] == "failed", (out, n.output()[-3000:])
        assert "No space left on device" in out["error"]["message"], out
        gate.touch()  # the running call returns, and cannot write its result
        out = producer.await_(running, 30.0)
        assert out["state"] == "failed" and "No space left on device" in out["error"]["message"], out
        _, health = until(lambda: (h := n.health())[0] == 503 and h, "/healthz to say not ready")
        assert health["disk_ok"] is False and health["disk_problem"], health

        # while the disk is full nothing is claimed: the calls wait, queued
        tally = Tally("disk-full", marks)
        for i in range(5):
            tally.add(producer.submit(ref("double", str(marks), f"k{i}", i)), f"k{i}", 2 * i)
        time.sleep(3 * 2.0)  # three leases' worth: a black hole would have claimed (and burned) them
        assert {producer.status(i)["state"] for i in tally.expected} == {"queued"}, n.output()[-3000:]

        filler.unlink()  # space is back: nymph resumes by itself
        wait_all(producer, tally, 60.0)
        counts = tally.report()
        assert counts["lost"] == 0 and counts["wrong"] == 0 and counts["duplicated"] == 0
        assert counts["executions_per_call"] == {1: 5}
        until(lambda: n.health()[0] == 200, "/healthz to say ready again")
        log = n.output()
        assert log.count("disk full:") == 1, log[-4000:]
        assert log.count("disk space is back") == 1, log[-4000:]
        assert "Traceback" not in log and "Exception in thread" not in log, log[-4000:]
        producer.close()


def test_acks_written_before_the_disk_filled_and_acks_that_could_not_be_written_all_arrive(
    tmp_path: Path,
) -> None:
    """The outbox never loses a message on ENOSPC: one already on disk stays and is delivered; one
    that cannot be written is kept in memory and delivered (the control plane is away meanwhile)."""
    with small_tmpfs(tmp_path / "disk") as disk, stack(tmp_path) as (server, nymphs, marks):
        # the state dir alone on the small disk: the tasks write their results, the acks cannot
        n = Nymph(
            server, tmp_path / "n", "--min-free-mb", "0", "--concurrency", "2", state_dir=disk / "state"
        )
        nymphs.append(n.start())
        producer = Producer(server)
        tally = Tally("disk-full-outbox", marks)
        gates = [tmp_path / "gate-a", tmp_path / "gate-b"]
        for i, gate in enumerate(gates):
            tally.add(producer.submit(ref("hold", str(marks), f"k{i}", i, str(gate))), f"k{i}", 2 * i)
        until(lambda: sum(tally.executions(i) for i in tally.expected) == 2, "both calls to run")
        server.stop()
        outbox = n.state_dir / "outbox"
        gates[0].touch()
        until(lambda: list(outbox.glob("*.msg")), "the first ack on disk", 30.0)
        on_disk = sorted(outbox.glob("*.msg"))
        filler = fill(disk)
        gates[1].touch()  # its ack meets a full state dir
        until(lambda: "kept in memory, not on disk" in n.output(), "the second ack kept in memory", 30.0)
        assert sorted(outbox.glob("*.msg")) == on_disk  # nothing already written was lost
        server.start()
        wait_all(producer, tally, 60.0)
        counts = tally.report()
        assert counts["lost"] == 0 and counts["wrong"] == 0 and counts["duplicated"] == 0
        until(lambda: not list(outbox.glob("*.msg")), "the outbox to drain")
        filler.unlink()
        producer.close()


def test_the_sqlite_stores_disk_full_is_a_503_store_full_and_a_generator_finishes_on_attempt_1(
    tmp_path: Path,
) -> None:
    """The control plane's SQLite file on a small tmpfs that fills up (issue 32, items 2-4): a
    write meets ``503 store full: ...`` (not a 500), ``/healthz`` says so, the heartbeats that
    cannot be stored cost no lease (a generator streaming through finishes on attempt 1), and
    once space is back everything carries on over an intact database."""
    import sqlite3

    import httpx
    import msgpack

    from dreamlake.lakeshore import errors, ids, wire
    from dreamlake.lakeshore.dispatch.http import HttpDispatch
    from tests.faults.stack import Server, kill_leftovers
    from tests.integration.conftest import submit_body

    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        db = disk / "lakeshore.db"
        server = Server(tmp_path / "cp", "--db", str(db))
        nymph: Nymph | None = None
        try:
            server.start()
            marks = tmp_path / "marks"
            marks.mkdir()
            os.chmod(marks, 0o777)
            nymph = Nymph(server, tmp_path / "n", "--concurrency", "2").start()
            producer = Producer(server)
            warm = producer.submit(ref("double", str(marks), "warm", 1))
            assert producer.await_(warm, 60.0)["state"] == "succeeded", nymph.output()[-3000:]
            stream = producer.submit(ref("count", str(marks), "stream", 30, 0.5))
            until(lambda: producer.frames(stream, -1, 1.0), "the generator's first frame")

            with sqlite3.connect(db, timeout=10) as conn:  # the WAL emptied: writes need new room
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            filler = fill(disk)
            # submits of 200 KB arguments until one needs room the WAL does not have
            url = server.url + "/v1/producer/submit"
            headers = {"Authorization": f"Bearer {producer.token}", "Content-Type": "application/x-msgpack"}
            stored: list[str] = []
            for i in range(60):
                inv = ids.new_ulid()
                args = ref("double", str(marks), f"big{i}", i, 0.0, "x" * 200_000)
                body = submit_body(inv, "default", args_blob=args)
                resp = httpx.post(
                    url, content=msgpack.packb(body, use_bin_type=True), headers=headers, timeout=60
                )
                if resp.status_code != 200:
                    break
                stored.append(inv)
            assert resp.status_code == 503, (resp.status_code, resp.content[:300])
            assert resp.headers.get("retry-after"), resp.headers
            error = msgpack.unpackb(resp.content)["error"]
            assert error.startswith("store full: "), error
            # the SDK retries it as an outage, and its final error names the cause
            sdk = HttpDispatch(server.url, producer.token, retry_window=3.0)
            with pytest.raises(errors.Unavailable) as raised:
                sdk.submit(
                    Envelope.from_bytes(ref("double", str(marks), "sdk", 1, 0.0, "x" * 200_000)),
                    "default",
                    {},
                )
            assert "retry window" in str(raised.value) and "store full: " in str(raised.value), raised.value
            answer = httpx.get(server.url + "/healthz", timeout=10)
            assert answer.status_code == 503 and answer.json()["error"].startswith("store full: "), (
                answer.text
            )
            time.sleep(3 * 2.0)  # three leases' worth while heartbeats and frames cannot be stored

            filler.unlink()
            until(lambda: httpx.get(server.url + "/healthz", timeout=10).status_code == 200, "/healthz 200")
            assert producer.post("/v1/producer/submit", body)["invocation_id"] == inv  # now stored
            for each in [*stored, inv]:  # every answered submit was stored, and runs
                assert producer.await_(each, 60.0)["state"] == "succeeded"
            frames: list[wire.Frame] = []
            deadline = time.monotonic() + 60
            while (not frames or frames[-1].kind == wire.FRAME_VALUE) and time.monotonic() < deadline:
                got = producer.frames(stream, frames[-1].seq if frames else -1, 2.0)
                frames.extend(f for f in got if f.kind != wire.FRAME_LOG)
            assert [wire.unpack(f.body) for f in frames if f.kind == wire.FRAME_VALUE] == list(range(30))
            out = until(
                lambda: (o := producer.status(stream))["state"] != "running" and o, "the stream's ack"
            )
            assert out["state"] == "succeeded" and out["attempt"] == 1, out
            assert len((marks / "stream").read_text().splitlines()) == 1  # ran once
            assert 500 not in producer.statuses, producer.errors

            until(lambda: "store is back after" in server.output(), "the end of the outage logged", 30)
            log = server.output()
            assert "Traceback" not in log, log[-6000:]
            assert log.count("store full:") == 1, log[-6000:]
            producer.close()
            nymph.stop()
            server.stop()
            with sqlite3.connect(db) as conn:
                assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        finally:
            if nymph is not None:
                nymph.stop()
            server.stop()
            kill_leftovers(tmp_path)
