"""A daemon's plain transaction of polls and acks, sent in one pipeline on PostgreSQL
(store/pipelined.py), writes and answers exactly what the same batch written statement by
statement does, on every store.

Each scenario runs twice on one store (fresh queue and workers each time): once as the product
writes it, once with the pipeline turned off (``sql.send_plain`` answering None, the sequential
path). Answers and rows are compared by role. One more test shows the pipeline is what runs on
PostgreSQL (every statement sent before any answer is read), and one that a statement failing
inside it rolls its transaction back and leaves each write to be written alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.pq import TransactionStatus

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store import direct, libpq, open_store, pipelined
from dreamlake.lakeshore.store import sql as sql_module
from dreamlake.lakeshore.store.api import AckRequest, AckResult, PollRequest, PollResult, SubmitRequest
from dreamlake.lakeshore.store.placement import Offer
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import FN


def _setup(store: SqlStore, n: int = 9) -> tuple[str, str, str, list[str], list[str]]:
    """A queue of ``n`` calls (priorities mixed); w1 runs two of them, w2 three."""
    tag = new_ulid()[-10:]
    queue, w1, w2 = f"q-{tag}", f"w1-{tag}", f"w2-{tag}"
    for i in range(n):
        store.submit(SubmitRequest(new_ulid(), queue, FN, b"a%d" % i, {"priority": i % 3}))
    (one,) = store.write_batch([PollRequest(w1, [queue], 2, exec_jobs=False)])
    (two,) = store.write_batch([PollRequest(w2, [queue], 3, exec_jobs=False)])
    assert isinstance(one, PollResult) and isinstance(two, PollResult)
    return (
        queue,
        w1,
        w2,
        [i.invocation_id for i in one.invocations],
        [i.invocation_id for i in two.invocations],
    )


def _outcome(store: SqlStore, batch: list[Any], roles: dict[str, str]) -> Any:
    """The batch's answers and its calls' rows, every id and worker by its role."""

    def role(x: str | None) -> str | None:
        return None if x is None else roles.setdefault(x, f"new{len(roles)}")

    answers: list[Any] = []
    for got in store.write_batch(batch):
        if isinstance(got, PlaneError):
            answers.append(("refused", got.status))
        elif isinstance(got, AckResult):
            answers.append(("ack", got.ok, got.duplicate, got.state, got.status if not got.ok else None))
        else:
            assert isinstance(got, PollResult)
            answers.append(
                (
                    "poll",
                    [(c.kind, role(c.body.get("invocation_id"))) for c in got.commands],
                    [(role(i.invocation_id), i.attempt, role(i.worker_id)) for i in got.invocations],
                    len(got.exec_jobs),
                    got.pinned_version,
                )
            )
    queue = next(p.queues[0] for p in batch if isinstance(p, PollRequest))
    with store.db.tx(write=False) as conn:
        rows = conn.execute(
            sa.text(
                "SELECT invocation_id, state, attempt, worker_id, result_blob FROM invocations"
                " WHERE queue = :q ORDER BY invocation_id"
            ),
            {"q": queue},
        ).all()
    table = sorted((role(r[0]), r[1], r[2], role(r[3]), r[4]) for r in rows if r[0] in roles)
    return answers, table, sum(1 for r in rows if r[1] == "queued")


def _both(store: SqlStore, monkeypatch: pytest.MonkeyPatch, scenario: Any) -> None:
    """``scenario(store)`` -> (batch, roles) written with the pipeline and without; the same."""
    seen = []
    for pipe in (True, False):
        with monkeypatch.context() as m:
            if not pipe:
                m.setattr(sql_module, "send_plain", lambda *_a: None)
            batch, roles = scenario(store)
            seen.append(_outcome(store, batch, roles))
    assert seen[0] == seen[1]


def test_acks_and_polls_of_two_workers_answer_as_written_one_by_one(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def scenario(s: SqlStore) -> tuple[list[Any], dict[str, str]]:
        queue, w1, w2, mine, theirs = _setup(s)
        s.write_batch([AckRequest(mine[1], "succeeded", 1, w1, b"r")])  # its repeat: a duplicate
        s.cancel(theirs[1])  # a cancel command waits for w2
        roles = {w1: "w1", w2: "w2", **{x: f"m{k}" for k, x in enumerate(mine)}}
        roles.update({x: f"t{k}" for k, x in enumerate(theirs)})
        batch = [
            AckRequest(mine[0], "succeeded", 1, w1, b"done"),  # applies
            PollRequest(w1, [queue], 1, exec_jobs=False),  # refills its slot
            AckRequest(theirs[0], "succeeded", 1, w2, b"theirs"),  # the run passes w1's poll
            AckRequest(mine[1], "succeeded", 1, w1, b"r"),  # a repeat: ends the run before it
            AckRequest(theirs[1], "succeeded", 2, w2, b"stale"),  # an attempt it never had
            AckRequest(theirs[2], "succeeded", 1, w1, b"forged"),  # another worker's call
            PollRequest(w2, [queue], 3, exec_jobs=False),  # the rest, and its cancel
        ]
        return batch, roles

    _both(store, monkeypatch, scenario)


def test_polls_alone_a_lone_poll_and_an_empty_queue_answer_the_same(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def scenario(s: SqlStore) -> tuple[list[Any], dict[str, str]]:
        queue, w1, w2, mine, theirs = _setup(s, n=6)
        roles = {w1: "w1", w2: "w2", **{x: f"m{k}" for k, x in enumerate(mine + theirs)}}
        s.create_exec(
            "default",
            "true",
            payload_inline=None,
            payload_ref=None,
            queue=queue,
            worker_id=None,
            timeout_s=None,
        )
        batch = [
            PollRequest(w1, [queue], 4),  # one call left to claim, then the exec job
            PollRequest(w2, [queue, f"{queue}-empty"], 2, exec_jobs=False),  # nothing left
            PollRequest(w2, [], 1),  # no queue: its duties only
        ]
        return batch, roles

    _both(store, monkeypatch, scenario)


def test_acks_the_pipeline_does_not_take_are_written_as_before(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure (the retry rule reads first), and two acks of one call, go the sequential way."""

    def scenario(s: SqlStore) -> tuple[list[Any], dict[str, str]]:
        queue, w1, w2, mine, theirs = _setup(s)
        roles = {w1: "w1", w2: "w2", **{x: f"m{k}" for k, x in enumerate(mine + theirs)}}
        batch = [
            AckRequest(mine[0], "succeeded", 1, w1, b"once"),
            AckRequest(mine[0], "succeeded", 1, w1, b"twice"),
            AckRequest(theirs[0], "failed", 1, w2, None, {"type": "E", "message": "m"}),
            PollRequest(w1, [queue], 2, exec_jobs=False),
        ]
        return batch, roles

    _both(store, monkeypatch, scenario)


