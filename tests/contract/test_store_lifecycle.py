"""Store lifecycle: migrations, reopening, several processes on one SQLite file, wake-ups."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store import engine, open_store, schema
from dreamlake.lakeshore.store.api import AckRequest, AckResult, SubmitRequest
from dreamlake.lakeshore.store.engine import HEAD_REVISION, MIGRATIONS_DIR, normalize_url
from dreamlake.lakeshore.store.notify import Notifier
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.conftest import pg_database
from tests.contract.store_kit import REFUSE_BAD_ARGS

# sys.executable, not the realpath: the venv's python must stay the venv's (site-packages).
PYTHON = sys.executable
FN = {"module": "m", "qualname": "f", "version": "v1"}

WORKER = """
import json, sys
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.api import AckRequest, AckResult, SubmitRequest
s = open_store(sys.argv[1])  # the processes race to migrate the fresh file
mine = [new_ulid() for _ in range(15)]
for inv in mine:
    s.submit(SubmitRequest(inv, "q", {"module": "m"}, b"x", {}))
got = []
while True:
    batch = s.claim(sys.argv[2], ["q"], limit=1)
    if not batch:
        break
    got += [i.invocation_id for i in batch]
print(json.dumps({"submitted": mine, "claimed": got}))
"""


def test_migrations_match_schema_and_reopen_is_idempotent(store_url: str) -> None:
    first = open_store(store_url)
    second = open_store(store_url)  # runs upgrade again: a no-op
    try:
        with second.db.tx(write=False) as conn:
            ctx = MigrationContext.configure(conn)
            assert ctx.get_current_revision() == HEAD_REVISION == "0020_partial_indexes"
            assert compare_metadata(ctx, schema.metadata) == []
    finally:
        first.close()
        second.close()


def test_head_revision_in_code_is_alembics_head() -> None:
    """open_store skips Alembic when alembic_version says HEAD_REVISION: it must be the real head."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    assert ScriptDirectory.from_config(cfg).get_heads() == [HEAD_REVISION]


def test_reopen_below_head_still_upgrades(tmp_path: Path) -> None:
    """The fast path skips Alembic only at head: a file at base (no revision row) is upgraded."""
    path = tmp_path / "base.db"
    open_store(path).close()
    raw = sa.create_engine(f"sqlite:///{path}")
    with raw.begin() as conn:
        for table in reversed(schema.metadata.sorted_tables):
            conn.execute(sa.text(f"DROP TABLE {table.name}"))
        conn.execute(sa.text("DELETE FROM alembic_version"))
    raw.dispose()
    s = open_store(path)
    try:
        s.submit(SubmitRequest("i1", "q", FN, b"x", {}))
        assert s.get("i1") is not None
        with s.db.tx(write=False) as conn:
            assert MigrationContext.configure(conn).get_current_revision() == HEAD_REVISION
    finally:
        s.close()


def test_file_store_keeps_rows_across_restart(tmp_path: Path) -> None:
    path = tmp_path / "data" / "store.db"
    s = open_store(path)
    inv = new_ulid()
    s.submit(SubmitRequest(inv, "q", FN, b"args", {"priority": 3}))
    s.claim("w", ["q"])
    s.append_frame(inv, 0, b"frame", True, attempt=1)
    secret = s.create_token("admin", "a")
    s.close()

    again = open_store(f"sqlite:///{path}")
    try:
        row = again.get(inv)
        assert row is not None and (row.state, row.priority, row.args_blob) == ("running", 3, b"args")
        assert [f.data for f in again.read_frames(inv)] == [b"frame"]
        assert again.verify_token(secret) is not None
    finally:
        again.close()


def test_a_file_stores_writes_survive_their_kept_connection_breaking(tmp_path: Path) -> None:
    """A SQLite file's writes keep one connection (no pool round per transaction); should it break
    (closed under the store), the write that meets it fails over to a fresh one, as a pooled write
    does: nothing is lost, and every write after it lands."""
    s = open_store(tmp_path / "store.db")
    try:
        first = new_ulid()
        s.submit(SubmitRequest(first, "q", FN, b"a", {}))
        kept = s.db._writer
        assert kept is not None
        s.submit(SubmitRequest(new_ulid(), "q", FN, b"b", {}))
        assert s.db._writer is kept  # the same connection, not a pool checkout per write

        kept.connection.driver_connection.close()  # type: ignore[union-attr]
        after = [new_ulid() for _ in range(3)]
        for inv in after:
            s.submit(SubmitRequest(inv, "q", FN, b"c", {}))
        assert s.db._writer is not None and s.db._writer is not kept
        assert all(s.get(inv) is not None for inv in [first, *after])
        claimed = s.claim("w", ["q"], limit=10)
        assert len(claimed) == 5

        # a transaction left open on it (a commit and its rollback that both failed): the next
        # write does not inherit it, and lands
        left = s.db._writer
        assert left is not None
        left.connection.driver_connection.execute("BEGIN")  # type: ignore[union-attr]
        last = new_ulid()
        s.submit(SubmitRequest(last, "q", FN, b"d", {}))
        assert s.db._writer is not left and s.get(last) is not None
    finally:
        s.close()


