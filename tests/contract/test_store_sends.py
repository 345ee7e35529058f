"""Two-way sends in the store (``send_append``), on SQLite and PostgreSQL: one value per yield,
refused once the body's stream has ended."""

from __future__ import annotations

import threading

from dreamlake.lakeshore import twoway, wire
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import submit


def _running_two_way(store: SqlStore) -> str:
    inv = submit(store, "gen", two_way=True)
    (claimed,) = store.claim("w", ["gen"])
    assert claimed.invocation_id == inv
    return inv


def _value(seq: int, final: bool = False) -> tuple[int, bytes, bool]:
    kind = wire.FRAME_END if final else wire.FRAME_VALUE
    return seq, wire.encode_frame(kind, seq, wire.pack(seq), {} if final else {"send": seq}), final


def test_two_sends_of_one_yield_at_once_one_is_taken_the_other_refused(store: SqlStore) -> None:
    """Two producers answering the same yield at the same moment with different values: one is
    taken, the other refused (409), never both told ok while one is silently dropped (on
    PostgreSQL both once read the same next index and the second insert did nothing)."""
    for _ in range(20):
        inv = _running_two_way(store)
        start, answers = threading.Barrier(2), {}

        def send(
            value: int, inv: str = inv, start: threading.Barrier = start, answers: dict = answers
        ) -> None:
            start.wait()
            answers[value] = store.send_append(
                inv, 0, twoway.encode_send(0, "value", wire.pack(value)), False
            )

        threads = [threading.Thread(target=send, args=(v,)) for v in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        taken = [v for v, r in answers.items() if r.ok and not r.duplicate]
        assert len(taken) == 1 and [r.status for v, r in answers.items() if v not in taken] == [409], answers
        (kept,) = store.read_frames("send:" + inv, -1, 10)
        assert bytes(kept.data) == twoway.encode_send(0, "value", wire.pack(taken[0]))  # the one told ok


def test_a_send_after_the_bodys_stream_ended_is_refused(store: SqlStore) -> None:
    """The body yielded once and returned (its END journaled; the ack comes with nymph's next poll):
    a send into it is refused (409) with why, not taken silently for a body that will never read it."""
    inv = _running_two_way(store)
    store.append_frames(inv, 1, [_value(0), _value(1, final=True)], worker_id="w")
    for index in (0, 1):
        got = store.send_append(inv, index, twoway.encode_send(index, "value", wire.pack(5)), False)
        assert (got.ok, got.status) == (False, 409) and "ended its stream" in (got.reason or ""), got