@pytest.fixture
def pg_store(pg_session_url: str) -> Iterator[SqlStore]:
    """PostgreSQL's store alone: the pipeline is its (a SQLite statement is a call, not a trip)."""
    s = open_store(pg_session_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the store does with its driver connection, in order: a pipeline entered, a statement
    sent (queued in the pipeline, or run at once), a sync (a pipeline's round trip: every answer
    read up to its ``Sync``), the pipeline left with the transaction committed ("synced") or still
    open ("open"), an answer read."""
    seen: list[str] = []
    send, add, result, pipe, answers = (
        direct.Direct._send,
        libpq.Pipeline.add,
        libpq.Sent.result,
        libpq.pipeline,
        libpq._read,
    )

    def sending(*a: Any, **kw: Any) -> Any:
        seen.append("send")
        return send(*a, **kw)

    def adding(self: Any, *a: Any) -> Any:
        seen.append("send")
        return add(self, *a)

    def syncing(*a: Any) -> Any:
        seen.append("sync")
        return answers(*a)

    def reading(self: Any) -> Any:
        seen.append("read")
        return result(self)

    class Piped:
        def __init__(self, conn: Any) -> None:
            self._conn = conn
            self._inner = pipe(conn)

        def __enter__(self) -> Any:
            seen.append("pipeline")
            return self._inner.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            got = self._inner.__exit__(*exc)
            raw = self._conn.connection.dbapi_connection
            seen.append("synced" if raw.info.transaction_status == TransactionStatus.IDLE else "open")
            return got

    monkeypatch.setattr(direct.Direct, "_send", staticmethod(sending))
    monkeypatch.setattr(libpq.Pipeline, "add", adding)
    monkeypatch.setattr(libpq, "_read", syncing)
    monkeypatch.setattr(libpq.Sent, "result", reading)
    monkeypatch.setattr(pipelined, "pipeline", Piped)
    return seen


def test_on_postgresql_a_busy_daemons_transaction_is_one_round_trip(
    pg_store: SqlStore, events: list[str]
) -> None:
    """BEGIN, the duties, the ack's UPDATE, the claim and COMMIT sent together, one sync, then the
    three answers read (a poll that claims no exec job needs no answer before its COMMIT)."""
    queue, w1, _w2, mine, _theirs = _setup(pg_store)
    events.clear()
    ack, polled = pg_store.write_batch(
        [AckRequest(mine[0], "succeeded", 1, w1, b"r"), PollRequest(w1, [queue], 1, exec_jobs=False)]
    )
    assert isinstance(ack, AckResult) and ack.ok and not ack.duplicate
    assert isinstance(polled, PollResult) and len(polled.invocations) == 1
    assert events == ["pipeline", "send", "send", "send", "sync", "synced", "read", "read", "read"]
    got = pg_store.get(mine[0])
    assert got is not None and (got.state, got.result_blob) == ("succeeded", b"r")


def test_a_poll_that_may_claim_exec_jobs_keeps_its_transaction_open_for_them(
    pg_store: SqlStore, events: list[str]
) -> None:
    """How many exec jobs it may take is known from its claim's answer: the COMMIT waits for it,
    and the exec job is claimed in the same transaction."""
    queue, w1, _w2, _mine, _theirs = _setup(pg_store, n=6)  # one call left
    exec_id = pg_store.create_exec(
        "default", "true", payload_inline=None, payload_ref=None, queue=queue, worker_id=None, timeout_s=None
    )
    events.clear()
    (polled,) = pg_store.write_batch([PollRequest(w1, [queue], 3)])
    assert isinstance(polled, PollResult) and len(polled.invocations) == 1
    assert [j["exec_id"] for j in polled.exec_jobs] == [exec_id]
    # BEGIN, the duties and the claim in one round trip, the transaction left open; then the
    # claim's answer read, and the exec job claimed after it
    assert events[:6] == ["pipeline", "send", "send", "sync", "open", "read"]


def test_a_statement_failing_in_the_pipeline_fails_that_write_alone(
    pg_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transaction is rolled back (the ack sent before the failing claim is not kept from it)
    and each write is written alone: the ack applies, the poll answers its 500."""
    store = pg_store
    queue, w1, _w2, mine, _theirs = _setup(store)
    real = pipelined.claim_params

    def failing(*a: Any, **kw: Any) -> Any:
        _stmt, params = real(*a, **kw)
        return direct.Direct(sa.select(sa.literal_column("1 / 0")), "postgresql"), params

    monkeypatch.setattr(pipelined, "claim_params", failing)
    ack, polled = store.write_batch(
        [AckRequest(mine[0], "succeeded", 1, w1, b"kept"), PollRequest(w1, [queue], 1, exec_jobs=False)]
    )
    assert isinstance(ack, AckResult) and ack.ok and not ack.duplicate
    assert isinstance(polled, PlaneError) and polled.status == 500
    got = store.get(mine[0])
    assert got is not None and (got.state, got.result_blob, got.attempt) == ("succeeded", b"kept", 1)
    # the store goes on: the same poll, the pipeline back as it is, claims
    monkeypatch.setattr(pipelined, "claim_params", real)
    (again,) = store.write_batch([PollRequest(w1, [queue], 1, exec_jobs=False)])
    assert isinstance(again, PollResult) and len(again.invocations) == 1


def test_a_refused_acks_reason_read_after_the_commit_fails_that_ack_alone(
    pg_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With COMMIT in the pipeline, why an ack did not apply is read in a transaction of its own:
    should that read fail, that ack answers the store's error (its daemon sends it again) and the
    committed writes stand, answered as written: nothing is written twice."""
    queue, w1, w2, mine, theirs = _setup(pg_store)

    def broken(*_a: Any, **_kw: Any) -> Any:
        raise RuntimeError("the read failed")

    monkeypatch.setattr(SqlStore, "_acks_checked_in", broken)
    good, forged, polled = pg_store.write_batch(
        [
            AckRequest(mine[0], "succeeded", 1, w1, b"mine"),
            AckRequest(theirs[0], "succeeded", 1, w1, b"forged"),  # w2's call: not applied
            PollRequest(w1, [queue], 2, exec_jobs=False),
        ]
    )
    assert isinstance(forged, PlaneError) and forged.status == 500
    assert isinstance(good, PlaneError)  # (its run's read failed: which of the two applied is unknown)
    assert isinstance(polled, PollResult) and len(polled.invocations) == 2
    row = pg_store.get(mine[0])
    assert row is not None and (row.state, row.result_blob) == ("succeeded", b"mine")
    other = pg_store.get(theirs[0])
    assert other is not None and (other.state, other.worker_id) == ("running", w2)
    monkeypatch.undo()
    # sent again, each gets its answer; the claimed calls are w1's, running, claimed once
    again, forged_again = pg_store.write_batch(
        [
            AckRequest(mine[0], "succeeded", 1, w1, b"mine"),
            AckRequest(theirs[0], "succeeded", 1, w1, b"forged"),
        ]
    )
    assert isinstance(again, AckResult) and again.ok and again.duplicate
    assert isinstance(forged_again, AckResult) and not forged_again.ok
    for inv in polled.invocations:
        got = pg_store.get(inv.invocation_id)
        assert got is not None and (got.state, got.worker_id, got.attempt) == ("running", w1, 1)


def test_two_passes_of_one_worker_leave_its_last_offer_and_nothing_runs_after_the_commit(
    pg_store: SqlStore, events: list[str]
) -> None:
    """Its free GPUs are written once, the last pass's, with the rest: no statement after the
    pipeline's COMMIT (it would begin a transaction of its own)."""
    queue, w1, _w2, _mine, _theirs = _setup(pg_store)
    pg_store.register_worker(w1, {"slots": 4})
    (first,) = pg_store.write_batch([PollRequest(w1, [queue], 1, exec_jobs=False, offer=Offer.of(gpus=1))])
    assert isinstance(first, PollResult)
    events.clear()
    got = pg_store.write_batch(
        [
            PollRequest(w1, [queue], 1, exec_jobs=False, offer=Offer.of(gpus=2)),
            PollRequest(w1, [queue], 1, exec_jobs=False, offer=Offer.of(gpus=0)),
        ]
    )
    assert all(isinstance(g, PollResult) and len(g.invocations) == 1 for g in got)
    synced = events.index("synced")
    assert "sync" in events[:synced] and set(events[synced + 1 :]) == {"read"}
    assert events.count("sync") == 1
    with pg_store.db.tx(write=False) as conn:
        free = conn.execute(sa.text("SELECT free_gpus FROM workers WHERE worker_id = :w"), {"w": w1}).scalar()
    assert free == 0


def test_a_connection_lost_under_the_pipeline_is_written_again_on_a_new_one(
    pg_store: SqlStore, pg_session_url: str
) -> None:
    """The write connection's backend ended (a restart, a failover) between two transactions:
    the pipeline's sync finds it gone, nothing was committed, and the batch is written once on a
    new connection (``retry_on_disconnect``), each write answered as written."""
    import psycopg

    queue, w1, _w2, mine, _theirs = _setup(pg_store)
    writer = pg_store.db._writer
    assert writer is not None
    backend = writer.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
    with psycopg.connect(pg_session_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [backend])
    ack, polled = pg_store.write_batch(
        [AckRequest(mine[0], "succeeded", 1, w1, b"once"), PollRequest(w1, [queue], 2, exec_jobs=False)]
    )
    assert isinstance(ack, AckResult) and ack.ok and not ack.duplicate
    assert isinstance(polled, PollResult) and len(polled.invocations) == 2
    for inv in polled.invocations:
        got = pg_store.get(inv.invocation_id)
        assert got is not None and (got.state, got.worker_id, got.attempt) == ("running", w1, 1)
    got = pg_store.get(mine[0])
    assert got is not None and (got.state, got.result_blob) == ("succeeded", b"once")
    again = pg_store.db._writer
    assert again is not None and again.connection.driver_connection.info.backend_pid != backend  # type: ignore[union-attr]


def _writer_prepared(store: SqlStore) -> set[str]:
    """The names of the statements prepared on the store's write connection (its session's)."""
    writer = store.db._writer
    assert writer is not None
    raw = writer.connection.driver_connection
    with raw.cursor() as cur:  # type: ignore[union-attr]
        cur.execute("SELECT name FROM pg_prepared_statements")
        names = {row[0] for row in cur.fetchall()}
    raw.commit()  # type: ignore[union-attr]  # (psycopg's rollback would deallocate them all)
    return names


def test_the_pipelines_statements_are_prepared_once_on_the_connection(pg_store: SqlStore) -> None:
    """Each statement text is prepared on the write connection by its first pipeline and executed
    by name after that (PostgreSQL plans it once): later pipelines prepare nothing more."""
    queue, w1, w2, mine, theirs = _setup(pg_store, n=12)
    batch = [
        AckRequest(mine[0], "succeeded", 1, w1, b"r"),
        PollRequest(w1, [queue], 1, exec_jobs=False),
        AckRequest(theirs[0], "succeeded", 1, w2, b"r"),
        PollRequest(w2, [queue], 1, exec_jobs=False),
    ]
    pg_store.write_batch(batch)
    ours = {n for n in _writer_prepared(pg_store) if n.startswith("_lakeshore_")}
    assert len(ours) >= 3  # the duties, the acks' UPDATE, the claim
    got = pg_store.write_batch(
        [
            AckRequest(mine[1], "succeeded", 1, w1, b"r"),
            PollRequest(w1, [queue], 1, exec_jobs=False),
            AckRequest(theirs[1], "succeeded", 1, w2, b"r"),
            PollRequest(w2, [queue], 1, exec_jobs=False),
        ]
    )
    assert [type(g) for g in got] == [AckResult, PollResult, AckResult, PollResult]
    assert {n for n in _writer_prepared(pg_store) if n.startswith("_lakeshore_")} == ours


def test_statements_deallocated_under_the_store_cost_one_batch_written_the_slow_way(
    pg_store: SqlStore, events: list[str]
) -> None:
    """psycopg deallocates every prepared statement of a connection when it rolls back a
    transaction it had prepared in: a rollback not through the store leaves the pipeline's names
    gone. That batch is written the sequential way, answered as written; the next pipeline
    prepares its statements again, one round trip as before."""
    queue, w1, _w2, mine, _theirs = _setup(pg_store, n=8)
    writer = pg_store.db._writer
    assert writer is not None
    raw = writer.connection.driver_connection
    raw.execute("DEALLOCATE ALL")  # type: ignore[union-attr]
    raw.rollback()  # type: ignore[union-attr]
    events.clear()
    ack, polled = pg_store.write_batch(
        [AckRequest(mine[0], "succeeded", 1, w1, b"once"), PollRequest(w1, [queue], 1, exec_jobs=False)]
    )
    assert isinstance(ack, AckResult) and ack.ok and not ack.duplicate
    assert isinstance(polled, PollResult) and len(polled.invocations) == 1
    # the first pipeline raised at its sync (not left "synced" or "open"); then each write alone
    assert events[:5] == ["pipeline", "send", "send", "send", "sync"] and events[5] not in ("synced", "open")
    got = pg_store.get(mine[0])
    assert got is not None and (got.state, got.result_blob, got.attempt) == ("succeeded", b"once", 1)
    claimed = pg_store.get(polled.invocations[0].invocation_id)
    assert claimed is not None and (claimed.state, claimed.worker_id, claimed.attempt) == ("running", w1, 1)
    events.clear()
    ack2, polled2 = pg_store.write_batch(
        [AckRequest(mine[1], "succeeded", 1, w1, b"r"), PollRequest(w1, [queue], 1, exec_jobs=False)]
    )
    assert isinstance(ack2, AckResult) and ack2.ok
    assert isinstance(polled2, PollResult) and len(polled2.invocations) == 1
    assert events.count("sync") == 1 and "synced" in events
