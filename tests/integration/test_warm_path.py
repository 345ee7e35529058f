"""The warm path for short calls, on both stores: acks carried by the worker's next poll, submit
with ``wait_s`` (submit and await in one request), an ack in flight answering a waiting await
from memory at its commit, and the SDK's ``.call()`` against ``run_worker`` with ``prefetch``."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch
from dreamlake.lakeshore.errors import DispatchError
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.api import AckRequest
from tests.integration.conftest import ControlPlane, submit_body
from tests.integration.daemon_kit import poll

POLL = "/v1/daemon/poll"


@dls.udf(queue="warm")
def triple(x: int) -> int:
    return 3 * x


@dls.udf(queue="warm")
def broken(x: int) -> int:
    raise ValueError(f"no {x}")


def _ack(inv: str, attempt: int = 1, state: str = "succeeded", blob: bytes = b"\xc0") -> dict[str, Any]:
    return {"invocation_id": inv, "state": state, "attempt": attempt, "result_blob": blob}


def _claim(cp: ControlPlane, worker: str, n: int) -> list[str]:
    out = poll(cp, worker, limit=n, timeout_s=0)
    return [c["body"]["invocation_id"] for c in out["commands"]]


def _submit_and_wait_to_a_waiting_poll(
    cp: ControlPlane, pool: ThreadPoolExecutor, worker: str, inv: str, queue: str
) -> Future[tuple[int, Any]]:
    """A submit with ``wait_s`` of ``inv`` to ``queue``, made once a poll of ``worker`` waits
    there, and that poll's answer: the claim of ``inv`` (asserted). The producer's answer, to come."""
    polled = pool.submit(cp.daemon, POLL, {"worker_id": worker, "queues": [queue], "max": 1, "timeout_s": 20})
    while cp.app.state.ctx.polls.waiting < 1:
        threading.Event().wait(0.01)
    waiting = pool.submit(cp.producer, "/v1/producer/submit", {**submit_body(inv, queue), "wait_s": 20})
    status, out = polled.result(30)
    assert status == 200 and [c["body"]["invocation_id"] for c in out["commands"]] == [inv]
    return waiting


def test_a_poll_carries_acks_each_committed_and_answered_then_claims(control_plane: ControlPlane) -> None:
    cp = control_plane
    worker = new_ulid()
    a, b, c = (cp.submit() for _ in range(3))
    assert sorted(_claim(cp, worker, 3)) == sorted([a, b, c])
    fresh = cp.submit()
    acks = [
        _ack(a, blob=wire.pack(1)),
        _ack(b, state="failed", blob=b""),
        _ack(c, attempt=2),  # not the current attempt: superseded
        {**_ack(c), "state": "bogus"},
        _ack(new_ulid()),  # unknown
    ]
    body = {"worker_id": worker, "queues": ["default"], "max": 1, "timeout_s": 0, "acks": acks}
    status, out = cp.daemon(POLL, body)
    assert status == 200
    assert [(x["invocation_id"], x["status"], x["ok"]) for x in out["acked"]] == [
        (a, 200, True),
        (b, 200, True),
        (c, 409, False),
        (c, 400, False),
        (acks[4]["invocation_id"], 404, False),
    ]
    assert "cannot ack state" in out["acked"][3]["error"]
    assert [cmd["body"]["invocation_id"] for cmd in out["commands"]] == [fresh]
    states = {i: getattr(cp.store.get(i), "state", None) for i in (a, b, c)}
    assert states == {a: "succeeded", b: "failed", c: "running"}
    # the same acks again (a poll retried after a lost answer) are duplicates, not errors
    status, out = cp.daemon(POLL, {**body, "acks": acks[:2]})
    assert [x.get("duplicate") for x in out["acked"]] == [True, True]


def test_a_polls_acks_commit_in_one_transaction_with_its_opening_pass(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm path's one transaction per call on the worker's side: the acks a poll carries and
    the pass that claims its next work are one group commit, the acks first."""
    cp = control_plane
    store = cp.app.state.ctx.store
    real = store.write_batch
    batches: list[list[str]] = []

    def recording(requests: Any, *args: Any, **kwargs: Any) -> Any:
        batches.append([type(r).__name__ for r in requests])
        return real(requests, *args, **kwargs)

    worker = new_ulid()
    a, b = cp.submit(), cp.submit()
    assert sorted(_claim(cp, worker, 2)) == sorted([a, b])
    fresh = cp.submit()
    monkeypatch.setattr(store, "write_batch", recording)
    acks = [_ack(a, blob=wire.pack(1)), _ack(b, blob=wire.pack(2))]
    body = {"worker_id": worker, "queues": ["default"], "max": 2, "timeout_s": 0, "acks": acks}
    status, out = cp.daemon(POLL, body)
    assert status == 200
    assert [(x["invocation_id"], x["ok"]) for x in out["acked"]] == [(a, True), (b, True)]
    assert [cmd["body"]["invocation_id"] for cmd in out["commands"]] == [fresh]
    assert batches == [["AckRequest", "AckRequest", "PollRequest"]]
    assert {cp.store.get(i).state for i in (a, b)} == {"succeeded"}  # type: ignore[union-attr]


