"""``POST /v1/producer/submit-batch`` over real HTTP, SQLite and PostgreSQL: each item answers as
the single submit would (its id, a duplicate, or the same error text), in order; a retried batch
stores nothing twice; the stored rows are those single submits would store; every new invocation
wakes one waiting poll."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body

BATCH = "/v1/producer/submit-batch"
SUBMIT = "/v1/producer/submit"


@pytest.fixture(params=["sqlite", "postgresql"])
def cp(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ControlPlane]:
    """A control plane over HTTP on each store (PostgreSQL: the session's database, emptied)."""
    url = (
        str(tmp_path / "batch.db") if request.param == "sqlite" else request.getfixturevalue("pg_session_url")
    )
    with running_control_plane(url, config=ServerConfig(recheck_s=0.5)) as plane:
        yield plane


def _serve(cp: ControlPlane, queue: str) -> None:
    status, _ = cp.daemon("/v1/daemon/register", {"worker_id": new_ulid(), "queues": [queue]})
    assert status == 200


def _batch(cp: ControlPlane, items: list[Any], **extra: Any) -> list[dict[str, Any]]:
    status, out = cp.producer(BATCH, {"submits": items, **extra})
    assert status == 200, out
    assert len(out["results"]) == len(items)
    return list(out["results"])


def test_each_item_answers_as_its_single_submit_would(cp: ControlPlane) -> None:
    _serve(cp, "sweep")
    kept = new_ulid()
    cp.submit("sweep")  # something in the store already
    status, _ = cp.producer(SUBMIT, submit_body(kept, "sweep", args_blob=b"\x91\x01"))
    assert status == 200
    fresh = [new_ulid() for _ in range(3)]
    bad = [
        submit_body(new_ulid(), "no spaces allowed"),  # a bad queue name
        {**submit_body(new_ulid(), "sweep"), "invocation_id": "not-a-ulid"},
        submit_body(new_ulid(), "sweep", run_config={"priority": "high"}),
        submit_body(kept, "sweep", args_blob=b"\x91\x02"),  # the same id with other content: 409
        {**submit_body(new_ulid(), "sweep"), "args_blob": "text, not bytes"},
    ]
    items = [
        submit_body(fresh[0], "sweep"),
        bad[0],
        submit_body(fresh[1], "sweep"),
        bad[1],
        bad[2],
        submit_body(kept, "sweep", args_blob=b"\x91\x01"),  # a repeat of the stored submit
        bad[3],
        bad[4],
        submit_body(fresh[2], "sweep"),
    ]
    got = _batch(cp, items)
    assert got[0] == {"invocation_id": fresh[0], "queue": "sweep"}
    assert got[2] == {"invocation_id": fresh[1], "queue": "sweep"}
    assert got[8] == {"invocation_id": fresh[2], "queue": "sweep"}
    assert got[5] == {"invocation_id": kept, "queue": "sweep", "duplicate": True}
    for index, body in zip((1, 3, 4, 6, 7), bad, strict=True):
        status, single = cp.producer(SUBMIT, body)  # what the single submit answers
        assert status >= 400
        assert got[index]["status"] == status, (index, got[index], single)
        assert got[index]["error"] == single["error"], index
    assert got[6]["status"] == 409 and got[6]["invocation_id"] == kept
    for inv in fresh:
        row = cp.store.get(inv)
        assert row is not None and row.state == "queued" and row.queue == "sweep"
    assert cp.store.get(kept).args_blob == b"\x91\x01"  # type: ignore[union-attr]


def test_a_batch_stores_what_single_submits_store(cp: ControlPlane) -> None:
    one, many = new_ulid(), new_ulid()
    rc = {"priority": 3, "max_attempts": 5, "timeout_s": 7.5}
    assert cp.producer(SUBMIT, submit_body(one, "same", run_config=rc, args_blob=b"\x92\x01\x02"))[0] == 200
    _batch(cp, [submit_body(many, "same", run_config=rc, args_blob=b"\x92\x01\x02")])
    a, b = cp.store.get(one), cp.store.get(many)
    assert a is not None and b is not None
    skip = {"invocation_id", "submitted_at", "root_invocation_id"}
    assert {k: v for k, v in vars(a).items() if k not in skip} == {
        k: v for k, v in vars(b).items() if k not in skip
    }


def test_common_fields_apply_unless_an_item_sets_its_own(cp: ControlPlane) -> None:
    common = submit_body(new_ulid(), "shared", run_config={"priority": 2})
    common.pop("invocation_id")
    common.pop("args_blob")
    a, b = new_ulid(), new_ulid()
    got = _batch(
        cp,
        [
            {"invocation_id": a, "args_blob": b"\x91\x01"},
            {"invocation_id": b, "args_blob": b"\x91\x02", "queue": "own", "run_config": {"queue": "own"}},
        ],
        common=common,
    )
    assert got == [{"invocation_id": a, "queue": "shared"}, {"invocation_id": b, "queue": "own"}]
    ra, rb = cp.store.get(a), cp.store.get(b)
    assert ra is not None and rb is not None
    assert (ra.queue, ra.priority, ra.args_blob) == ("shared", 2, b"\x91\x01")
    assert (rb.queue, rb.priority) == ("own", 0)


def test_a_retried_batch_stores_nothing_twice(cp: ControlPlane) -> None:
    items = [submit_body(new_ulid(), "retry", args_blob=bytes([0x91, i])) for i in range(50)]
    first = _batch(cp, items)
    again = _batch(cp, items)  # the answer was lost: the SDK sends the same batch again
    assert [g["invocation_id"] for g in first] == [i["invocation_id"] for i in items]
    assert all("duplicate" not in g for g in first)
    assert again == [{**g, "duplicate": True} for g in first]
    # the same id twice in one batch: the second is a repeat of the first
    twice = submit_body(new_ulid(), "retry")
    got = _batch(cp, [twice, twice])
    assert got[0] == {"invocation_id": twice["invocation_id"], "queue": "retry"}
    assert got[1] == {**got[0], "duplicate": True}
    page = cp.store.list_invocations(queue="retry", limit=1000).invocations
    assert len(page) == 51


def test_refusals_of_the_whole_request(tmp_path: Any) -> None:
    config = ServerConfig(submit_batch_max=10)
    with running_control_plane(str(tmp_path / "cap.db"), config=config) as cp:
        status, out = cp.producer(BATCH, {"submits": [submit_body(new_ulid()) for _ in range(11)]})
        assert status == 413
        assert "over the limit of 10" in out["error"] and "chunks of at most 10" in out["error"]
        assert out["submit_batch_max"] == 10
        assert cp.store.list_invocations(limit=100).invocations == []  # nothing of it was stored
        status, out = cp.producer(BATCH, {"submits": []})
        assert status == 400 and "empty" in out["error"]
        status, out = cp.producer(BATCH, {"submit": [submit_body(new_ulid())]})
        assert (status, out["error"]) == (400, "missing field 'submits'")
        status, out = cp.producer(BATCH, {"submits": [submit_body(new_ulid(), wait_s=1.0), 7]})
        assert status == 200
        assert out["results"][0]["status"] == 400 and "wait_s" in out["results"][0]["error"]
        assert out["results"][1] == {
            "error": "submits[1] must be a map (a submit body), got int",
            "status": 400,
        }


def test_every_new_invocation_of_a_batch_wakes_one_waiting_poll(cp: ControlPlane) -> None:
    """Ten polls wait on one queue; a batch of ten new invocations (and two repeats) wakes each of
    them once, at once: each claims one, none is left waiting for its safety re-check."""
    polls, started = 10, threading.Barrier(11)

    def poll() -> list[str]:
        started.wait(10)
        body = {"worker_id": new_ulid(), "queues": ["wake"], "max": 1, "timeout_s": 20, "kinds": ["run"]}
        status, out = cp.daemon("/v1/daemon/poll", body, timeout=40)
        assert status == 200, out
        return [c["body"]["invocation_id"] for c in out["commands"] if c["kind"] == "run"]

    with ThreadPoolExecutor(polls) as pool:
        waiting = [pool.submit(poll) for _ in range(polls)]
        started.wait(10)
        deadline = time.monotonic() + 10
        while cp.app.state.ctx.polls.waiting < polls and time.monotonic() < deadline:
            time.sleep(0.02)
        items = [submit_body(new_ulid(), "wake") for _ in range(polls)]
        _batch(cp, [*items, items[0], items[1]])
        claimed = [inv for fut in waiting for inv in fut.result(timeout=10)]  # well before 20 s
    assert sorted(claimed) == sorted(i["invocation_id"] for i in items)
