"""store/direct.py: a hot statement run through the driver writes what SQLAlchemy would, and fails
as SQLAlchemy would (a DBAPIError the store's outage and retry logic know)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dreamlake.lakeshore.store.direct import Direct, JSONText
from dreamlake.lakeshore.store.engine import Database

META = sa.MetaData()
T = sa.Table(
    "t",
    META,
    sa.Column("id", sa.String(16), primary_key=True),
    sa.Column("doc", sa.JSON, nullable=True),
    sa.Column("n", sa.Integer, nullable=False),
    sa.Column("at", sa.Double, nullable=True),
)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = Database(tmp_path / "d.db")
    else:
        from tests.contract.conftest import pg_database

        ctx = pg_database()
        url = ctx.__enter__()
        database = Database(url)
        request.addfinalizer(lambda: ctx.__exit__(None, None, None))
    META.create_all(database.engine)
    yield database
    database.dispose()


def _insert(dialect: str) -> Direct:
    B = sa.bindparam
    stmt = (
        sa.insert(T)
        .values(id=B("id"), doc=B("doc", type_=sa.JSON), n=B("n"), at=B("at"))
        .returning(T.c.id, T.c.n)
    )
    return Direct(stmt, dialect)


def test_rows_match_what_sqlalchemy_writes(db: Database) -> None:
    direct = _insert(db.dialect)
    rows = [{"id": f"d{k}", "doc": {"k": [k, None]} if k else None, "n": k, "at": 1.5} for k in range(3)]
    with db.tx(write=True) as conn:
        got = conn.execute(direct, rows)  # several sets: executemany with RETURNING
        assert sorted(got.scalars()) == ["d0", "d1", "d2"]
        one = conn.execute(direct, {"id": "e0", "doc": {"a": 1}, "n": 7, "at": None}).first()
        assert (one.id, one.n) == ("e0", 7)
        conn.execute(direct.stmt, {"id": "s0", "doc": None, "n": 0, "at": 1.5})  # SQLAlchemy's own
    with db.tx(write=False) as conn:
        back = {r.id: (r.doc, r.n, r.at) for r in conn.execute(sa.select(T))}
        raw_docs = dict(conn.execute(sa.select(T.c.id, sa.cast(T.c.doc, sa.Text))).all())
    assert back["d1"] == ({"k": [1, None]}, 1, 1.5)
    assert back["e0"] == ({"a": 1}, 7, None)
    assert raw_docs["d0"] == raw_docs["s0"]  # a None JSON stored exactly as SQLAlchemy stores it


def test_a_refused_row_is_sqlalchemys_error_and_rolls_back(db: Database) -> None:
    direct = _insert(db.dialect)
    with db.tx(write=True) as conn:
        conn.execute(direct, {"id": "x", "doc": None, "n": 1, "at": None})
    with pytest.raises(sa.exc.IntegrityError), db.tx(write=True) as conn:
        conn.execute(direct, {"id": "y", "doc": None, "n": 1, "at": None})
        conn.execute(direct, {"id": "x", "doc": None, "n": 2, "at": None})  # the key again
    with db.tx(write=False) as conn:
        assert [r.id for r in conn.execute(sa.select(T.c.id))] == ["x"]  # "y" went with it


def test_a_missing_parameter_is_a_clear_error(db: Database) -> None:
    with pytest.raises(sa.exc.ArgumentError, match="'n'"), db.tx(write=True) as conn:
        conn.execute(_insert(db.dialect), {"id": "z", "doc": None, "at": None})


def test_a_statement_it_cannot_take_fails_when_built() -> None:
    stmt = sa.select(T.c.id).where(T.c.id.in_(sa.bindparam("ids", expanding=True)))
    with pytest.raises(TypeError, match="expanding"):
        Direct(stmt, "sqlite")


def test_defaults_and_returned_json_read_as_sqlalchemy_reads_them(db: Database) -> None:
    """A parameter left to its bound default takes it (one set, several sets, and beside sets that
    give it), and a JSON column in ``RETURNING`` comes back decoded, as SQLAlchemy's own result."""
    B = sa.bindparam
    stmt = (
        sa.insert(T)
        .values(id=B("id"), doc=B("doc", type_=sa.JSON), n=B("n", value=5), at=B("at", value=None))
        .returning(T.c.id, T.c.doc, T.c.n, T.c.at)
    )
    direct = Direct(stmt, db.dialect)
    with db.tx(write=True) as conn:
        one = conn.execute(direct, {"id": "a", "doc": {"x": [1, 2.5, None]}}).first()
        many = conn.execute(
            direct, [{"id": "b", "doc": None}, {"id": "c", "doc": ["y"], "n": 9, "at": 0.5}]
        ).fetchall()
        full = conn.execute(direct, {"id": "d", "doc": {"z": {}}, "n": 1, "at": 2.0}).first()
    assert tuple(one) == ("a", {"x": [1, 2.5, None]}, 5, None)
    assert [tuple(r) for r in many] == [("b", None, 5, None), ("c", ["y"], 9, 0.5)]
    assert (full.id, full.doc, full.n, full.at) == ("d", {"z": {}}, 1, 2.0)
    with db.tx(write=False) as conn:
        back = {r.id: (r.doc, r.n, r.at) for r in conn.execute(sa.select(T))}
    assert back == {r[0]: tuple(r[1:]) for r in [one, *many, full]}