def test_an_ack_the_store_failed_is_answered_500_and_the_worker_sends_it_again(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ack of a poll that the store fails (5xx) costs neither the poll's claims nor the ack:
    it is answered with its status, and ``HttpDispatch.claim_batch`` sends it with the next poll."""
    cp = control_plane
    store = cp.app.state.ctx.store
    worker = new_ulid()
    plane = HttpDispatch(cp.url, token=cp.daemon_token)
    try:
        inv = cp.submit()
        (claim,) = plane.claim_batch(worker, ["default"], 5, 1)
        assert claim.invocation_id == inv
        plane.ack(inv, "succeeded", attempt=1, worker_id=worker, result_blob=wire.pack(5), later=True)
        nxt = cp.submit()
        real = store._apply_writes

        def failing(batch: Any) -> Any:  # any write but a poll pass fails, alone or with others
            if any(type(p).__name__ != "PollRequest" for _, p in batch):
                raise RuntimeError("the disk hiccuped")
            return real(batch)

        monkeypatch.setattr(store, "_apply_writes", failing)
        # a pass that hands nothing out (of a queue with nothing in it): the poll fails as a whole
        # (500, as an older SDK expects: it sends every ack again), and nothing is lost
        body = {"worker_id": worker, "queues": ["nothing-queued"], "max": 1, "timeout_s": 0}
        status, _ = cp.daemon(POLL, {**body, "acks": [_ack(inv, blob=wire.pack(5))]})
        assert status == 500
        assert cp.store.get(inv).state == "running"  # type: ignore[union-attr]
        (claim2,) = plane.claim_batch(worker, ["default"], 5, 1)
        assert claim2.invocation_id == nxt  # the pass committed, the ack did not
        assert cp.store.get(inv).state == "running"  # type: ignore[union-attr]
        monkeypatch.setattr(store, "_apply_writes", real)
        plane.ack(nxt, "succeeded", attempt=1, worker_id=worker, result_blob=wire.pack(6), later=True)
        assert plane.claim_batch(worker, ["default"], 0.2, 1) == []
        assert {cp.store.get(i).state for i in (inv, nxt)} == {"succeeded"}  # type: ignore[union-attr]
    finally:
        plane.close()


def test_acks_on_another_workers_poll_are_refused(control_plane: ControlPlane) -> None:
    cp = control_plane
    holder, other = new_ulid(), new_ulid()
    inv = cp.submit()
    assert _claim(cp, holder, 1) == [inv]
    poll(cp, other, timeout_s=0)  # registered, holds nothing
    body = {"worker_id": other, "queues": ["default"], "max": 1, "timeout_s": 0, "acks": [_ack(inv)]}
    status, out = cp.daemon(POLL, body)
    assert status == 200 and out["acked"][0]["status"] == 403
    got = cp.store.get(inv)
    assert got is not None and (got.state, got.worker_id) == ("running", holder)
    status, out = cp.daemon(POLL, {**body, "acks": "nope"})
    assert status == 400


def test_submit_with_wait_s_answers_the_outcome_in_one_request(control_plane: ControlPlane) -> None:
    cp = control_plane
    worker = new_ulid()
    inv = new_ulid()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(cp.producer, "/v1/producer/submit", {**submit_body(inv), "wait_s": 30})
        claimed: list[str] = []
        while not claimed:  # the submit is queued by the time its wait starts
            claimed = _claim(cp, worker, 1)
        assert claimed == [inv]
        status, out = cp.daemon(
            POLL,
            {"worker_id": worker, "queues": ["x"], "timeout_s": 0, "acks": [_ack(inv, blob=wire.pack(7))]},
        )
        assert status == 200 and out["acked"][0]["ok"] is True
        status, answer = waiting.result(30)
    assert status == 200 and answer["invocation_id"] == inv
    assert answer["outcome"]["state"] == "succeeded" and wire.unpack(answer["outcome"]["result_blob"]) == 7
    status, answer = cp.producer("/v1/producer/submit", {**submit_body(new_ulid()), "wait_s": 0.2})
    assert status == 200 and answer["outcome"]["state"] == "pending"
    status, answer = cp.producer("/v1/producer/submit", {**submit_body(new_ulid()), "wait_s": "soon"})
    assert status == 400 and "wait_s" in answer["error"]


def test_an_await_woken_by_an_ack_takes_the_committed_outcome_from_memory(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No store read of the waiting await sees the terminal row: the outcome came with the ack's
    commit. The answer is the committed one (an empty blob as None, as the store keeps it)."""
    cp = control_plane
    ctx = cp.app.state.ctx
    real_get = ctx.store.get
    terminal_reads: list[str] = []

    def counting_get(invocation_id: str) -> Any:
        got = real_get(invocation_id)
        if got is not None and got.state in ("succeeded", "failed"):
            terminal_reads.append(invocation_id)
        return got

    monkeypatch.setattr(ctx.store, "get", counting_get)
    worker = new_ulid()
    inv = cp.submit()
    assert _claim(cp, worker, 1) == [inv]
    started = threading.Event()

    def wait() -> tuple[int, Any]:
        started.set()
        return cp.producer("/v1/producer/await", {"invocation_id": inv, "timeout_s": 30})

    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(wait)
        started.wait(10)
        error = {"type": "ValueError", "message": "no"}
        while True:  # ack once the await waits (its first read saw the row running)
            if ctx.wake.notifier._async.get(f"inv:{inv}"):
                break
            threading.Event().wait(0.01)
        status, _ = cp.daemon(
            "/v1/daemon/ack", {**_ack(inv, state="failed", blob=b""), "worker_id": worker, "error": error}
        )
        assert status == 200
        status, answer = waiting.result(30)
    assert status == 200
    assert answer == {"state": "failed", "result_blob": None, "error": error}
    assert terminal_reads == []


def test_a_submit_and_wait_claimed_at_once_takes_its_outcome_from_the_ack(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm path's producer side: a submit with ``wait_s``, handed to a waiting poll in its
    own commit and acked, is answered with the ack's committed outcome and reads no row of the
    store meanwhile; a repeat of it (a duplicate) reads the store as ``await`` does."""
    cp = control_plane
    ctx = cp.app.state.ctx
    real_get = ctx.store.get
    reads: list[str] = []

    def counting_get(invocation_id: str) -> Any:
        reads.append(invocation_id)
        return real_get(invocation_id)

    monkeypatch.setattr(ctx.store, "get", counting_get)
    worker, inv, queue = new_ulid(), new_ulid(), f"q{new_ulid()}"
    with ThreadPoolExecutor(2) as pool:
        waiting = _submit_and_wait_to_a_waiting_poll(cp, pool, worker, inv, queue)
        status, _ = cp.daemon("/v1/daemon/ack", {**_ack(inv, blob=wire.pack(9)), "worker_id": worker})
        assert status == 200
        status, answer = waiting.result(30)
    assert status == 200 and answer["outcome"]["state"] == "succeeded"
    assert wire.unpack(answer["outcome"]["result_blob"]) == 9
    assert inv not in reads
    status, again = cp.producer("/v1/producer/submit", {**submit_body(inv, queue), "wait_s": 5})
    assert status == 200 and again["duplicate"] is True
    assert again["outcome"]["state"] == "succeeded" and wire.unpack(again["outcome"]["result_blob"]) == 9
    assert reads.count(inv) == 1


def test_a_submit_and_wait_is_answered_at_the_acks_commit_not_after_the_acking_poll_goes_on(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack's outcome is handed to the waiting producer as the group commit answers it
    (``write_many``'s ``settle``): a poll route that is slow to go on after its acks committed
    (held here for seconds) does not hold back the producer's answer."""
    cp = control_plane
    ctx = cp.app.state.ctx
    real_write_many = ctx.write_many

    async def slow_after_acks(requests: list[Any], settle: Any = None) -> Any:
        results = await real_write_many(requests, settle)
        if any(isinstance(r, AckRequest) for r in requests):
            await asyncio.sleep(3)  # the acking route, slow to go on
        return results

    monkeypatch.setattr(ctx, "write_many", slow_after_acks)
    worker, inv, queue = new_ulid(), new_ulid(), f"q{new_ulid()}"
    with ThreadPoolExecutor(2) as pool:
        waiting = _submit_and_wait_to_a_waiting_poll(cp, pool, worker, inv, queue)
        body = {"worker_id": worker, "queues": [queue], "max": 1, "timeout_s": 0}
        acking = pool.submit(cp.daemon, POLL, {**body, "acks": [_ack(inv, blob=wire.pack(4))]})
        status, answer = waiting.result(30)
        assert not acking.done()  # answered while the acking poll is still held
        assert status == 200 and wire.unpack(answer["outcome"]["result_blob"]) == 4
        status, out = acking.result(30)
    assert status == 200 and [a["ok"] for a in out["acked"]] == [True]


def test_udf_call_runs_on_a_warm_worker_over_http(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    stop = threading.Event()
    worker_plane = HttpDispatch(cp.url, cp.daemon_token)
    producer = HttpDispatch(cp.url, cp.producer_token)
    worker = threading.Thread(
        target=dls.run_worker,
        args=("warm",),
        kwargs={
            "dispatch": worker_plane,
            "allow_pickled": False,
            "poll_timeout": 0.5,
            "stop": stop,
            "prefetch": 4,
        },
        daemon=True,
    )
    worker.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda i: triple.call(i, _dispatch=producer, _timeout=30), range(24)))
        assert got == [3 * i for i in range(24)]
        with pytest.raises(DispatchError, match="no 5"):
            broken.call(5, _dispatch=producer, _timeout=30)
    finally:
        stop.set()
        worker.join(30)
        worker_plane.close()
        producer.close()
    assert not worker.is_alive()
    running = cp.store.list_invocations(states=["running", "queued"], limit=100).invocations
    assert running == []  # every ack was sent, the last ones when the worker stopped


def test_udf_call_on_the_local_plane_submits_then_waits() -> None:
    plane = Dispatch(":memory:")
    inv_result: list[Any] = []
    t = threading.Thread(target=lambda: inv_result.append(triple.call(4, _dispatch=plane, _timeout=30)))
    t.start()
    assert dls.run_worker("warm", once=True, poll_timeout=10, dispatch=plane) == "succeeded"
    t.join(30)
    assert inv_result == [12]
    plane.close()