def test_postgresql_writes_stay_whole_on_their_kept_connection_and_survive_it_breaking() -> None:
    """PostgreSQL's writes keep one connection, and a lone submit whose row is all it writes runs as
    its own transaction (one round trip, not three). What a user relies on stays: a submit that
    writes more (a new queue, a new function) is all or nothing; a lone submit is visible to every
    other connection once answered, and one the database refuses leaves nothing; the writes after
    it are whole transactions again; and should the kept connection die (a database restart), the
    next write lands on a fresh one and nothing is lost."""
    import psycopg

    with pg_database() as url:
        s = open_store(url)
        try:
            with s.db.tx(write=True) as conn:
                conn.exec_driver_sql(REFUSE_BAD_ARGS)
            other_fn = {"module": "m", "qualname": "other", "version": "v1"}
            # a new queue and a new function, then the invocation's insert refused: none of it lands
            (refused,) = s.write_batch([SubmitRequest(new_ulid(), "fresh", other_fn, b"bad", {})])
            assert isinstance(refused, PlaneError) and refused.status == 500
            with psycopg.connect(url) as probe:
                assert probe.execute("SELECT count(*) FROM queues WHERE name = 'fresh'").fetchone() == (0,)
                assert probe.execute("SELECT count(*) FROM functions").fetchone() == (0,)

            ids = [new_ulid() for _ in range(3)]
            for inv in ids:  # the first writes its queue and function; the next two are lone inserts
                (done,) = s.write_batch([SubmitRequest(inv, "q", FN, b"ok", {})])
                assert not isinstance(done, PlaneError)
                with psycopg.connect(url) as probe:  # committed once answered, seen by anyone
                    assert probe.execute(
                        "SELECT state FROM invocations WHERE invocation_id = %s", (inv,)
                    ).fetchone() == ("queued",)
            kept = s.db._writer
            assert kept is not None
            raw = kept.connection.driver_connection
            (refused,) = s.write_batch([SubmitRequest(new_ulid(), "q", FN, b"bad", {})])
            assert isinstance(refused, PlaneError) and refused.status == 500
            (again,) = s.write_batch([SubmitRequest(ids[0], "q", FN, b"other args", {})])
            assert isinstance(again, PlaneError) and again.status == 409  # the same id, other content
            assert s.db._writer is kept and raw.autocommit is False  # type: ignore[union-attr]

            # a write of several statements on it after those is one transaction again
            with pytest.raises(RuntimeError), s.db.tx(write=True) as conn:
                conn.exec_driver_sql("CREATE TABLE probe (x INTEGER)")
                conn.exec_driver_sql("INSERT INTO probe VALUES (1)")
                raise RuntimeError("the write's caller failed")
            assert s.db._writer is kept
            with psycopg.connect(url) as probe:
                assert probe.execute("SELECT to_regclass('probe')").fetchone() == (None,)

            # its backend killed (a restart, an admin's pg_terminate_backend): the next writes land
            dead = raw.info.backend_pid  # type: ignore[union-attr]
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (dead,))
            after = [new_ulid() for _ in range(3)]
            for inv in after:
                (done,) = s.write_batch([SubmitRequest(inv, "q", FN, b"ok", {})])
                assert not isinstance(done, PlaneError)
            writer = s.db._writer
            assert writer is not None
            assert writer.connection.driver_connection.info.backend_pid != dead  # type: ignore[union-attr]
            assert sorted(i.invocation_id for i in s.claim("w", ["q"], limit=10)) == sorted(ids + after)
            # a lone ack is its conditional update alone; a repeat, or another worker's, changes nothing
            (acked,) = s.write_batch([AckRequest(ids[0], "succeeded", 1, "w", b"result")])
            assert isinstance(acked, AckResult) and acked.ok and not acked.duplicate
            (repeat,) = s.write_batch([AckRequest(ids[0], "succeeded", 1, "w", b"result")])
            assert isinstance(repeat, AckResult) and repeat.ok and repeat.duplicate
            (stranger,) = s.write_batch([AckRequest(ids[1], "succeeded", 1, "intruder", b"forged")])
            assert isinstance(stranger, AckResult) and not stranger.ok
            done, running = s.get(ids[0]), s.get(ids[1])
            assert done is not None and (done.state, done.result_blob) == ("succeeded", b"result")
            assert running is not None and (running.state, running.result_blob) == ("running", None)
        finally:
            s.close()


