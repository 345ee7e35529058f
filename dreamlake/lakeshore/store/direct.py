"""Hot statements straight through the DB-API driver: SQLAlchemy builds and compiles them once,
each execution is the driver's alone.

The group-commit writer runs a few statements thousands of times a second (a submit's insert, an
ack's update). Through SQLAlchemy Core each execution still pays for its Python: the compiled
cache's key and lookup, an execution context, the parameters' processing, a result wrapper, about
two thirds of the writer's time per write on this project's machine. :class:`Direct` wraps such a
statement: it is compiled once per dialect (the SQL text, the order of its parameters, each
parameter's bind processor: a JSON column's serializer, psycopg's JSON wrapper, exactly what
SQLAlchemy would apply) and then executed on the raw driver connection of the caller's SQLAlchemy
:class:`~sqlalchemy.engine.Connection`, inside the caller's transaction:

- ``conn.execute(direct, params)`` works as for any statement (``Direct`` implements the hook
  ``Connection.execute`` dispatches on), so a call site does not change, and a statement that
  ``Direct`` cannot take (an ``expanding`` list, escaped bind names) raises at import, not later;
- the driver prepares it: ``sqlite3`` keeps each statement text prepared per connection, and
  psycopg prepares one server-side from its fifth execution on a connection (``prepare_threshold``);
- several parameter sets go as one ``executemany`` (psycopg pipelines it: one round trip), with
  ``RETURNING`` rows collected set by set (SQLite: one ``execute`` per row, in C);
- a statement of one ``VALUES`` row (an ``INSERT``'s, an ``UPDATE ... FROM (VALUES ...)``'s)
  may take several sets as one statement (``run_rows``: the ``VALUES`` group repeated, up to
  ``ROWS_MAX`` to a statement): on PostgreSQL a third of an ``executemany``'s CPU for 8 rows
  (psycopg's pipeline is costly in Python), and one statement, so all or nothing even outside a
  transaction;
- on PostgreSQL a statement may be sent now and read later (``send``, :class:`Sent`), several in
  one of libpq's pipelines, one round trip for them all (store/libpq.py, store/pipelined.py);
- a driver error is handed to SQLAlchemy's own handler, so it is raised wrapped in
  :class:`sqlalchemy.exc.DBAPIError` with ``connection_invalidated`` set on a lost connection,
  exactly as from ``conn.execute`` of the statement itself (``retry_on_disconnect`` and
  store/outage.py rely on that).

A JSON column's value given as :class:`JSONText` (the text the caller already encoded to check it,
``json.dumps``'s, what the column's serializer would write) goes to SQLite as it is: a submit's
three JSON columns were encoded twice, once by its checks and once here. PostgreSQL's binds wrap
values for psycopg and take no ``JSONText`` (the caller gives it there only on SQLite).

The transaction, its ``BEGIN`` and commit, stay SQLAlchemy's (``Database.tx``): ``Direct`` changes
how a statement is executed, never when it commits, so durability before an answer is untouched.
The rows it returns are named tuples of the ``RETURNING`` columns (result processors applied).
A ``literal_execute`` parameter (a claim's limit) is rendered into the text as SQLAlchemy does at
execution: one compiled text per value in use.

What it gives up: SQLAlchemy's cursor events (``before_cursor_execute``; the store listens to none)
and its statement logging (``echo``). It leans on three SQLAlchemy internals, each covered by
tests/unit/test_direct_statements.py on both dialects: the ``_execute_on_connection`` hook,
``Connection._handle_dbapi_exception`` and the compiled statement's ``_result_columns``.
"""

from __future__ import annotations

import collections
import json
import operator
import re
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect

from .libpq import DirectResult, Sent, open_on, reraise

if TYPE_CHECKING:  # to the type checker a Direct is a statement conn.execute takes (it is, by duck)
    from sqlalchemy.sql.base import Executable as _Statement
else:
    _Statement = object


_UNKNOWN: Any = object()
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")  # a named parameter in psycopg's (pyformat) SQL
ROWS_MAX = 64  # rows to one statement of ``Direct.run_rows`` (a text each count, prepared by psycopg)


class JSONText(str):
    """A JSON column's value already encoded, as ``json.dumps`` (the column's serializer) writes
    it: a SQLite statement stores it as it is (see the module docstring)."""

    __slots__ = ()


def _text_first(proc: Any) -> Any:
    """A SQLite JSON bind's processor that stores a :class:`JSONText` as given."""

    def process(value: Any) -> Any:
        return str(value) if type(value) is JSONText else proc(value)

    return process


