"""The group commit written on the event loop (``GroupWriter(inline_lock=...)``): over SQLite a
batch is written on the loop when the store's write lock is free, and handed to the writer's
thread when another thread holds it, so the loop never waits on a lock; PostgreSQL never writes on
the loop. (A ``--workers`` process turns it off: tests/unit/test_worker_processes.py.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.writer import GroupWriter
from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.api import PollRequest, SubmitRequest, SubmitResult
from dreamlake.lakeshore.store.sql import SqlStore


@pytest.fixture
def sqlite_store(tmp_path: Any) -> Iterator[SqlStore]:
    s = open_store(str(tmp_path / "lakeshore.db"))
    try:
        yield s
    finally:
        s.close()


def _submit() -> SubmitRequest:
    return SubmitRequest(
        invocation_id=new_ulid(),
        queue="q",
        function={"module": "m", "qualname": "f", "version": "v1"},
        args_blob=b"\x90",
        run_config={"queue": "q"},
    )


def _record_threads(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread each ``write_batch`` of ``store`` ran on, in order."""
    threads: list[int] = []
    real = store.write_batch

    def recording(requests: Sequence[Any], on_commit: Any = None) -> Any:
        threads.append(threading.get_ident())
        return real(requests, on_commit)

    monkeypatch.setattr(store, "write_batch", recording)
    return threads


def test_only_sqlite_offers_the_loop_its_write_lock(store: SqlStore) -> None:
    lock = store.inline_write_lock()
    if store.kind == "postgresql":
        assert lock is None  # a commit there waits on the network and a flush: never on the loop
    else:
        assert lock is not None and lock is store.db.write_lock