CLOSE_MID_WRITE = """
import sqlite3, sys, threading
from dreamlake.lakeshore.store import open_store
s = open_store(sys.argv[1])
started, out = threading.Event(), []

def sweep():  # a write transaction of a background thread, busy in SQLite when the store closes
    try:
        with s.db.tx(write=True) as conn:
            conn.exec_driver_sql("CREATE TABLE probe (x INTEGER)")
            conn.exec_driver_sql("INSERT INTO probe VALUES (1)")
            started.set()
            conn.exec_driver_sql(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000000) "
                "SELECT count(*) FROM n"
            ).scalar_one()
        out.append("committed")
    except Exception as exc:
        out.append(repr(exc))
        started.set()

t = threading.Thread(target=sweep)
t.start()
started.wait()
s.close()
t.join()
print(out, sqlite3.connect(sys.argv[1]).execute("SELECT count(*) FROM probe").fetchone()[0])
"""


def test_closing_a_file_store_waits_for_a_write_in_flight(tmp_path: Path) -> None:
    """The kept write connection is closed between transactions, never under one: a lease sweep
    writing as the control plane stops commits, and nothing else shares its connection meanwhile
    (a sqlite3 connection used by two threads at once can crash the process). Run apart, so a
    crash fails this test and nothing else."""
    done = subprocess.run(
        [PYTHON, "-c", CLOSE_MID_WRITE, str(tmp_path / "store.db")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['committed'] 1", done.stdout + done.stderr[-2000:]


def test_a_file_stores_wal_is_checkpointed_off_the_commit_path(tmp_path: Path) -> None:
    """Commits do not run SQLite's checkpoint themselves (it made one commit in a thousand take
    10-40 ms): the automatic one is pushed back to a backstop, and the store's own thread
    checkpoints about once a second, so the WAL is reused rather than growing to the backstop."""
    path = tmp_path / "store.db"
    wal = tmp_path / "store.db-wal"
    s = open_store(path)
    try:
        with s.db.engine.connect() as conn:
            pages = conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar_one()
        assert pages == engine.SQLITE_BACKSTOP_PAGES

        def commits(n: int) -> None:
            for _ in range(n):
                s.submit(SubmitRequest(new_ulid(), "q", FN, b"x" * 2000, {}))

        commits(300)
        first = wal.stat().st_size
        assert first > 300 * 4096  # each commit appended its pages: no checkpoint ran inside them
        deadline = time.monotonic() + 30
        while True:  # once the thread has checkpointed it all, the next commit rewinds the WAL
            time.sleep(engine.CHECKPOINT_EVERY_S)
            commits(1)
            if wal.stat().st_size == first or time.monotonic() > deadline:
                break
        commits(300)
        assert wal.stat().st_size <= first * 1.1, "the WAL grew: nothing checkpointed it"
    finally:
        s.close()


@pytest.mark.slow
def test_processes_on_one_fresh_sqlite_file_migrate_once_and_never_share_a_claim(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.db")
    procs = [
        subprocess.Popen([PYTHON, "-c", WORKER, path, f"p{n}"], stdout=subprocess.PIPE, text=True)
        for n in range(2)
    ]
    submitted: list[str] = []
    claimed: list[str] = []
    for p in procs:
        out, _ = p.communicate(timeout=90)
        assert p.returncode == 0
        report = json.loads(out)
        submitted += report["submitted"]
        claimed += report["claimed"]
    s = open_store(path)
    try:
        claimed += [i.invocation_id for i in s.claim("parent", ["q"], limit=100)]  # any left over
        with s.db.tx(write=False) as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar_one() == 1
    finally:
        s.close()
    assert Counter(claimed).most_common(1)[0][1] == 1
    assert sorted(claimed) == sorted(submitted)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (":memory:", "sqlite://"),
        ("/tmp/x/store.db", "sqlite:////tmp/x/store.db"),
        ("sqlite:///rel.db", "sqlite:///rel.db"),
        ("postgresql://u:p@h:5432/db", "postgresql+psycopg://u:p@h:5432/db"),
        ("postgres://h/db", "postgresql+psycopg://h/db"),
    ],
)
def test_url_mapping(given: str, expected: str) -> None:
    assert normalize_url(given) == expected


def test_unsupported_url_says_what_to_pass() -> None:
    with pytest.raises(PlaneError, match="use a file path"):
        normalize_url("mysql://h/db")


def test_memory_store_is_shared_across_threads() -> None:
    s = open_store(":memory:")
    inv = new_ulid()
    seen: list[object] = []
    th = threading.Thread(target=lambda: s.submit(SubmitRequest(inv, "q", FN, b"x", {})))
    th.start()
    th.join()
    th = threading.Thread(target=lambda: seen.extend(s.claim("w", ["q"])))
    th.start()
    th.join()
    assert [i.invocation_id for i in seen] == [inv]  # type: ignore[attr-defined]
    s.close()


def test_notifier_wait_since_mark_sees_earlier_notify() -> None:
    n = Notifier()
    mark = n.mark()
    n.notify("queue:a")
    assert n.wait(["queue:a", "queue:b"], timeout=5, since=mark) is True
    assert n.wait(["queue:a"], timeout=0.01) is False  # nothing new since now
    threading.Timer(0.05, n.notify, args=("inv:x",)).start()
    t0 = time.monotonic()
    assert n.wait(["inv:x"], timeout=60) is True
    assert time.monotonic() - t0 < 30  # woken by the notification, not by the end of its timeout


def test_notifier_wakes_each_blocked_wait_of_the_channel() -> None:
    """Threads blocked in ``wait`` are woken by a notification from another thread (the
    condition is notified only while one waits: ``_blocked``), and only for their channels."""
    n = Notifier()
    woken: list[str] = []
    start = threading.Barrier(4)

    def waiter(channel: str) -> None:
        start.wait()
        if n.wait([channel], timeout=60):
            woken.append(channel)

    threads = [threading.Thread(target=waiter, args=(c,)) for c in ("inv:a", "inv:a", "inv:b")]
    for th in threads:
        th.start()
    start.wait()
    deadline = time.monotonic() + 10
    while n._blocked < 3 and time.monotonic() < deadline:  # all three inside ``wait``
        time.sleep(0.01)
    n.notify("inv:a")
    for th in threads[:2]:
        th.join(30)
        assert not th.is_alive()  # woken long before its 60 s
    assert woken == ["inv:a", "inv:a"] and threads[2].is_alive()
    n.notify("inv:b")
    threads[2].join(30)
    assert woken == ["inv:a", "inv:a", "inv:b"] and n._blocked == 0


def test_notifier_async_wait_is_woken_from_another_thread() -> None:
    n = Notifier()

    async def main() -> tuple[bool, bool]:
        threading.Timer(0.05, n.notify, args=("topic:t",)).start()
        woken = await n.wait_async(["topic:t"], timeout=10)
        quiet = await n.wait_async(["topic:none"], timeout=0.01)
        return woken, quiet

    assert asyncio.run(main()) == (True, False)


def test_notifier_async_waits_are_woken_from_their_own_loop_and_leave_nothing_behind() -> None:
    """The inline group commit notifies on the waiters' own loop: every waiter of the channel
    wakes, and a waiter that timed out or was cancelled is no longer registered (a notification
    after it finds nobody and raises nothing)."""
    n = Notifier()

    async def main() -> tuple[list[bool], bool]:
        waits = [asyncio.ensure_future(n.wait_async(["inv:a"], timeout=10)) for _ in range(2)]
        other = asyncio.ensure_future(n.wait_async(["inv:b"], timeout=10))
        await asyncio.sleep(0)  # all three registered
        n.notify("inv:a")  # from this loop, as the inline writer does
        woken = [await asyncio.wait_for(w, 5) for w in waits]
        assert not other.done()
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other
        quiet = await n.wait_async(["inv:c"], timeout=0.01)
        n.notify("inv:b")
        n.notify("inv:c")
        return woken, quiet

    assert asyncio.run(main()) == ([True, True], False)
    assert n._async == {}


def test_concurrent_opens_of_a_fresh_postgres_database_migrate_once() -> None:
    with pg_database() as url:
        errors: list[BaseException] = []
        stores: list[SqlStore] = []

        def opener() -> None:
            try:
                stores.append(open_store(url))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=opener) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        try:
            assert errors == []
            with stores[0].db.tx(write=False) as conn:
                assert MigrationContext.configure(conn).get_current_revision() == HEAD_REVISION
        finally:
            for s in stores:
                s.close()