# json.loads's own scanner (a decoder of its default decoder's settings)
_SCAN: Any = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _json_first(proc: Any) -> Any:
    """A SQLite JSON column's result processor (SQLAlchemy's ``proc``, ``json.loads`` of the text)
    that decodes a text of one JSON value and nothing around it (what ``json.dumps`` writes) with
    the scanner alone: what ``json.loads`` returns for it, without its two whitespace matches and
    its frames. Anything else (whitespace, a BOM, an error, not a string) goes to ``proc``."""

    def process(value: Any) -> Any:
        if type(value) is str:
            try:
                obj, end = _SCAN(value, 0)
            except StopIteration:
                return proc(value)
            if end == len(value):
                return obj
        return None if value is None else proc(value)

    return process


def _of_none(proc: Any) -> Any:
    """``proc(None)``, computed once; ``_UNKNOWN`` when it raises (then it runs per value)."""
    try:
        return proc(None)
    except Exception:
        return _UNKNOWN


class _Compiled:
    """One statement compiled for one dialect."""

    def __init__(self, stmt: Any, dialect: Dialect, literal: Mapping[str, Any] | None = None) -> None:
        compiled = stmt.compile(dialect=dialect)
        if getattr(compiled, "escaped_bind_names", None):
            raise TypeError("Direct: a statement with escaped bind names")
        self.sql: str = compiled.string
        positiontup = compiled.positiontup
        by_name = {name: bp for bp, name in compiled.bind_names.items()}  # the names in the SQL
        if literal:  # ``literal_execute`` parameters: their values rendered into the SQL text
            given = {name: None for name in by_name} | dict(literal)
            state = compiled.construct_expanded_state(given)
            self.sql, positiontup = state.statement, state.positiontup
            by_name = {n: bp for n, bp in by_name.items() if not bp.literal_execute}
        if any(bp.expanding for bp in by_name.values()):
            raise TypeError("Direct: a statement with an expanding parameter")
        self.positional = dialect.paramstyle in ("qmark", "numeric", "format")
        names = list(positiontup or ()) if self.positional else list(by_name)
        # (name, bind processor or None, default: None when the caller must give it)
        binds: list[tuple[str, Any, tuple[Any] | None]] = []
        for name in names:
            bp = by_name[name]
            proc = bp.type.dialect_impl(dialect).bind_processor(dialect)
            if proc is not None and dialect.name == "sqlite" and isinstance(bp.type, sa.JSON):
                proc = _text_first(proc)
            default = None if bp.required else (bp.effective_value,)
            binds.append((name, proc, default))
        # every value read with one C ``itemgetter``, then only the binds with a processor
        self._names = [b[0] for b in binds]
        self._get: Any = operator.itemgetter(*self._names) if self._names else (lambda _given: ())
        # the binds with a default (a literal's value, a parameter left to its bound value): few,
        # merged into the given values when absent, so the one itemgetter reads them all
        self._defaults = [(name, default[0]) for name, _, default in binds if default is not None]
        # (index, processor, what it makes of None): a JSON column's None is the same text (or
        # wrapper) every time, serialised once here rather than per execution
        self._procs = [(k, b[1], _of_none(b[1])) for k, b in enumerate(binds) if b[1] is not None]
        # the RETURNING columns, as SQLAlchemy's own result would read them (name, type)
        returning = [(r.keyname, r.type) for r in compiled._result_columns]
        self.returns = bool(returning)
        self.row: Any = collections.namedtuple("Row", [name for name, _ in returning], rename=True)  # type: ignore[misc]
        self.types = [type_.dialect_impl(dialect) for _, type_ in returning]
        self.dialect = dialect
        # each column's result processor, made on the first rows (it may need the driver's
        # type code of the column, from the cursor's description, as SQLAlchemy's does): the
        # (index, processor) pairs of the columns that have one
        self.result_procs: list[tuple[int, Any]] | None = None
        self._rows_sql: dict[int, tuple[bytes, list[int], list[int], list[int]]] = {}  # see rows_sql
        self._numbered: bytes | None = None  # see numbered

    def numbered(self) -> bytes:
        """This PostgreSQL statement with its parameters numbered (``$1`` .., in :meth:`values`'
        order), as libpq takes it (store/libpq.py)."""
        if self._numbered is None:
            if self.positional:
                raise TypeError("Direct: a positional statement has no numbered form")
            index = {name: k for k, name in enumerate(self._names, start=1)}
            text = _PLACEHOLDER.sub(lambda m: f"${index[m.group(1)]}", self.sql).replace("%%", "%")
            self._numbered = text.encode()
        return self._numbered

    def rows_sql(self, n: int) -> tuple[bytes, list[int], list[int], list[int]]:
        """This PostgreSQL statement of one ``VALUES (...)`` group (an ``INSERT``'s, or an
        ``UPDATE ... FROM (VALUES ...)``'s) as one of ``n`` groups: the text, its parameters
        numbered (``$1`` ..), and the index in :meth:`values` of each parameter before the groups,
        in one group, and after them (those outside take the first set's values; cached per
        ``n``)."""
        got = self._rows_sql.get(n)
        if got is None:
            head, sep, rest = self.sql.partition("VALUES (")
            head = head.removesuffix(" ")  # " VALUES (" of an INSERT, "(VALUES (" of a FROM
            # the group's own closing paren: the parameters' parens out of the count
            bare = _PLACEHOLDER.sub(lambda m: "_" * len(m.group(0)), rest)
            depth, close = 1, -1
            for k, ch in enumerate(bare):
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    close = k
                    break
            if not sep or self.positional or close < 0 or sep in rest:
                raise TypeError("Direct.run_rows: not a statement of one VALUES group of named parameters")
            group, tail = rest[:close], rest[close + 1 :]
            before, inner, after = (
                [self._names.index(name) for name in _PLACEHOLDER.findall(text)]
                for text in (head, group, tail)
            )
            # numbered as PostgreSQL's own ($1 ..), in the text's order: psycopg parses a text of
            # %s afresh every time once it is past 4 KB or 50 parameters (a few rows of an
            # invocation), but sends a raw cursor's as it is
            numbers = iter(range(1, len(before) + n * len(inner) + len(after) + 1))

            def numbered(text: str) -> str:
                return _PLACEHOLDER.sub(lambda _m: f"${next(numbers)}", text).replace("%%", "%")

            sql = numbered(head) + ("VALUES " if head.endswith("(") else " VALUES ")
            sql += ", ".join("(" + numbered(group) + ")" for _ in range(n))
            sql += numbered(tail)
            got = self._rows_sql[n] = (sql.encode(), before, inner, after)
        return got

    def values(self, given: Mapping[str, Any]) -> list[Any]:
        """The statement's values for ``given``, in the order of its parameters, processed."""
        if self._defaults:
            absent = [(name, value) for name, value in self._defaults if name not in given]
            if absent:
                given = {**given, **dict(absent)}
        try:
            out = [given[self._names[0]]] if len(self._names) == 1 else list(self._get(given))
        except KeyError as exc:
            raise sa.exc.ArgumentError(f"a value is required for bind parameter {exc.args[0]!r}") from None
        for k, proc, none in self._procs:  # None too, as SQLAlchemy does
            value = out[k]
            out[k] = none if value is None and none is not _UNKNOWN else proc(value)
        return out

    def params(self, given: Mapping[str, Any]) -> Any:
        out = self.values(given)
        return out if self.positional else dict(zip(self._names, out, strict=True))

    def rows(self, raw: Sequence[Sequence[Any]], description: Sequence[Any] | None) -> list[Any]:
        if self.result_procs is None:
            codes = [d[1] for d in description] if description else [None] * len(self.types)
            procs = [
                t.result_processor(self.dialect, code) for t, code in zip(self.types, codes, strict=True)
            ]
            if self.dialect.name == "sqlite" and self.dialect._json_deserializer is None:
                procs = [
                    _json_first(p) if p is not None and isinstance(t, sa.JSON) else p
                    for t, p in zip(self.types, procs, strict=True)
                ]
            self.result_procs = [(k, p) for k, p in enumerate(procs) if p is not None]
        make = self.row._make
        pairs = self.result_procs
        if not pairs:
            return [make(r) for r in raw]
        out = []
        for r in raw:
            values = list(r)
            for k, proc in pairs:
                values[k] = proc(values[k])
            out.append(make(values))
        return out


