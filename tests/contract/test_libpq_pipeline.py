"""store/libpq.py: statements queued in a pipeline on PostgreSQL answer what the same statements
run one by one answer, go out together (one round trip), and fail as SQLAlchemy fails: the first
error at the sync, nothing after it run, a lost connection invalidated."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from dreamlake.lakeshore.store import libpq
from dreamlake.lakeshore.store.direct import Direct
from dreamlake.lakeshore.store.engine import Database

META = sa.MetaData()
T = sa.Table(
    "libpq_pipeline_rows",
    META,
    sa.Column("id", sa.String(16), primary_key=True),
    sa.Column("doc", sa.JSON, nullable=True),
    sa.Column("n", sa.Integer, nullable=False),
)
B = sa.bindparam
INSERT = Direct(
    sa.insert(T).values(id=B("id"), doc=B("doc", type_=sa.JSON), n=B("n")).returning(T.c.id, T.c.doc, T.c.n),
    "postgresql",
)
BUMP = Direct(sa.update(T).where(T.c.id == B("k")).values(n=T.c.n + B("by")), "postgresql")
READ = Direct(sa.select(T.c.id, T.c.doc, T.c.n).where(T.c.n >= B("least")).order_by(T.c.id), "postgresql")


@pytest.fixture
def db(pg_session_url: str) -> Iterator[Database]:
    database = Database(pg_session_url)
    META.drop_all(database.engine)
    META.create_all(database.engine)
    yield database
    META.drop_all(database.engine)
    database.dispose()


def test_queued_statements_answer_what_they_answer_one_by_one(db: Database) -> None:
    """Rows (a JSON column decoded), row counts and later statements seeing earlier ones' writes,
    all read after the one sync; the transaction begun in the pipeline and committed by the
    caller."""
    with db.tx(write=True) as conn, libpq.pipeline(conn):
        a = INSERT.send(conn, {"id": "a", "doc": {"x": [1, None]}, "n": 1})
        b = INSERT.send(conn, {"id": "b", "doc": None, "n": 2})
        bumped = BUMP.send(conn, {"k": "a", "by": 10})
        missed = BUMP.send(conn, {"k": "zz", "by": 1})
        read = READ.send(conn, {"least": 2})
    assert tuple(a.result().first()) == ("a", {"x": [1, None]}, 1)
    assert tuple(b.result().first()) == ("b", None, 2)
    assert (bumped.result().rowcount, missed.result().rowcount) == (1, 0)
    assert [tuple(r) for r in read.result()] == [("a", {"x": [1, None]}, 11), ("b", None, 2)]
    with db.tx(write=False) as conn:
        assert conn.execute(READ, {"least": 0}).fetchall() == read.result().fetchall()


def test_the_statements_go_out_together_and_are_prepared_once(db: Database) -> None:
    """Every statement is sent before any answer is read (nothing answered inside the block), and
    a text is prepared on its connection by its first pipeline, then executed by name."""
    with db.tx(write=True) as conn:
        with libpq.pipeline(conn):
            sent = INSERT.send(conn, {"id": "a", "doc": None, "n": 1})
            with pytest.raises(RuntimeError, match="before its pipeline synced"):
                sent.result()
        raw = conn.connection.dbapi_connection
        first = dict(libpq._PREPARED[raw])
        with libpq.pipeline(conn):
            INSERT.send(conn, {"id": "b", "doc": None, "n": 2})
        assert libpq._PREPARED[raw] == first and len(first) == 1
        names = {r[0] for r in conn.execute(sa.text("SELECT name FROM pg_prepared_statements"))}
    assert set(first.values()) <= {n.encode() for n in names}


def test_a_statement_run_at_once_inside_a_pipeline_is_refused(db: Database) -> None:
    """It would run before the statements queued there: a clear error, nothing sent."""
    with (
        db.tx(write=True) as conn,
        pytest.raises(RuntimeError, match="inside a pipeline"),
        libpq.pipeline(conn),
    ):
        INSERT.send(conn, {"id": "a", "doc": None, "n": 1})
        conn.execute(READ, {"least": 0})
    with db.tx(write=False) as conn:
        assert conn.execute(READ, {"least": 0}).fetchall() == []


def test_the_first_error_is_sqlalchemys_at_the_sync_and_nothing_after_it_runs(db: Database) -> None:
    """A refused row fails the pipeline with SQLAlchemy's IntegrityError; the statement after it
    never ran, and the transaction, rolled back, leaves nothing; the connection serves on."""
    with pytest.raises(sa.exc.IntegrityError), db.tx(write=True) as conn, libpq.pipeline(conn):
        INSERT.send(conn, {"id": "a", "doc": None, "n": 1})
        INSERT.send(conn, {"id": "a", "doc": None, "n": 2})  # the same key
        INSERT.send(conn, {"id": "c", "doc": None, "n": 3})
    with db.tx(write=True) as conn, libpq.pipeline(conn):
        sent = INSERT.send(conn, {"id": "d", "doc": None, "n": 4})
    assert sent.result().first().id == "d"
    with db.tx(write=False) as conn:
        assert [r.id for r in conn.execute(READ, {"least": 0})] == ["d"]


def test_a_lost_connection_is_invalidated(db: Database, pg_session_url: str) -> None:
    """The backend ended under the connection: the sync raises SQLAlchemy's error with
    ``connection_invalidated`` (what the store's retry on a disconnect looks for)."""
    with pytest.raises(sa.exc.DBAPIError) as caught, db.tx(write=True) as conn:
        backend = conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        with psycopg.connect(pg_session_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [backend])
        with libpq.pipeline(conn):
            INSERT.send(conn, {"id": "a", "doc": None, "n": 1})
    assert caught.value.connection_invalidated
    with db.tx(write=True) as conn, libpq.pipeline(conn):
        sent = INSERT.send(conn, {"id": "b", "doc": None, "n": 2})
    assert sent.result().first().id == "b"


def test_nothing_is_prepared_where_psycopg_prepares_nothing(db: Database) -> None:
    """``prepare_threshold`` None (a pooler whose server connections keep no prepared statement):
    the statements go unnamed, answered as before."""
    with db.tx(write=True) as conn:
        raw = conn.connection.dbapi_connection
        raw.prepare_threshold = None  # type: ignore[union-attr]
        try:
            libpq.forget(raw)
            with libpq.pipeline(conn):
                sent = INSERT.send(conn, {"id": "a", "doc": {"k": 1}, "n": 1})
            assert tuple(sent.result().first()) == ("a", {"k": 1}, 1)
            assert libpq._PREPARED[raw] == {}
        finally:
            raw.prepare_threshold = 5  # type: ignore[union-attr]
