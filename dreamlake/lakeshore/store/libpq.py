"""A statement sent now and answered later (:class:`Sent`), and a transaction's statements sent on
libpq's own pipeline, one round trip and one flush for them all (:func:`pipeline`; PostgreSQL).

psycopg has a pipeline mode of its own, and store/pipelined.py used it first: every statement a
cursor's ``execute``, each followed by psycopg's pipeline step (a wait for the socket, a flush, a
read of what has come back). That is about 45 us of the writer thread's CPU per statement, and a
system call or two each, every one of which lets go of the GIL the server's event loop then holds
(measured on this project's machine: a transaction of six statements, 250-270 us of CPU through
psycopg's cursors and its pipeline, 45-63 us here). So a pipeline here queues the statements
(:meth:`Pipeline.add`) and, at its exit, sends them all through psycopg's libpq wrapper
(``psycopg.pq``, public): the parameters dumped by a ``psycopg.adapt.Transformer`` of the
connection (the adapters, and so the values, a cursor would send), each statement text prepared
server-side once per connection and parameter types (as psycopg's ``prepare_threshold`` does for
its cursors; none where that is None), one ``Sync``, one flush, then every answer read, and each
:class:`Sent` given its result. The driver connection is psycopg's throughout; its lock is held while the pipeline runs,
and libpq's pipeline mode is left before it is handed back, with every answer read.

Errors are raised as :meth:`Direct.run` raises one (:func:`reraise`: SQLAlchemy's own handler,
``connection_invalidated`` on a lost connection): a statement's error (PostgreSQL then runs
nothing more of the pipeline, the transaction only fit to be rolled back) at the exit, the first
one; a lost connection where it is seen. A connection left in an unknown state (libpq's pipeline
mode could not be left) is closed, so SQLAlchemy replaces it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import select
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

PREPARED_MAX = 256  # statement texts (and parameter types) prepared per connection; more go unprepared
_NO_SUCH_STATEMENT = "26000"  # PostgreSQL's invalid_sql_statement_name


class Compiled(Protocol):
    """What a :class:`Sent` uses of direct.py's compiled statement."""

    returns: bool
    result_procs: list[tuple[int, Any]] | None

    def rows(self, raw: Sequence[Sequence[Any]], description: Sequence[Any] | None) -> list[Any]: ...