def test_upgrade_to_0002_gives_running_exec_jobs_a_lease(tmp_path: Path) -> None:
    """A job claimed before exec leases (``running`` for ever if its daemon died) gets attempt 1
    and a lease of a minute: a live daemon renews it, a dead one's is requeued."""
    from alembic import command
    from alembic.config import Config

    path = tmp_path / "old.db"
    raw = sa.create_engine(f"sqlite:///{path}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with raw.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        for exec_id, state, claimed_by in (("r", "running", "w"), ("q", "queued", None)):
            conn.execute(
                sa.text(
                    "INSERT INTO exec_jobs (exec_id, namespace, command, queue, state, claimed_by, created_at)"
                    " VALUES (:id, 'ns', 'true', 'q', :state, :by, 0)"
                ),
                {"id": exec_id, "state": state, "by": claimed_by},
            )
    raw.dispose()
    s = open_store(path)
    try:
        running, queued = s.get_exec("ns", "r"), s.get_exec("ns", "q")
        assert running is not None and (running["attempt"], running["max_attempts"]) == (1, 3)
        assert queued is not None and queued["attempt"] == 0
        assert s.expire_leases() == []  # a minute for a live daemon's heartbeat
        assert s.expire_leases(now=10**10) == ["r"]
        assert s.get_exec("ns", "r")["state"] == "queued"  # type: ignore[index]
    finally:
        s.close()


def test_a_kept_write_transaction_commits_or_rolls_back_all_that_ran_in_it(tmp_path: Path) -> None:
    """The kept write connection's transaction is the driver's (``BEGIN IMMEDIATE`` .. ``COMMIT``);
    a statement through SQLAlchemy inside it joins it. What ran commits together, or rolls back
    together on an exception; a commit the database refuses is raised as SQLAlchemy raises it
    (a ``DBAPIError``), rolled back, and the next write lands."""
    s = open_store(tmp_path / "store.db")
    db = s.db
    try:
        with db.tx(write=True) as conn:
            conn.exec_driver_sql("CREATE TABLE parent (k INTEGER PRIMARY KEY)")
            conn.exec_driver_sql("CREATE TABLE child (k INTEGER PRIMARY KEY, p INTEGER REFERENCES parent(k))")
        with db.tx(write=True) as conn:  # SQLAlchemy's statement, then the driver's: one transaction
            conn.execute(sa.text("INSERT INTO parent VALUES (1)"))
            conn.connection.driver_connection.execute("INSERT INTO parent VALUES (2)")  # type: ignore[union-attr]
        with db.tx(write=True) as conn:  # the driver's alone
            conn.connection.driver_connection.execute("INSERT INTO parent VALUES (3)")  # type: ignore[union-attr]
        for through_sqlalchemy in (True, False):
            with pytest.raises(RuntimeError), db.tx(write=True) as conn:
                conn.connection.driver_connection.execute("INSERT INTO parent VALUES (4)")  # type: ignore[union-attr]
                if through_sqlalchemy:
                    conn.execute(sa.text("INSERT INTO parent VALUES (5)"))
                raise RuntimeError("the write's caller failed")
        with pytest.raises(sa.exc.IntegrityError), db.tx(write=True) as conn:
            raw = conn.connection.driver_connection
            raw.execute("PRAGMA defer_foreign_keys = ON")  # type: ignore[union-attr]
            raw.execute("INSERT INTO child VALUES (1, 99)")  # type: ignore[union-attr]  # refused at COMMIT
        with db.tx(write=True) as conn:
            conn.connection.driver_connection.execute("INSERT INTO child VALUES (2, 1)")  # type: ignore[union-attr]
        # the same refusal of a transaction SQLAlchemy began: rolled back through it, so its failed
        # transaction does not block the kept connection's next statements (PendingRollbackError)
        kept = db._writer
        with pytest.raises(sa.exc.IntegrityError), db.tx(write=True) as conn:
            conn.execute(sa.text("PRAGMA defer_foreign_keys = ON"))
            conn.execute(sa.text("INSERT INTO child VALUES (3, 98)"))
        with db.tx(write=True) as conn:
            conn.execute(sa.text("INSERT INTO child VALUES (4, 1)"))
        assert db._writer is kept
        with db.tx(write=False) as conn:
            parents = [r[0] for r in conn.exec_driver_sql("SELECT k FROM parent ORDER BY k")]
            children = [r[0] for r in conn.exec_driver_sql("SELECT k FROM child ORDER BY k")]
        assert parents == [1, 2, 3] and children == [2, 4]
        kept = db._writer
        assert kept is not None and not kept.in_transaction()
        assert not kept.connection.driver_connection.in_transaction  # type: ignore[union-attr]
    finally:
        s.close()
