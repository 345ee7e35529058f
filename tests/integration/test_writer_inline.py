"""The group commit written on the event loop (``GroupWriter(inline_lock=...)``): over SQLite a
batch is written on the loop when the store's write lock is free, and handed to the writer's
thread when another thread holds it, so the loop never waits on a lock; PostgreSQL never writes on
the loop. (A ``--workers`` process turns it off: tests/unit/test_worker_processes.py.)"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.writer import GroupWriter
from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.api import AckRequest, PollRequest, SubmitRequest, SubmitResult
from dreamlake.lakeshore.store.outage import WriteLockBusy
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

    def recording(requests: Sequence[Any], on_commit: Any = None, **kw: Any) -> Any:
        threads.append(threading.get_ident())
        return real(requests, on_commit, **kw)

    monkeypatch.setattr(store, "write_batch", recording)
    return threads


async def _write_while_held(
    store: SqlStore, lock: threading.RLock | None, release: Any
) -> tuple[int, int, bool, SubmitResult]:
    """A submit through a ``GroupWriter`` while something holds a lock it needs: the loop's
    thread, how many of 20 ticks of 10 ms the loop ran meanwhile, whether the write was still
    unanswered after them (then ``release()``), and its result."""
    writer = GroupWriter(store, inline_lock=lock)
    try:
        write = asyncio.ensure_future(writer.write(_submit()))
        ticks = 0
        for _ in range(20):  # the loop runs on while the write waits for the lock
            await asyncio.sleep(0.01)
            ticks += 1
        waiting = not write.done()
        release()
        result = await asyncio.wait_for(write, 10)
    finally:
        await writer.aclose()
    return threading.get_ident(), ticks, waiting, result  # type: ignore[return-value]


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


def _record_sizes(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of writes in each ``write_batch`` of ``store``, in order."""
    sizes: list[int] = []
    real = store.write_batch

    def recording(requests: Sequence[Any], on_commit: Any = None, **kw: Any) -> Any:
        sizes.append(len(requests))
        return real(requests, on_commit, **kw)

    monkeypatch.setattr(store, "write_batch", recording)
    return sizes