class DirectResult:
    """What :class:`Direct` answers: the ``RETURNING`` rows (``first``, ``fetchall``, ``all``,
    ``scalars``, iteration) and ``rowcount``."""

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Any]:
        return list(self._rows)

    all = fetchall

    def scalars(self) -> list[Any]:
        return [r[0] for r in self._rows]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one_or_none(self) -> Any:
        if len(self._rows) > 1:
            raise sa.exc.MultipleResultsFound("multiple rows were found when one or none was required")
        return self.scalar()

    def scalar_one(self) -> Any:
        if len(self._rows) != 1:
            raise (sa.exc.NoResultFound if not self._rows else sa.exc.MultipleResultsFound)(
                "exactly one row was required"
            )
        return self._rows[0][0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


class Sent:
    """A statement whose answer is read later (:meth:`result`): executed on a driver cursor
    (outside a pipeline: its answer has arrived), or queued in a :func:`pipeline`, answered once
    the pipeline has synced (its exit)."""

    __slots__ = ("_answer", "_c", "_connection", "_cursor", "_sql", "_tx", "_values")

    def __init__(self, connection: Connection, c: Compiled, cursor: Any, sql: str | bytes, values: Any):
        self._connection, self._c, self._cursor, self._sql, self._values = connection, c, cursor, sql, values
        self._answer: Any = None  # (a pipeline's) the statement's PGresult
        self._tx: Any = None  # (a pipeline's) the Transformer that loads its rows

    def close(self) -> None:
        """Let go of the statement unread (its pipeline failed)."""
        if self._cursor is not None:
            self._cursor.close()
        self._answer = None

    def result(self) -> DirectResult:
        """The ``RETURNING`` rows and the row count, as :meth:`Direct.run` answers them."""
        c = self._c
        if self._cursor is None:
            return self._piped(c)
        cursor = self._cursor
        # the columns' description only until the result processors are made from it: psycopg
        # builds it anew on every read, an object per column (a claim's row has 37)
        description = None
        rows: list[Any] = []
        try:
            if c.returns:
                description = None if c.result_procs is not None else cursor.description
                rows = cursor.fetchall()
            count = cursor.rowcount
        except Exception as exc:
            reraise(self._connection, exc, self._sql, [self._values], cursor)
        finally:
            cursor.close()
        return DirectResult(c.rows(rows, description) if rows else [], count)

    def _piped(self, c: Compiled) -> DirectResult:
        res = self._answer
        if res is None:
            raise RuntimeError("a pipelined statement read before its pipeline synced")
        rows: list[Any] = []
        description = None
        if c.returns and res.ntuples:
            if c.result_procs is None:  # (as a cursor's description: the type code second)
                description = [(None, res.ftype(k)) for k in range(res.nfields)]
            self._tx.set_pgresult(res)
            rows = c.rows(self._tx.load_rows(0, res.ntuples, tuple), description)
        count = res.command_tuples
        return DirectResult(rows, -1 if count is None else count)


def reraise(connection: Connection, exc: Exception, sql: str | bytes, sets: Any, cursor: Any) -> NoReturn:
    """A driver error raised as SQLAlchemy raises it: wrapped in DBAPIError, a lost connection
    invalidated (its own handler, which always raises)."""
    connection._handle_dbapi_exception(exc, sql if isinstance(sql, str) else sql.decode(), sets, cursor, None)
    raise exc  # (not reached)


@functools.cache
def pipeline_supported() -> bool:
    """Whether psycopg's libpq takes pipeline mode (libpq 14 and later; its binary wheels' does)."""
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


# The statements prepared on each connection: (text, parameter types) -> name. The names are
# never used twice in a process: one forgotten (``forget``) may still be prepared on its connection.
_PREPARED: weakref.WeakKeyDictionary[Any, dict[tuple[bytes, tuple[int, ...]], bytes]] = (
    weakref.WeakKeyDictionary()
)
_NUMBERS = itertools.count()
_OPEN: dict[int, Pipeline] = {}  # id(driver connection) -> its pipeline now open (the writer's thread)


def forget(raw: Any) -> None:
    """Forget what was prepared on driver connection ``raw``: psycopg's rollback of an open
    transaction deallocates every prepared statement of the connection (``DEALLOCATE ALL``; the
    store's rollbacks call this first). A name used after all the same (a rollback not through
    the store) fails its pipeline with ``invalid_sql_statement_name``, which forgets them too:
    that batch is written the sequential way, the next pipeline prepares its statements again.
    A rollback that deallocated nothing (psycopg had prepared nothing of its own) leaves them on
    the connection, unused, under names not used again."""
    with contextlib.suppress(TypeError):  # (a connection with no weak reference: never prepared)
        _PREPARED.pop(raw, None)


def open_on(raw: Any) -> Pipeline | None:
    """The pipeline open on driver connection ``raw``, if any (:meth:`Direct.send` queues in it)."""
    return _OPEN.get(id(raw)) if _OPEN else None


class Pipeline:
    """What :func:`pipeline` yields: the statements queued (:meth:`add`), the transaction's own
    ``COMMIT`` among them (:meth:`commit`)."""

    __slots__ = ("_connection", "_queue", "_raw")

    def __init__(self, connection: Connection, raw: Any) -> None:
        self._connection, self._raw = connection, raw
        # (text, values: None for a command of no parameters, its Sent: None for a command)
        self._queue: list[tuple[bytes, list[Any] | None, Sent | None]] = []

    def commit(self) -> None:
        """``COMMIT`` after the statements queued so far, in the same round trip. Once the pipeline
        has synced without an error, the transaction is committed and the driver's connection idle
        (the caller's commit then sends nothing; a statement after it begins a transaction of its
        own). An error of a statement before it skips it (PostgreSQL runs nothing more of the
        pipeline): raised at the exit, the transaction then only fit to be rolled back."""
        self._queue.append((b"COMMIT", None, None))

    def add(self, c: Compiled, sql: bytes, values: list[Any]) -> Sent:
        """Queue ``sql`` (PostgreSQL's own parameters, ``$1`` ..) with ``values``: its answer is
        read from the :class:`Sent` once the pipeline has synced."""
        sent = Sent(self._connection, c, None, sql, values)
        self._queue.append((sql, values, sent))
        return sent

    def _run(self) -> None:
        """Send the queue, one ``Sync``, and read every answer; raise the first error."""
        from psycopg import errors, pq
        from psycopg.adapt import PyFormat, Transformer

        if not self._queue:
            return
        raw, pg = self._raw, self._raw.pgconn
        if not raw.autocommit and pg.transaction_status == pq.TransactionStatus.IDLE:
            # the transaction's BEGIN first, as psycopg sends it before a statement (its text for
            # the connection's settings), in the same round trip
            start = getattr(raw, "_get_tx_start_command", None)  # (psycopg's; its settings unset: BEGIN)
            self._queue.insert(0, (start() if start is not None else b"BEGIN", None, None))
        tx = Transformer(raw)
        names = _PREPARED.get(raw)
        if names is None:
            names = _PREPARED[raw] = {}
        # none prepared where psycopg prepares none (``prepare_threshold`` None: a pooler such as
        # PgBouncer in transaction mode, whose server connections do not keep them)
        prepares = raw.prepare_threshold is not None
        # each command: its text, its values dumped (None: a command of none), their types and
        # formats, and what it answers: a Sent, None (BEGIN, COMMIT); dumped before anything is sent
        commands: list[tuple[bytes, Sequence[Any] | None, tuple[int, ...], Any, Sent | None]] = []
        for sql, values, sent in self._queue:
            if values is None:
                commands.append((sql, None, (), None, None))
                continue
            try:  # (a value no adapter takes: psycopg's ProgrammingError, as a cursor raises it)
                dumped = tx.dump_sequence(values, [PyFormat.AUTO] * len(values))
            except Exception as exc:
                reraise(self._connection, exc, sql, [values], None)
            commands.append((sql, dumped, tuple(tx.types or ()), tx.formats, sent))
            assert sent is not None
            sent._tx = tx
        # what each command sent answers: a Sent, a (key, name) prepared, or None
        expect: list[Any] = []
        with raw.lock:
            try:
                pg.enter_pipeline_mode()
                for sql, params, types, formats, sent in commands:
                    if params is None:
                        pg.send_query_params(sql, None)
                        expect.append(None)
                        continue
                    key = (sql, types)
                    name = names.get(key)
                    if name is None and len(names) < PREPARED_MAX and prepares:
                        name = b"_lakeshore_%d" % next(_NUMBERS)
                        pg.send_prepare(name, sql, types)
                        expect.append((key, name))
                    if name is not None:
                        pg.send_query_prepared(name, params, formats)
                    else:
                        pg.send_query_params(sql, params, types, formats)
                    expect.append(sent)
                pg.pipeline_sync()
                _flush(pg)
                answers = _read(pg, pq.ExecStatus.PIPELINE_SYNC)
            except BaseException as exc:
                self._lost(pg)
                if not isinstance(exc, Exception):
                    raise
                reraise(self._connection, exc, "(the statements of a pipeline)", (), None)
            try:
                pg.exit_pipeline_mode()
            except Exception as exc:  # (every answer read: not expected) the connection unfit
                self._lost(pg)
                reraise(self._connection, exc, "(the statements of a pipeline)", (), None)
        first: tuple[Exception, str | bytes] | None = None
        for what, results in zip(expect, answers, strict=True):
            res = results[-1]
            if res.status == pq.ExecStatus.FATAL_ERROR:
                if first is None:
                    text = what._sql if isinstance(what, Sent) else b"(a statement of a pipeline)"
                    first = (errors.error_from_result(res, encoding=raw.info.encoding), text)
            elif isinstance(what, Sent):
                what._answer = res if res.status != pq.ExecStatus.PIPELINE_ABORTED else None
            elif what is not None and res.status == pq.ExecStatus.COMMAND_OK:
                names[what[0]] = what[1]  # prepared: its later executions use the name
        if first is not None:
            if getattr(first[0], "sqlstate", None) == _NO_SUCH_STATEMENT:
                forget(raw)
            reraise(self._connection, first[0], first[1], (), None)

    def _lost(self, pg: Any) -> None:
        """The connection's state unknown: closed, so that SQLAlchemy replaces it."""
        with contextlib.suppress(Exception):
            pg.exit_pipeline_mode()
        if pg.pipeline_status:  # still in pipeline mode: unfit for psycopg's next statement
            with contextlib.suppress(Exception):
                self._raw.close()


def _wait(fd: int, events: int) -> int:
    poller = select.poll()
    poller.register(fd, events)
    while not (got := poller.poll()):
        continue
    return got[0][1]


def _flush(pg: Any) -> None:
    """Send what libpq holds, reading what comes back meanwhile (nothing blocks on a full buffer)."""
    while pg.flush():
        if _wait(pg.socket, select.POLLIN | select.POLLOUT) & select.POLLIN:
            pg.consume_input()


def _read(pg: Any, sync: Any) -> list[list[Any]]:
    """Every command's results, in order, up to the pipeline's ``Sync`` (psycopg's own loop)."""
    out: list[list[Any]] = []
    res: list[Any] = []
    while True:
        pg.consume_input()
        while not pg.is_busy():
            r = pg.get_result()
            if r is None:
                if not res:
                    break
                out.append(res)
                res = []
            elif r.status == sync:
                return out
            else:
                res.append(r)
        _wait(pg.socket, select.POLLIN)


@contextlib.contextmanager
def pipeline(connection: Connection) -> Iterator[Pipeline]:
    """A pipeline on ``connection``'s driver connection (PostgreSQL): the statements sent in it
    (:meth:`Direct.send`, :meth:`Direct.send_rows`; nothing that reads its answer at once) are
    queued, and its exit sends them all, syncs once (one round trip for them all) and reads every
    answer, each then held by its :class:`Sent`. The transaction's ``BEGIN`` goes first when
    none is open (psycopg's text, as it would begin one), and its ``COMMIT`` may go last
    (:meth:`Pipeline.commit`). An error of any statement
    is raised at the exit (those after it are not run: PostgreSQL aborts the rest of the pipeline,
    and the transaction is then only fit to be rolled back), wrapped as :meth:`Direct.run` wraps
    one. Nothing is sent when the block raises."""
    raw = connection.connection.dbapi_connection
    assert raw is not None
    if id(raw) in _OPEN:
        raise RuntimeError("a pipeline opened inside a pipeline on the same connection")
    handle = _OPEN[id(raw)] = Pipeline(connection, raw)
    try:
        yield handle
    finally:
        del _OPEN[id(raw)]
    handle._run()