def test_a_free_lock_writes_the_batch_on_the_loop_and_answers_once_committed(
    sqlite_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _record_threads(sqlite_store, monkeypatch)

    async def main() -> tuple[int, list[SubmitResult]]:
        writer = GroupWriter(sqlite_store, inline_lock=sqlite_store.inline_write_lock())
        try:
            results = await asyncio.gather(*(writer.write(_submit()) for _ in range(5)))
        finally:
            await writer.aclose()
        return threading.get_ident(), list(results)  # type: ignore[arg-type]

    loop_thread, results = asyncio.run(main())
    assert threads and set(threads) == {loop_thread}
    for result in results:  # answered: committed, and readable by anyone
        row = sqlite_store.get(result.invocation_id)
        assert row is not None and row.state == "queued"
    assert sqlite_store.inline_write_lock().acquire(blocking=False)  # released after each batch


def test_a_held_lock_sends_the_batch_to_the_writer_thread_and_the_loop_keeps_running(
    sqlite_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _record_threads(sqlite_store, monkeypatch)
    lock = sqlite_store.inline_write_lock()
    assert lock is not None
    held, release = threading.Event(), threading.Event()

    def sweep() -> None:  # another thread writing (a lease sweep, say) holds the lock a while
        with lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=sweep)
    holder.start()
    assert held.wait(5)

    async def main() -> tuple[int, int, bool, SubmitResult]:
        writer = GroupWriter(sqlite_store, inline_lock=lock)
        try:
            write = asyncio.ensure_future(writer.write(_submit()))
            ticks = 0
            for _ in range(20):  # the loop runs on while the write waits for the lock
                await asyncio.sleep(0.01)
                ticks += 1
            waiting = not write.done()
            release.set()
            result = await asyncio.wait_for(write, 10)
        finally:
            await writer.aclose()
        return threading.get_ident(), ticks, waiting, result

    try:
        loop_thread, ticks, waiting, result = asyncio.run(main())
    finally:
        release.set()
        holder.join(10)
    assert ticks == 20 and waiting  # the loop was never blocked, and nothing answered early
    assert len(threads) == 1 and threads[0] != loop_thread
    row = sqlite_store.get(result.invocation_id)
    assert row is not None and row.state == "queued"


@pytest.mark.parametrize("inline", [True, False], ids=["on-the-loop", "writer-thread"])
def test_a_handed_poll_pass_is_delivered_before_its_submits_caller_goes_on(
    sqlite_store: SqlStore, inline: bool
) -> None:
    """A submit that a waiting poll is handed (``handoff``) commits with that poll's pass, and the
    poll gets its claim before the submit's caller goes on: the daemon is what the call waits for
    next (a submit-and-wait only goes on to wait for the daemon's ack)."""
    order: list[str] = []
    claimed: list[Any] = []

    def handoff(submits: Sequence[SubmitRequest]) -> list[tuple[PollRequest, Any]]:
        def deliver(answer: Any) -> None:
            claimed.append(answer)
            order.append("poll answered")

        return [(PollRequest("w", ["q"], handed=(submits[0].invocation_id,)), deliver)]

    async def main() -> SubmitResult:
        lock = sqlite_store.inline_write_lock() if inline else None
        writer = GroupWriter(sqlite_store, inline_lock=lock, handoff=handoff)
        try:
            result = await writer.write(_submit())
            order.append("submit's caller goes on")
        finally:
            await writer.aclose()
        return result  # type: ignore[return-value]

    result = asyncio.run(main())
    assert order == ["poll answered", "submit's caller goes on"]
    (answer,) = claimed
    assert [i.invocation_id for i in answer.invocations] == [result.invocation_id]
    row = sqlite_store.get(result.invocation_id)
    assert row is not None and row.state == "running" and row.worker_id == "w"


def test_a_batch_written_again_caller_by_caller_writes_a_handed_pass_after_its_submit(
    sqlite_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the store fails a whole batch outside any one write, each caller's writes go again
    alone; a handed poll pass goes after the submit it was handed, so it still claims it."""
    real = sqlite_store.write_batch
    failed: list[int] = []

    def failing_once(requests: Sequence[Any], on_commit: Any = None) -> Any:
        if len(requests) > 1 and not failed:
            failed.append(len(requests))
            raise RuntimeError("a bug a value met, outside any one write")
        return real(requests, on_commit)

    monkeypatch.setattr(sqlite_store, "write_batch", failing_once)
    claimed: list[Any] = []

    def handoff(submits: Sequence[SubmitRequest]) -> list[tuple[PollRequest, Any]]:
        return [(PollRequest("w", ["q"], handed=(submits[0].invocation_id,)), claimed.append)]

    async def main() -> SubmitResult:
        writer = GroupWriter(sqlite_store, inline_lock=sqlite_store.inline_write_lock(), handoff=handoff)
        try:
            return await writer.write(_submit())  # type: ignore[return-value]
        finally:
            await writer.aclose()

    result = asyncio.run(main())
    assert failed == [2]
    (answer,) = claimed
    assert [i.invocation_id for i in answer.invocations] == [result.invocation_id]


@pytest.mark.parametrize("inline", [True, False], ids=["on-the-loop", "writer-thread"])
def test_settle_sees_the_committed_results_before_the_caller_goes_on(
    sqlite_store: SqlStore, inline: bool
) -> None:
    """``write_many(..., settle)``: called with the caller's results as the writer answers them,
    before the caller's continuation (an ack's outcome reaches a waiting producer at the commit,
    not after the acking route has gone on); a settle that raises costs neither the caller its
    answer nor the writer its next batch."""
    order: list[str] = []
    seen: list[list[Any]] = []

    def settle(results: list[Any]) -> None:
        rows = [sqlite_store.get(r.invocation_id) for r in results]  # committed: readable by anyone
        assert all(row is not None and row.state == "queued" for row in rows)
        seen.append(results)
        order.append("settled")

    def broken(results: list[Any]) -> None:
        raise RuntimeError("a settle's own bug")

    async def main() -> tuple[list[Any], Any]:
        lock = sqlite_store.inline_write_lock() if inline else None
        writer = GroupWriter(sqlite_store, inline_lock=lock)
        try:
            results = await writer.write_many([_submit(), _submit()], settle)
            order.append("caller goes on")
            after = await writer.write_many([_submit()], broken)
        finally:
            await writer.aclose()
        return results, after[0]

    results, after = asyncio.run(main())
    assert order == ["settled", "caller goes on"] and seen == [results]
    assert isinstance(after, SubmitResult) and sqlite_store.get(after.invocation_id) is not None