def test_writes_a_turn_apart_share_a_commit_only_while_writes_come_together(
    sqlite_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the loop, a lone caller's write is committed at once; once a batch held several callers'
    writes, the next batch waits a few loop turns and takes the writes on their way (what fills the
    transactions of concurrent submits), until a batch of one caller turns that off again."""
    sizes = _record_sizes(sqlite_store, monkeypatch)

    async def staggered(writer: GroupWriter) -> None:  # a second caller one loop turn after the first
        first = asyncio.ensure_future(writer.write(_submit()))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(writer.write(_submit()))
        await asyncio.gather(first, second)

    async def main() -> list[list[int]]:
        writer = GroupWriter(sqlite_store, inline_lock=sqlite_store.inline_write_lock())
        steps = []
        try:
            await staggered(writer)  # lone writes so far: each committed as it comes
            steps.append(list(sizes))
            sizes.clear()
            await asyncio.gather(writer.write(_submit()), writer.write(_submit()))  # together
            await staggered(writer)
            steps.append(list(sizes))
            sizes.clear()
            await writer.write(_submit())  # alone again (it still waited its turns: one batch)
            await staggered(writer)
            steps.append(list(sizes))
        finally:
            await writer.aclose()
        return steps

    lone, together, alone_again = asyncio.run(main())
    assert lone == [1, 1]
    assert together == [2, 2]  # the second pair, a turn apart, in one commit
    assert alone_again == [1, 1, 1]


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

    try:
        loop_thread, ticks, waiting, result = asyncio.run(_write_while_held(sqlite_store, lock, release.set))
    finally:
        release.set()
        holder.join(10)
    assert ticks == 20 and waiting  # the loop was never blocked, and nothing answered early
    assert len(threads) == 1 and threads[0] != loop_thread
    row = sqlite_store.get(result.invocation_id)
    assert row is not None and row.state == "queued"


class _OtherProcess:
    """A connection of its own to the store's file holding SQLite's write lock (``BEGIN
    IMMEDIATE``), as another process does (``lakeshore gc``, an admin command writing a token),
    until ``release``: SQLite's lock is the file's, so the store's connections wait on it."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def hold(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.db.in_transaction:
            self.db.execute("COMMIT")

    def close(self) -> None:
        self.release()
        self.db.close()


def test_a_file_lock_held_by_another_process_never_stalls_the_loop(
    sqlite_store: SqlStore, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's in-process lock is free, so the batch starts on the loop; SQLite's file lock is
    another process's: the loop must not wait for it there (it did, for as long as the other
    held it: ``busy_timeout``), but hand the batch to the writer's thread, which waits for it."""
    threads = _record_threads(sqlite_store, monkeypatch)
    other = _OtherProcess(str(tmp_path / "lakeshore.db"))
    other.hold()

    try:
        loop_thread, ticks, waiting, result = asyncio.run(
            _write_while_held(sqlite_store, sqlite_store.inline_write_lock(), other.release)
        )
    finally:
        other.close()
    assert ticks == 20 and waiting  # never blocked, and nothing answered before it was written
    assert threads[0] == loop_thread and threads[1:] and loop_thread not in threads[1:]
    row = sqlite_store.get(result.invocation_id)
    assert row is not None and row.state == "queued"


def test_a_file_lock_taken_between_a_batchs_transactions_writes_the_rest_once(
    sqlite_store: SqlStore, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is up to three transactions; should another process take the file lock after the
    first committed on the loop, only the writes not applied go to the writer's thread: the
    submit is not written twice, the ack is applied once, and each caller gets its own answer."""
    queued = sqlite_store.submit(_submit()).invocation_id
    (claim,) = sqlite_store.write_batch([PollRequest("w", ["q"])])[0].invocations  # type: ignore[union-attr]
    other = _OtherProcess(str(tmp_path / "lakeshore.db"))
    real_group = sqlite_store._apply_group
    groups: list[int] = []

    def taken_after_the_first(requests: Any, live: Any, out: Any, **kw: Any) -> None:
        groups.append(len(live))
        if len(groups) == 2:  # the submits committed: the other process takes the lock now
            other.hold()
            threading.Timer(0.3, other.release).start()
        real_group(requests, live, out, **kw)

    monkeypatch.setattr(sqlite_store, "_apply_group", taken_after_the_first)
    submit = _submit()

    async def main() -> list[Any]:
        writer = GroupWriter(sqlite_store, inline_lock=sqlite_store.inline_write_lock())
        try:
            return list(
                await writer.write_many(
                    [submit, AckRequest(claim.invocation_id, "succeeded", claim.attempt, "w", b"r")]
                )
            )
        finally:
            await writer.aclose()

    try:
        submitted, acked = asyncio.run(main())
    finally:
        other.close()
    assert groups == [1, 1, 1]  # the submit's, the ack's on the loop (busy), the ack's in the thread
    assert isinstance(submitted, SubmitResult) and not submitted.duplicate
    assert acked.ok and not acked.duplicate
    row = sqlite_store.get(claim.invocation_id)
    assert row is not None and row.state == "succeeded" and row.result_blob == b"r"
    assert queued == claim.invocation_id
    assert sqlite_store.get(submit.invocation_id).state == "queued"  # type: ignore[union-attr]


@pytest.mark.parametrize("applied_alone", [0, 1], ids=["before-the-first-alone", "after-the-first-alone"])
def test_writes_retried_alone_on_the_loop_never_wait_for_the_file_lock(
    sqlite_store: SqlStore, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, applied_alone: int
) -> None:
    """A group's transaction fails (a value a column refuses), so its writes are retried one by
    one; should another process hold the file lock by then, ``wait=False`` still does not wait:
    it names exactly the writes not applied, once each."""
    other = _OtherProcess(str(tmp_path / "lakeshore.db"))
    real = sqlite_store._apply_writes
    calls: list[int] = []

    def apply(batch: Any) -> Any:
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("a value a column refuses")
        if len(calls) == 2 + applied_alone:  # the other process takes the lock now
            other.hold()
        return real(batch)

    monkeypatch.setattr(sqlite_store, "_apply_writes", apply)
    submits = [_submit(), _submit(), _submit()]
    try:
        with pytest.raises(WriteLockBusy) as busy:
            sqlite_store.write_batch(submits, wait=False)
    finally:
        other.close()
    assert busy.value.pending == list(range(applied_alone, 3))
    written = [s.invocation_id for s in submits if sqlite_store.get(s.invocation_id) is not None]
    assert written == [s.invocation_id for s in submits[:applied_alone]]


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

    def failing_once(requests: Sequence[Any], on_commit: Any = None, **kw: Any) -> Any:
        if len(requests) > 1 and not failed:
            failed.append(len(requests))
            raise RuntimeError("a bug a value met, outside any one write")
        return real(requests, on_commit, **kw)

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
