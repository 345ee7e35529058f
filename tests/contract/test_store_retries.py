"""Retries mean what they say (issue 12, item 4), on every store (SQLite file and memory, PostgreSQL).

Before: ``max_attempts`` (``1/3`` on every status) only ever requeued a lapsed lease; a user
exception or a crashed process failed on attempt 1. Now a failure named by ``run_config.retry_on``
(by type, or a base class the worker reported in ``mro``) or a crash (``ProcessExited``) queues the
next attempt, claimable only after its backoff; outcomes no retry can change never retry; every
attempt's outcome is kept; a repeated ack of a retried attempt is a duplicate, not a refusal.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from dreamlake.lakeshore.store.api import AckRequest, AckResult
from dreamlake.lakeshore.store.sql import SqlStore
from tests.contract.store_kit import ack, submit

TIMEOUT_ERR = {"type": "TimeoutError", "message": "the backend did not answer"}
MRO = ["ConnectionRefusedError", "ConnectionError", "OSError", "Exception", "BaseException"]


def _fail(store: SqlStore, inv: str, attempt: int, error: dict[str, Any], state: str = "failed") -> AckResult:
    return ack(store, inv, state, attempt=attempt, worker_id="w", error=error)


def test_a_listed_failure_is_retried_after_its_backoff_then_fails_at_max_attempts(store: SqlStore) -> None:
    inv = submit(store, max_attempts=3, retry_on=["TimeoutError"], backoff_s=30)
    assert store.claim("w", ["q"])[0].attempt == 1
    before = time.time()
    got = _fail(store, inv, 1, TIMEOUT_ERR)
    assert got.ok and got.state == "queued" and not got.duplicate
    row = store.get(inv)
    assert row is not None and (row.state, row.worker_id, row.attempt) == ("queued", None, 1)
    assert row.not_before is not None and before + 30 <= row.not_before <= time.time() + 30
    assert row.status()["retry_at"] == row.not_before and row.error == TIMEOUT_ERR
    assert store.claim("w", ["q"]) == []  # not before its time
    store.expire_leases(now=time.time() + 5)
    assert store.claim("w", ["q"]) == []
    store.expire_leases(now=row.not_before + 0.01)  # the sweep makes it claimable
    assert store.claim("w", ["q"])[0].attempt == 2
    _fail(store, inv, 2, TIMEOUT_ERR)
    row = store.get(inv)
    assert row is not None and row.not_before is not None and row.not_before >= time.time() + 59  # 30 * 2
    store.expire_leases(now=row.not_before + 0.01)
    assert store.claim("w", ["q"])[0].attempt == 3
    last = _fail(store, inv, 3, TIMEOUT_ERR)
    assert last.ok and last.state == "failed"  # the last allowed attempt: final
    row = store.get(inv)
    assert row is not None and row.state == "failed" and row.finished_at is not None
    history = store.attempts(inv)
    assert [(a["attempt"], a["state"]) for a in history] == [(1, "failed"), (2, "failed"), (3, "failed")]
    assert [a["error"]["type"] for a in history] == ["TimeoutError"] * 3
    assert history[0]["retry_at"] is not None and history[0]["worker_id"] == "w"
    assert history[2]["retry_at"] is None


def test_an_exception_not_listed_fails_on_attempt_1(store: SqlStore) -> None:
    inv = submit(store, max_attempts=3, retry_on=["TimeoutError"])
    store.claim("w", ["q"])
    assert _fail(store, inv, 1, {"type": "ValueError", "message": "bad input"}).state == "failed"
    assert store.get(inv).state == "failed"  # type: ignore[union-attr]
    plain = submit(store, max_attempts=3)  # no retry_on: a user exception is final
    store.claim("w", ["q"])
    assert _fail(store, plain, 1, {"type": "TimeoutError", "message": "x"}).state == "failed"


def test_retry_on_matches_a_base_class_the_worker_reported(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2, retry_on=["OSError"], backoff_s=0)
    store.claim("w", ["q"])
    got = _fail(store, inv, 1, {"type": "ConnectionRefusedError", "message": "refused", "mro": MRO})
    assert got.state == "queued" and got.requeued == "q"  # no backoff: claimable at once
    assert store.claim("w", ["q"])[0].attempt == 2
    bare = submit(store, max_attempts=2, retry_on=["OSError"], backoff_s=0)  # no mro: the type alone
    store.claim("w", ["q"])
    assert _fail(store, bare, 1, {"type": "ConnectionRefusedError", "message": "refused"}).state == "failed"


@pytest.mark.parametrize(
    ("state", "error"),
    [
        (
            "failed",
            {"type": "PickleRefused", "message": "no pickles here", "mro": ["PickleRefused", "Exception"]},
        ),
        (
            "failed",
            {
                "type": "ModuleNotFoundError",
                "message": "no module",
                "mro": ["ModuleNotFoundError", "Exception"],
            },
        ),
        ("failed", {"type": "InvalidRunConfig", "message": "bad image"}),
        ("killed", {"type": "Cancelled", "message": "cancelled by producer"}),
        ("timeout", {"type": "Timeout", "message": "run_config.timeout_s passed"}),
    ],
)
def test_outcomes_no_retry_can_change_never_retry(store: SqlStore, state: str, error: dict[str, Any]) -> None:
    inv = submit(store, max_attempts=3, retry_on=["Exception"], backoff_s=0)
    store.claim("w", ["q"])
    assert _fail(store, inv, 1, error, state).state == state
    assert store.get(inv).state == state  # type: ignore[union-attr]


def test_a_timeout_retries_only_when_asked(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2, retry_on=["Timeout"], backoff_s=0)
    store.claim("w", ["q"])
    assert (
        _fail(store, inv, 1, {"type": "Timeout", "message": "timeout_s passed"}, "timeout").state == "queued"
    )
    assert store.claim("w", ["q"])[0].attempt == 2


def test_a_crashed_process_is_retried_by_default_with_the_default_backoff(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2)
    store.claim("w", ["q"])
    crash = {"type": "ProcessExited", "message": "the entry exited with code 17 and left no error.json"}
    assert _fail(store, inv, 1, crash).state == "queued"
    row = store.get(inv)
    assert row is not None and row.not_before is not None and row.not_before > time.time() + 0.5  # 1 s
    store.expire_leases(now=row.not_before + 0.01)
    assert store.claim("w", ["q"])[0].attempt == 2
    assert _fail(store, inv, 2, crash).state == "failed"


def test_a_repeated_ack_of_a_retried_attempt_is_a_duplicate(store: SqlStore) -> None:
    inv = submit(store, max_attempts=3, retry_on=["TimeoutError"], backoff_s=0)
    store.claim("w", ["q"])
    assert _fail(store, inv, 1, TIMEOUT_ERR).state == "queued"
    again = _fail(store, inv, 1, TIMEOUT_ERR)  # nymph's outbox re-sends when the answer was lost
    assert again.ok and again.duplicate
    store.claim("w2", ["q"])  # attempt 2 runs elsewhere: the repeat is still a duplicate
    assert _fail(store, inv, 1, TIMEOUT_ERR).duplicate
    other = ack(store, inv, "succeeded", attempt=1, worker_id="w")  # not what attempt 1 reported
    assert not other.ok


def test_the_group_commit_retries_as_a_single_ack_does(store: SqlStore) -> None:
    retried = submit(store, max_attempts=2, retry_on=["TimeoutError"], backoff_s=0)
    done = submit(store)
    store.claim("w", ["q"], limit=2)
    results = store.write_batch(
        [
            AckRequest(retried, "failed", 1, "w", None, TIMEOUT_ERR),
            AckRequest(done, "succeeded", 1, "w", b"\xc0", None),
        ]
    )
    assert [(r.ok, r.state) for r in results if isinstance(r, AckResult)] == [
        (True, "queued"),
        (True, "succeeded"),
    ]
    assert store.get(retried).state == "queued" and store.get(done).state == "succeeded"  # type: ignore[union-attr]
    assert store.claim("w", ["q"])[0].invocation_id == retried


def test_a_lapsed_lease_is_kept_in_the_history(store: SqlStore) -> None:
    inv = submit(store, max_attempts=2)
    store.claim("w", ["q"])
    assert store.expire_leases(now=10**10) == [inv]
    assert store.claim("w2", ["q"])[0].attempt == 2
    ack(store, inv, "succeeded", attempt=2, worker_id="w2", result_blob=b"\xc0")
    history = store.attempts(inv)
    assert [(a["attempt"], a["state"], a["worker_id"]) for a in history] == [
        (1, "lost", "w"),
        (2, "succeeded", "w2"),
    ]
    assert history[0]["error"]["type"] == "LeaseExpired"


def test_a_retry_waiting_for_its_backoff_is_cancelled_at_once(store: SqlStore) -> None:
    inv = submit(store, max_attempts=3, retry_on=["TimeoutError"], backoff_s=600)
    store.claim("w", ["q"])
    _fail(store, inv, 1, TIMEOUT_ERR)
    assert store.cancel(inv) == "cancelled"
    store.expire_leases(now=time.time() + 601)
    assert store.claim("w", ["q"]) == []
    assert store.get(inv).state == "cancelled"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("run_config", "match"),
    [
        ({"retry_on": "TimeoutError"}, "list of at most 32 exception type names"),
        ({"retry_on": [1]}, "list of at most 32 exception type names"),
        ({"backoff_s": -1}, "backoff_s must be a number of seconds from 0 to 3600"),
        ({"backoff_s": 10_000}, "backoff_s must be a number of seconds from 0 to 3600"),
    ],
)
def test_a_malformed_retry_policy_is_refused_at_submit(run_config: dict[str, Any], match: str) -> None:
    from dreamlake.lakeshore.errors import PlaneError
    from dreamlake.lakeshore.store.values import check_run_config

    with pytest.raises(PlaneError, match=match) as refused:
        check_run_config(run_config)
    assert refused.value.status == 400


def test_a_crash_on_a_full_disk_is_final_unless_retry_on_names_it(store: SqlStore) -> None:
    full = {"type": "ProcessExited", "message": "... No space left on device ...", "disk_full": True}
    inv = submit(store, max_attempts=3)
    store.claim("w", ["q"])
    assert _fail(store, inv, 1, full).state == "failed"  # the caller hears of the full disk at once
    asked = submit(store, max_attempts=3, retry_on=["ProcessExited"], backoff_s=0)
    store.claim("w", ["q"])
    assert _fail(store, asked, 1, full).state == "queued"