def test_many_rows_as_one_statement_write_what_one_row_statements_write(db: Database) -> None:
    """``run_rows``: a one-row ``INSERT ... VALUES`` of many sets (PostgreSQL: one statement per
    ``ROWS_MAX`` rows, its parameters numbered) writes and returns what one-row statements would,
    in order; a key conflict is the whole statement's error (all or nothing); an ``ON CONFLICT DO
    NOTHING`` skips a row repeated in the same statement, and returns only what it inserted."""
    from dreamlake.lakeshore.store.direct import ROWS_MAX

    direct = _insert(db.dialect)
    rows = [
        {"id": f"m{k:03}", "doc": {"k": k, "s": "50% off"} if k % 2 else None, "n": k, "at": k / 4}
        for k in range(ROWS_MAX * 2 + 3)
    ]
    with db.tx(write=True) as conn:
        got = direct.run_rows(conn, rows)
    assert [r.id for r in got] == [r["id"] for r in rows] and got.rowcount == len(rows)
    with db.tx(write=False) as conn:
        back = {r.id: (r.doc, r.n, r.at) for r in conn.execute(sa.select(T))}
    assert back == {r["id"]: (r["doc"], r["n"], r["at"]) for r in rows}

    with pytest.raises(sa.exc.IntegrityError), db.tx(write=True) as conn:
        direct.run_rows(conn, [{"id": "new", "doc": None, "n": 0, "at": None}, rows[5]])
    with db.tx(write=False) as conn:
        assert conn.execute(sa.select(T.c.id).where(T.c.id == "new")).first() is None

    B = sa.bindparam
    dialect_insert = __import__(f"sqlalchemy.dialects.{db.dialect}", fromlist=["insert"]).insert
    skip = Direct(
        dialect_insert(T)
        .values(id=B("id"), doc=B("doc", type_=sa.JSON), n=B("n"), at=B("at"))
        .on_conflict_do_nothing()
        .returning(T.c.id),
        db.dialect,
    )
    again = [{"id": i, "doc": None, "n": 1, "at": None} for i in ("m001", "fresh", "fresh", "other")]
    with db.tx(write=True) as conn:
        assert skip.run_rows(conn, again).scalars() == ["fresh", "other"]


def test_many_rows_need_an_insert_of_one_values_group() -> None:
    from sqlalchemy.dialects import postgresql

    update = Direct(
        sa.update(T).where(T.c.id == sa.bindparam("b_id")).values(n=sa.bindparam("n")), "postgresql"
    )
    compiled = update._compiled(postgresql.psycopg.dialect(), {})  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="one VALUES group"):
        compiled.rows_sql(2)


def test_an_update_from_values_of_many_rows_is_one_statement() -> None:
    """``run_rows`` of PostgreSQL's ``UPDATE ... FROM (VALUES (...)) AS v`` (SQLite has no column
    list on a ``VALUES`` alias): each set's values in a row of the ``VALUES``, the parameters
    outside it (here ``at``) given once; sets that differ outside the group are refused, not
    half-applied."""
    from tests.contract.conftest import pg_database

    B = sa.bindparam
    with pg_database() as url:
        db = Database(url)
        try:
            META.create_all(db.engine)
            with db.tx(write=True) as conn:
                conn.execute(
                    sa.insert(T), [{"id": f"u{k}", "doc": None, "n": 0, "at": None} for k in range(5)]
                )
            v = sa.values(sa.column("id", sa.String), sa.column("n", sa.Integer), name="v").data(
                [
                    (
                        sa.cast(B("id", type_=sa.String), sa.String),
                        sa.cast(B("n", type_=sa.Integer), sa.Integer),
                    )
                ]
            )
            update = Direct(sa.update(T).where(T.c.id == v.c.id).values(n=v.c.n, at=B("at")), "postgresql")
            sets = [{"id": f"u{k}", "n": 10 + k, "at": 2.5} for k in (0, 2, 4)]
            with db.tx(write=True) as conn:
                assert update.run_rows(conn, sets).rowcount == 3
            with pytest.raises(sa.exc.ArgumentError, match="outside"), db.tx(write=True) as conn:
                update.run_rows(conn, [{"id": "u1", "n": 1, "at": 1.0}, {"id": "u3", "n": 3, "at": 9.0}])
            with db.tx(write=False) as conn:
                back = {r.id: (r.n, r.at) for r in conn.execute(sa.select(T))}
        finally:
            db.dispose()
    assert back == {"u0": (10, 2.5), "u1": (0, None), "u2": (12, 2.5), "u3": (0, None), "u4": (14, 2.5)}


