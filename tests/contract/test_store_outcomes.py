"""``Store.outcomes(ids)``, on SQLite and PostgreSQL: the outcomes of many invocations in one read,
what a sweep's reader (``POST /v1/producer/await-batch``, the local plane's ``await_batch``) asks
for again and again. Each existing id answers its state, its result (inline bytes or a payload
store reference) or error, and its namespace (the caller's visibility is checked against it); an
id that does not exist is left out."""

from __future__ import annotations

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.api import Outcome, SubmitRequest
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import FN, ack, submit

ERR = {"type": "ValueError", "message": "bad input"}


def test_outcomes_answer_each_existing_call_as_it_stands(store: SqlStore) -> None:
    running, done, failed, big = (submit(store) for _ in range(4))
    assert [i.invocation_id for i in store.claim("w", ["q"], limit=4)] == [running, done, failed, big]
    ack(store, done, "succeeded", result_blob=b"\x01result")
    ack(store, failed, "failed", error=ERR)  # max_attempts 3, but no retry_on: no retry
    ack(store, big, "succeeded", result_ref={"key": "results/big", "size": 10})
    queued = submit(store)
    other = new_ulid()
    store.submit(
        SubmitRequest(
            invocation_id=other, queue="q", function=FN, args_blob=b"x", run_config={}, namespace="team-a"
        )
    )
    unknown = new_ulid()

    got = store.outcomes([queued, running, done, failed, big, other, unknown])

    assert all(isinstance(o, Outcome) for o in got)
    assert {o.invocation_id: o for o in got} == {
        queued: Outcome(queued, "default", "queued", None, None, None),
        running: Outcome(running, "default", "running", None, None, None),
        done: Outcome(done, "default", "succeeded", b"\x01result", None, None),
        failed: Outcome(failed, "default", "failed", None, None, ERR),
        big: Outcome(big, "default", "succeeded", None, {"key": "results/big", "size": 10}, None),
        other: Outcome(other, "team-a", "queued", None, None, None),
    }


def test_outcomes_agree_with_the_full_row(store: SqlStore) -> None:
    """The narrow read says what ``get`` says of the same fields, for every state it reads."""
    ids = [submit(store) for _ in range(3)]
    store.claim("w", ["q"], limit=2)
    ack(store, ids[0], "succeeded", result_blob=b"r")
    for o in store.outcomes(ids):
        row = store.get(o.invocation_id)
        assert row is not None
        assert (o.namespace, o.state, o.result_blob, o.result_ref, o.error) == (
            row.namespace,
            row.state,
            row.result_blob,
            row.result_ref,
            row.error,
        )


def test_outcomes_of_a_full_batch_of_ids_in_one_read(store: SqlStore) -> None:
    """1,000 ids (the batch await's most per request), nearly all unknown: one read answers the
    few that exist; no ids, no read and no outcome."""
    known = [submit(store) for _ in range(3)]
    asked = [new_ulid() for _ in range(997)] + known
    assert sorted(o.invocation_id for o in store.outcomes(asked)) == sorted(known)
    assert store.outcomes([]) == []
