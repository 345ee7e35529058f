"""store/outage.py: which store failures are outages (503) and not bugs (500), and the record of one."""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.outage import Outages, StoreOutage, classify, probe
from tests.stack.ports import free_port


def test_postgres_refusing_connections_is_store_unavailable_naming_where() -> None:
    port = free_port()  # nothing listens there
    engine = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres")
    with pytest.raises(sa.exc.OperationalError) as raised:
        engine.connect()
    outage = classify(raised.value)
    assert outage is not None and outage.kind == "unavailable" and outage.status == 503
    assert str(outage).startswith("store unavailable: cannot reach PostgreSQL (Connection refused at")
    assert str(port) in str(outage) and "\n" not in str(outage)


def test_sqlite_busy_past_its_timeout_is_unavailable_and_full_is_store_full(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    a = sqlite3.connect(path, timeout=0, isolation_level=None)
    b = sqlite3.connect(path, timeout=0, isolation_level=None)
    a.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as busy:
        b.execute("BEGIN IMMEDIATE")
    got = classify(sa.exc.OperationalError("BEGIN", {}, busy.value))
    assert got is not None and got.kind == "unavailable" and "busy" in got.cause
    full = classify(
        sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full"))
    )
    assert full is not None and str(full).startswith("store full: ")
    a.close()
    b.close()


def test_a_bug_is_no_outage() -> None:
    assert classify(ValueError("a bug")) is None
    assert classify(sa.exc.IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE failed"))) is None
    assert classify(sqlite3.OperationalError("no such column: x")) is None


def test_an_outage_is_logged_once_and_its_end_once_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    outages = Outages(hold_s=0.3, quiet_s=0.2)
    assert not outages.expiry_paused()
    caplog.set_level(logging.WARNING, "dreamlake.lakeshore.store.outage")
    for _ in range(25):
        outages.failed(StoreOutage("unavailable", "cannot reach PostgreSQL"))
        outages.succeeded()  # a write that fits between failures (a full disk's WAL room): no end
    for _ in range(25):
        outages.failed(StoreOutage("unavailable", "cannot reach PostgreSQL"))
    assert outages.expiry_paused()
    time.sleep(0.25)
    outages.succeeded()
    outages.succeeded()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("store unavailable: cannot reach PostgreSQL; answering 503")
    assert "store is back after" in lines[1] and "50 requests were answered 503" in lines[1]
    assert outages.expiry_paused()  # for hold_s after the last failure: heartbeats land first
    time.sleep(0.1)
    assert not outages.expiry_paused()


def test_a_quiet_plane_resumes_expiry_a_lease_after_the_last_failure() -> None:
    """No write comes after the outage (an idle fleet): expiry still resumes ``hold_s`` after
    the last failure, and its own committed pass is the write that ends the outage."""
    outages = Outages(hold_s=0.2, quiet_s=0.1)
    outages.failed(StoreOutage("full", "no space left on device"))
    assert outages.expiry_paused()
    time.sleep(0.25)
    assert outages.current is not None  # declared still: nothing has been written since
    assert not outages.expiry_paused()  # so the expiry pass runs ...
    outages.succeeded()  # ... and commits
    assert outages.current is None


def test_probe_reads_a_sound_store(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s.db"))
    try:
        assert probe(store) is None
    finally:
        store.close()