def test_sqlite_stores_a_json_text_as_given_and_a_value_as_encoded(tmp_path: Path) -> None:
    """A submit's JSON columns are encoded once, by its checks (``values.json_encoded``): the text
    goes to SQLite as it is, never encoded again as a JSON string; what reads back is the value,
    and the stored text is the one the column's serializer writes for the value itself."""
    from dreamlake.lakeshore.store import values

    database = Database(tmp_path / "d.db")
    META.create_all(database.engine)
    direct = _insert(database.dialect)
    doc = {"queue": "q", "nested": [1, 2.5, None], "nan": float("nan")}
    fixed, text = values.json_encoded(doc, "run_config")
    assert fixed["nan"] == "nan" and type(text) is JSONText  # non-finite floats spelled as strings
    with database.tx(write=True) as conn:
        conn.execute(direct, {"id": "text", "doc": text, "n": 1, "at": None})
        conn.execute(direct, {"id": "value", "doc": fixed, "n": 2, "at": None})
    with database.engine.connect() as conn:
        read = dict(conn.execute(sa.select(T.c.id, T.c.doc)).all())
        raw = dict(conn.exec_driver_sql("SELECT id, doc FROM t").all())
    assert read["text"] == read["value"] == fixed
    assert raw["text"] == raw["value"] == json.dumps(fixed)
    database.dispose()


def test_a_plain_str_in_a_json_column_stays_a_json_string(db: Database) -> None:
    """Only a :class:`JSONText` is taken as encoded: a str value is a JSON string, as ever."""
    with db.tx(write=True) as conn:
        conn.execute(_insert(db.dialect), {"id": "plain", "doc": '{"not": "a map"}', "n": 1, "at": None})
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(T.c.doc).where(T.c.id == "plain")).scalar_one() == '{"not": "a map"}'


def test_returned_json_texts_decode_as_json_loads_decodes_them(tmp_path: Path) -> None:
    """SQLite's JSON columns in ``RETURNING`` are decoded by json.loads's scanner where a text is
    one value and nothing around it; any other text (whitespace around it, a BOM, not JSON) goes
    to SQLAlchemy's own processor, so each answers or fails as json.loads does."""
    database = Database(tmp_path / "j.db")
    META.create_all(database.engine)
    texts = [
        '{"a": [1, 2.5, null, "\\u00e9"]}',
        "[]",
        "3",
        '"s"',
        "null",
        " [1] ",
        "[1]\n",
        "\ufeff[1]",
        "[1",
        "{}x",
    ]
    raw = sa.text("INSERT INTO t (id, doc, n) VALUES (:id, :doc, 0)")
    get = Direct(sa.update(T).where(T.c.id == sa.bindparam("b_id")).values(n=1).returning(T.c.doc), "sqlite")
    try:
        with database.tx(write=True) as conn:
            for k, text in enumerate(texts):
                conn.execute(raw, {"id": f"j{k}", "doc": text})
        for k, text in enumerate(texts):
            try:
                expected: object = json.loads(text)
            except ValueError as exc:
                expected = type(exc)
            with database.tx(write=True) as conn:
                try:
                    got: object = conn.execute(get, {"b_id": f"j{k}"}).scalar_one()
                except ValueError as exc:
                    got = type(exc)
            assert got == expected, text
    finally:
        database.dispose()


def test_a_row_converts_to_the_invocation_its_mapping_does() -> None:
    """``row_to_invocation`` (a claim's rows, by position) is ``invocation_from`` of the row's
    mapping, whatever the columns hold (blobs as memoryview, NULL counts, a NULL shape)."""
    from dreamlake.lakeshore.store.invocation_rows import _INV_COLS, invocation_from, row_to_invocation

    base = {c: f"v-{c}" for c in _INV_COLS}
    variants = [
        {"priority": 3, "args_blob": b"a", "result_blob": None, "cancel_requested": 0, "shape": "",
         "preemptions": 0, "handbacks": 0},
        {"priority": 7.0, "args_blob": memoryview(b"x"), "result_blob": memoryview(b"r"),
         "cancel_requested": 1, "shape": None, "preemptions": None, "handbacks": 2},
        {"priority": -1, "args_blob": None, "result_blob": b"", "cancel_requested": True, "shape": "s1",
         "preemptions": 4, "handbacks": None},
    ]  # fmt: skip
    for v in variants:
        row = tuple({**base, **v}[c] for c in _INV_COLS)
        assert row_to_invocation(row) == invocation_from(dict(zip(_INV_COLS, row, strict=True)))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        row_to_invocation(row[:-1])  # type: ignore[arg-type]
