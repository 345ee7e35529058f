"""A group commit's submits each get their own answer whatever else is in the batch.

On SQLite the submits of a batch go in as one ``executemany`` up to the first row a key refuses
(``Direct.append``); that row and those after it are written again one by one, each told apart
(new, a repeat, a clash). These tests put the refused row first, in the middle and last, with
more conflicts behind it, and check every answer and every row against the same submits written
one at a time, on every store.
"""

from __future__ import annotations

from typing import Any

import pytest

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.api import SubmitRequest, SubmitResult
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import FN


def _batch(queue: str, kind: str, at: int, earlier: str) -> list[SubmitRequest]:
    """Five new submits with a conflict of ``kind`` before the one at ``at`` ("several": a
    repeat there, then a repeat of the first new one, a taken key and a clash after them)."""
    fresh = [SubmitRequest(new_ulid(), queue, FN, b"n%d" % i, {"priority": i}) for i in range(5)]
    conflict = {
        "repeat": SubmitRequest(earlier, queue, FN, b"earlier", {"priority": 7}),
        "clash": SubmitRequest(earlier, queue, FN, b"other bytes", {"priority": 7}),
        "key": SubmitRequest(new_ulid(), queue, FN, b"k", {"key": "taken"}),
        "same-batch": fresh[0],
    }
    if kind == "several":
        later = [fresh[0], conflict["key"], conflict["clash"]]
        return [*fresh[:at], conflict["repeat"], *fresh[at:], *later]
    return [*fresh[:at], conflict[kind], *fresh[at:]]


def _written(store: SqlStore, queue: str, kind: str, at: int, together: bool) -> Any:
    """The answers and rows of the batch written in one group commit, or each submit alone; ids
    named by their role (each run mints its own)."""
    earlier, keyed = new_ulid(), new_ulid()
    store.submit(SubmitRequest(earlier, queue, FN, b"earlier", {"priority": 7}))
    store.submit(SubmitRequest(keyed, queue, FN, b"kk", {"key": "taken"}))
    batch = _batch(queue, kind, at, earlier)
    results: list[SubmitResult | PlaneError] = []
    if together:
        results = store.write_batch(batch)  # type: ignore[assignment]
    else:
        for req in batch:
            try:
                results.append(store.submit(req))
            except PlaneError as exc:
                results.append(exc)
    names = {earlier: "earlier", keyed: "keyed"}
    for req in batch:
        names.setdefault(req.invocation_id, f"new-{req.args_blob.decode()}")
    answers = [
        ("refused", r.status)
        if isinstance(r, PlaneError)
        else ("ok", names[r.invocation_id], r.queue == queue, r.duplicate)
        for r in results
    ]
    rows = sorted((names[i.invocation_id], i.args_blob) for i in store.claim("w", [queue], limit=50))
    return answers, rows


@pytest.mark.parametrize("kind", ["repeat", "clash", "key", "same-batch", "several"])
@pytest.mark.parametrize("at", [0, 2, 5])
def test_each_submit_of_a_batch_is_answered_as_if_written_alone(store: SqlStore, kind: str, at: int) -> None:
    at = max(at, 1) if kind in ("same-batch", "several") else at  # (a repeat of the first new row)
    together = _written(store, "together", kind, at, True)
    alone = _written(store, "alone", kind, at, False)
    assert together == alone
    answers, rows = together
    new = {a[1] for a in answers if a[0] == "ok" and not a[3]}
    assert len(new) == 5 and all(a[2] for a in answers if a[0] == "ok")
    assert [r[0] for r in rows] == sorted(["earlier", "keyed", *new])  # every new row in, once
    expected = {"clash": ("refused", 409), "repeat": ("ok", "earlier", True, True)}
    if kind in expected:
        assert answers[at] == expected[kind]
