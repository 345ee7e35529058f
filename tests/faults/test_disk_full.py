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

from tests.conftest import REQUIRE_SERVICES
from tests.faults.stack import Nymph, Producer, Tally, ref, stack, until, wait_all


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
            server, tmp_path / "n", "--min-free-mb", "0", workdir=disk / "work", state_dir=disk / "state"
        )
        nymphs.append(n.start())
        producer = Producer(server)
        warm = producer.submit(ref("double", str(marks), "warm", 1))
        assert producer.await_(warm)["state"] == "succeeded", n.output()[-3000:]
        until(lambda: n.health()[0] == 200, "nymph to be ready")

        filler = fill(disk)
        first = producer.submit(ref("double", str(marks), "first", 2))
        out = producer.await_(first, 30.0)
        assert out["state"] == "failed", (out, n.output()[-3000:])
        assert "No space left on device" in out["error"]["message"], out
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
