"""Group commit keeps durability: ``kill -9`` of a control plane under submit and ack load loses no
write it answered 200 to.

The server is ``lakeshore server`` in a subprocess; producers and daemons (threads here) record
every submit and ack the server confirmed; after the kill the store is reopened and every confirmed
submit must be there, every confirmed ack recorded.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from dreamlake.lakeshore.store import open_store
from tests.integration.load import Load, server_process


def check_durable(
    db: str, submitted: set[str], acked: set[str], framed: dict[str, int] | None = None
) -> None:
    store = open_store(db)
    try:
        short = {i: n for i, n in (framed or {}).items() if len(store.read_frames(i)) < n}
        assert short == {}, f"{len(short)} confirmed batches of frames lost"
        missing = [i for i in submitted if store.get(i) is None]
        assert missing == [], f"{len(missing)} confirmed submits lost"
        states = {i: getattr(store.get(i), "state", None) for i in acked}
        lost = {i: s for i, s in states.items() if s != "succeeded"}
        assert lost == {}, f"{len(lost)} confirmed acks lost"
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_kill_9_under_load_loses_no_confirmed_write(kind: str, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            db = str(tmp_path / "crash.db")
        else:
            from tests.contract.conftest import pg_database

            db = stack.enter_context(pg_database())
        with server_process(db, tmp_path) as (proc, url, token):
            with Load(url, token, frames=3) as load:
                load.wait_for(submitted=300, acked=100)
                os.killpg(proc.pid, signal.SIGKILL)  # mid-load: writes are queued and in flight
                proc.wait(10)
            with load.lock:
                submitted, acked, framed = set(load.submitted), set(load.acked), dict(load.framed)
        assert framed, "no batch of frames was confirmed before the kill"
        check_durable(db, submitted, acked, framed)
