"""What an operator meets on a long-lived nymph (issue 12, items 2 and 7): relative paths in its
flags, and kept failed workdirs and ``*.old-*`` directories that must not pile up forever."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dreamlake.lakeshore import ids
from tests.faults.stack import Nymph, Producer, ref, stack, until

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]


def test_relative_workdir_state_dir_and_token_file_work_with_the_prefork_runner(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        base = tmp_path / "n"
        n = Nymph(server, base)
        n.args = [
            {str(n.workdir): "work", str(n.state_dir): "state", str(base / "token"): "token"}.get(a, a)
            for a in n.args
        ]
        assert "work" in n.args and "token" in n.args
        n.cwd = base  # `cd base && nymph start --workdir work --state-dir state --token-file token`
        nymphs.append(n.start())
        producer = Producer(server)
        for i in range(3):
            inv = producer.submit(ref("double", str(marks), f"k{i}", i))
            out = producer.await_(inv, 60.0)
            assert out["state"] == "succeeded", (out, n.output()[-3000:])
        assert (base / "state" / "worker_id").is_file()
        producer.close()


def test_failed_workdirs_are_pruned_by_age(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        base = tmp_path / "n"
        workdir = base / "work"
        workdir.mkdir(parents=True)
        # an earlier attempt's workdir moved aside by a previous life: removed once reconciled
        old = workdir / f"{ids.new_ulid()}.old-{int(time.time()) - 10}"
        old.mkdir()
        (old / "stderr.log").write_text("an earlier attempt\n")
        n = Nymph(server, base, "--keep-failed-s", "3")
        nymphs.append(n.start())
        until(lambda: not old.exists(), "the .old- directory to be removed after reconciling", 30.0)
        producer = Producer(server)
        inv = producer.submit(ref("fail", str(marks), "f", 0))
        assert producer.await_(inv)["state"] == "failed"
        assert (workdir / inv / "stderr.log").exists(), "a failed workdir is kept for its logs"
        until(lambda: not (workdir / inv).exists(), "the failed workdir to be pruned by age", 30.0)
        producer.close()


def test_failed_workdirs_are_pruned_oldest_first_beyond_their_total_size(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        base = tmp_path / "n"
        # room for two failed workdirs of ~22 KiB each (a 20 KiB stderr.log), not three
        n = Nymph(server, base, "--keep-failed-mb", str(50 / 1024))
        nymphs.append(n.start())
        producer = Producer(server)
        failed = []
        for i in range(4):
            inv = producer.submit(ref("fail", str(marks), f"f{i}", 20 * 1024))
            assert producer.await_(inv)["state"] == "failed"
            failed.append(inv)
        until(
            lambda: not any((n.workdir / i).exists() for i in failed[:2]), "the two oldest to be pruned", 30.0
        )
        assert all((n.workdir / i / "stderr.log").exists() for i in failed[2:]), os.listdir(n.workdir)
        producer.close()
