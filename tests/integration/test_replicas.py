"""Two control-plane replicas over one PostgreSQL, daemons and producers on both; one replica (a
``--workers 2`` server) is killed with ``kill -9`` under load. Nothing is lost: every submit either
replica confirmed ends ``succeeded``, and each invocation's outcome was taken exactly once (the
work the dead replica's daemons held comes back when its lease lapses, and runs on the survivor).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from pathlib import Path

from dreamlake.lakeshore.store import open_store
from tests.contract.conftest import pg_database
from tests.integration.load import Load, server_process

LEASE_S = "2"


def test_a_replica_killed_under_load_loses_nothing(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        db = stack.enter_context(pg_database())
        a_proc, a_url, token = stack.enter_context(
            server_process(db, tmp_path, "--workers", "2", "--lease-s", LEASE_S)
        )
        _b_proc, b_url, _ = stack.enter_context(server_process(db, tmp_path, "--lease-s", LEASE_S))
        on_a = stack.enter_context(Load(a_url, token, producers=2, daemons=2))
        on_b = stack.enter_context(Load(b_url, token, producers=2, daemons=2))
        on_a.wait_for(submitted=150, acked=50)
        on_b.wait_for(submitted=150, acked=50)
        os.killpg(a_proc.pid, signal.SIGKILL)  # replica A and both its workers, mid-load
        a_proc.wait(10)
        on_b.wait_for(submitted=len(on_b.submitted) + 100, acked=0)  # B keeps taking work
        on_b.stop_producing()
        with on_a.lock, on_b.lock:
            submitted = on_a.submitted | on_b.submitted
        store = stack.enter_context(contextlib.closing(open_store(db)))
        deadline = time.monotonic() + 120
        while True:
            states = collections.Counter(getattr(store.get(i), "state", None) for i in submitted)
            if states == {"succeeded": len(submitted)}:
                break
            assert time.monotonic() < deadline, f"not all confirmed submits succeeded: {states}"
            time.sleep(0.5)
        with on_a.lock, on_b.lock:
            taken = collections.Counter(on_a.acked + on_b.acked)
        assert [i for i, n in taken.items() if n > 1] == []  # no outcome taken twice