class Direct(_Statement):
    """A SQLAlchemy Core statement executed through the DB-API driver (see the module docstring)."""

    def __init__(self, stmt: Any, dialect: str | None = None) -> None:
        """``dialect``: the one ``stmt`` was built for (``sqlite`` / ``postgresql``); None for a
        statement of both. Compiled for it now: a statement Direct cannot take fails here."""
        self.stmt = stmt
        self._by_dialect: dict[tuple[int, tuple[Any, ...]], tuple[Dialect, _Compiled]] = {}
        # ``literal_execute`` parameters (a claim's limit): one SQL text per value, each compiled
        # once with the value in it, as SQLAlchemy renders them at execution
        self._literal: tuple[str, ...] = ()
        for name in [dialect] if dialect is not None else list(_DIALECTS):
            compiled = stmt.compile(dialect=_DIALECTS[name]())
            self._literal = tuple(n for bp, n in compiled.bind_names.items() if bp.literal_execute)
            probe = {n: 1 for n in self._literal}
            _Compiled(stmt, _DIALECTS[name](), probe)

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        """The statement's own ``compile`` (what SQLAlchemy would run)."""
        return self.stmt.compile(*args, **kwargs)

    def _compiled(self, dialect: Dialect, params: Mapping[str, Any]) -> _Compiled:
        """The statement compiled for ``dialect`` (an engine's: its options count) and the
        values of its literal parameters in ``params``, once."""
        values = tuple(params.get(n) for n in self._literal) if self._literal else ()
        key = (id(dialect), values)
        got = self._by_dialect.get(key)
        if got is None or got[0] is not dialect:
            literal = dict(zip(self._literal, values, strict=True))
            if any(v is None for v in values):
                raise sa.exc.ArgumentError(f"a value is required for bind parameters {self._literal}")
            got = self._by_dialect[key] = (dialect, _Compiled(self.stmt, dialect, literal))
        return got[1]

    def __str__(self) -> str:
        return str(self.stmt)

    # ``Connection.execute(statement, parameters)`` calls this hook of the statement
    def _execute_on_connection(  # type: ignore[override]
        self, connection: Connection, distilled_params: Sequence[Mapping[str, Any]], execution_options: Any
    ) -> DirectResult:
        return self.run(connection, distilled_params)

    def run_rows(self, connection: Connection, param_sets: Sequence[Mapping[str, Any]]) -> DirectResult:
        """This statement of one ``VALUES`` row (``_Compiled.rows_sql``) with a row for every set
        in ``param_sets`` (in order), as one statement of up to ``ROWS_MAX`` rows (more: one per
        ``ROWS_MAX``); the ``RETURNING`` rows of them all. The parameters outside the ``VALUES``
        must be the same in every set. On SQLite, ``run``: its statements are calls, not round
        trips."""
        if connection.dialect.name != "postgresql" or len(param_sets) < 2:
            return self.run(connection, param_sets)
        rows: list[Any] = []
        count = 0
        for c, sql, flat in self._row_parts(connection, param_sets):
            got, n = self._execute(connection, c, sql, [flat], numbered=True)
            rows += got
            count += n
        return DirectResult(rows, count)

    def _row_parts(
        self, connection: Connection, param_sets: Sequence[Mapping[str, Any]]
    ) -> Iterator[tuple[_Compiled, bytes, list[Any]]]:
        """``run_rows``'s statements: each one's compiled form, text and flat values."""
        for start in range(0, len(param_sets), ROWS_MAX):
            part = param_sets[start : start + ROWS_MAX]
            c = self._compiled(connection.dialect, part[0])
            sql, before, inner, after = c.rows_sql(len(part))
            outer = before + after
            sets = [c.values(given) for given in part]
            first = sets[0]
            if outer and any(values[k] != first[k] for values in sets[1:] for k in outer):
                raise sa.exc.ArgumentError("Direct.run_rows: sets that differ outside the VALUES group")
            flat = [first[k] for k in before]
            for values in sets:
                flat += [values[k] for k in inner]
            flat += [first[k] for k in after]
            yield c, sql, flat

    def send(self, connection: Connection, params: Mapping[str, Any]) -> Sent:
        """``run`` of one parameter set, its answer left to read (:class:`Sent`): in a pipeline
        (store/libpq.py), the statement is queued, to go out with the others sent there."""
        c = self._compiled(connection.dialect, params)
        piped = open_on(connection.connection.dbapi_connection)
        if piped is not None:
            return piped.add(c, c.numbered(), c.values(params))
        return self._send(connection, c, c.sql, c.params(params))

    def send_rows(self, connection: Connection, param_sets: Sequence[Mapping[str, Any]]) -> list[Sent]:
        """``run_rows`` as ``send`` is ``run``: a :class:`Sent` per statement (PostgreSQL)."""
        if len(param_sets) < 2:
            return [self.send(connection, param_sets[0])]
        piped = open_on(connection.connection.dbapi_connection)
        return [
            piped.add(c, sql, flat)
            if piped is not None
            else self._send(connection, c, sql, flat, numbered=True)
            for c, sql, flat in self._row_parts(connection, param_sets)
        ]

    @staticmethod
    def _send(
        connection: Connection, c: _Compiled, sql: str | bytes, values: Any, *, numbered: bool = False
    ) -> Sent:
        """``sql`` with ``values`` on the driver, its answer left to :meth:`Sent.result`.
        ``numbered``: PostgreSQL's own parameters (``$1`` ..), on psycopg's raw cursor."""
        raw = connection.connection.dbapi_connection
        assert raw is not None
        if open_on(raw) is not None:  # it would run before the statements queued there
            raise RuntimeError("Direct: a statement run at once inside a pipeline (send it)")
        if numbered:
            import psycopg

            cursor: Any = psycopg.RawCursor(raw)  # type: ignore[call-overload]
        else:
            cursor = raw.cursor()
        try:
            cursor.execute(sql, values)
        except Exception as exc:
            cursor.close()
            reraise(connection, exc, sql, [values], cursor)
        return Sent(connection, c, cursor, sql, values)

    def append(self, connection: Connection, param_sets: Sequence[Mapping[str, Any]]) -> int:
        """SQLite: this ``INSERT`` (no ``RETURNING``) with each of ``param_sets`` in order, as one
        ``executemany``, up to the first set a constraint refuses: how many sets were inserted
        before it (``len(param_sets)``: all). The refused set's statement is undone by SQLite
        (ABORT: that statement alone, never the transaction), so it and the sets after it are not
        written and the caller writes them another way. Any other error is raised as ``run``
        raises it. On SQLite's ``RETURNING`` each row costs an ``execute`` and a fetch of its own
        (``_execute``); with none, the rows go in one call, in C."""
        c = self._compiled(connection.dialect, param_sets[0])
        assert not c.returns and connection.dialect.name == "sqlite"
        raw = connection.connection.dbapi_connection
        assert raw is not None
        sets = [c.params(p) for p in param_sets]
        before = raw.total_changes  # (counts every row inserted: the table has no trigger)
        cursor = raw.cursor()
        try:
            cursor.executemany(c.sql, sets)
        except sqlite3.IntegrityError:  # a key taken: the sets before it are in
            return int(raw.total_changes - before)
        except Exception as exc:  # as ``run`` raises it (store/outage.py classifies these)
            connection._handle_dbapi_exception(exc, c.sql, sets, cursor, None)
            raise
        finally:
            cursor.close()
        return len(sets)

    def run(self, connection: Connection, param_sets: Sequence[Mapping[str, Any]]) -> DirectResult:
        first: Mapping[str, Any] = param_sets[0] if param_sets else {}
        c = self._compiled(connection.dialect, first)
        if self._literal and any(p.get(n) != first.get(n) for p in param_sets for n in self._literal):
            raise sa.exc.ArgumentError(f"an executemany with different {self._literal} values")
        sets = [c.params(p) for p in param_sets] if param_sets else [c.params({})]
        rows, count = self._execute(connection, c, c.sql, sets)
        return DirectResult(rows, count)

    @staticmethod
    def _execute(
        connection: Connection, c: _Compiled, sql: str | bytes, sets: list[Any], *, numbered: bool = False
    ) -> tuple[list[Any], int]:
        """``sql`` with each of ``sets`` on the driver: the ``RETURNING`` rows, the row count.
        ``numbered``: PostgreSQL's own parameters (``$1`` ..), on psycopg's raw cursor."""
        if len(sets) == 1:
            got = Direct._send(connection, c, sql, sets[0], numbered=numbered).result()
            return got._rows, got.rowcount
        raw = connection.connection.dbapi_connection
        assert raw is not None
        cursor: Any = raw.cursor()
        described = c.result_procs is not None  # (see ``Sent.result``)
        try:
            rows: list[Any] = []
            count = 0
            description = None
            if not c.returns:
                cursor.executemany(sql, sets)
                count = cursor.rowcount
            elif connection.dialect.name == "postgresql":
                cursor.executemany(sql, sets, returning=True)
                while True:
                    description = description or (None if described else cursor.description)
                    rows += cursor.fetchall()
                    count += max(0, cursor.rowcount)
                    if not cursor.nextset():
                        break
            else:  # sqlite3's executemany takes no RETURNING: one execute per set, in C
                for one in sets:
                    cursor.execute(sql, one)
                    description = description or (None if described else cursor.description)
                    rows += cursor.fetchall()
                    count += max(0, cursor.rowcount)
        except Exception as exc:
            reraise(connection, exc, sql, sets, cursor)
        finally:
            cursor.close()
        return (c.rows(rows, description) if rows else []), count


def _sqlite() -> Dialect:
    from sqlalchemy.dialects import sqlite

    return sqlite.dialect()


def _postgresql() -> Dialect:
    from sqlalchemy.dialects.postgresql import psycopg

    return psycopg.dialect()  # type: ignore[no-untyped-call]


_DIALECTS = {"sqlite": _sqlite, "postgresql": _postgresql}
