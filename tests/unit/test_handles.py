"""Handles on the local plane: ``submit()`` returns an ``Invocation`` (a str that knows its plane),
``dls.wait`` / ``dls.as_completed`` / ``Calls.results()`` read outcomes in batches, progress
counts, and ``async def`` bodies with their awaitable SDK variants."""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import Dispatch, Plane
from dreamlake.lakeshore.errors import DispatchError, NotFound
from dreamlake.lakeshore.ids import new_ulid


class CountingPlane(Dispatch):
    """The local plane, counting the reads a consumer makes."""

    def __init__(self) -> None:
        super().__init__(":memory:", poll_s=0.05)
        self.batches: list[int] = []
        self.awaits = 0

    def await_batch(self, invocation_ids: Any, timeout: float) -> dict[str, Any]:
        self.batches.append(len(invocation_ids))
        return super().await_batch(invocation_ids, timeout)

    def await_result(self, invocation_id: str, timeout: float) -> dict[str, Any]:
        self.awaits += 1
        return super().await_result(invocation_id, timeout)


@pytest.fixture
def plane() -> Iterator[CountingPlane]:
    p = CountingPlane()
    try:
        yield p
    finally:
        p.close()


class Worker:
    def __init__(self, plane: Dispatch, queue: str = "h") -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=dls.run_worker,
            args=(queue,),
            kwargs={"dispatch": plane, "stop": self.stop, "poll_timeout": 0.1},
            daemon=True,
        )

    def __enter__(self) -> Worker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


@dls.udf(queue="h")
def square(x: int) -> int:
    if x == 3:
        raise ValueError("three is refused")
    return x * x


@dls.udf(queue="h")
def countdown(n: int) -> Iterator[int]:
    yield from range(n, 0, -1)


@dls.udf(queue="h")
async def async_square(x: int) -> int:
    await asyncio.sleep(0)
    return x * x


@dls.udf(queue="h")
async def async_count(n: int) -> Any:
    for i in range(n):
        await asyncio.sleep(0)
        yield i


def test_submit_returns_a_str_that_knows_its_plane(plane: CountingPlane) -> None:
    inv = square.submit(4, _dispatch=plane)
    assert isinstance(inv, dls.Invocation) and isinstance(inv, str) and inv.id == str(inv)
    assert inv.status()["state"] == "queued" and inv.status()["queue"] == "h"
    assert dls.SyncQueue("h", dispatch=plane).status(inv)["invocation_id"] == inv  # usable as an id
    # it travels as the plain id: pickled, packed, in a dict key
    assert type(pickle.loads(pickle.dumps(inv))) is str and pickle.loads(pickle.dumps(inv)) == inv
    assert wire.pack(inv) == wire.pack(str(inv))
    assert {str(inv): 1}[inv] == 1
    with Worker(plane):
        assert inv.result(10) == 16
    assert inv.done() and list(inv.logs()) == []


def test_result_stream_and_cancel_through_the_handle(plane: CountingPlane) -> None:
    queued = square.submit(5, _dispatch=plane)
    assert queued.cancel() == "cancelled"
    with pytest.raises(DispatchError):
        queued.result(5)
    with Worker(plane):
        gen = countdown.submit(3, _dispatch=plane)
        assert list(gen.stream(timeout=10)) == [3, 2, 1]
        with pytest.raises(DispatchError, match="three is refused"):
            square.submit(3, _dispatch=plane).result(10)


def test_wait_as_concurrent_futures_does(plane: CountingPlane) -> None:
    never = square.submit(1, _dispatch=plane, _queue="nobody")  # no worker serves it
    with Worker(plane):
        ran = square.submit(2, _dispatch=plane)
        done, not_done = dls.wait([never, ran], timeout=20, return_when=dls.FIRST_COMPLETED)
        assert done == {ran} and not_done == {never}
        assert ran.result() == 4  # read with the batch: no request of its own
        assert plane.awaits == 0

        bad = square.submit(3, _dispatch=plane)
        done, not_done = dls.wait([never, bad], timeout=20, return_when=dls.FIRST_EXCEPTION)
        assert done == {bad} and not_done == {never}

        done, not_done = dls.wait([never, ran], timeout=0.3)  # ALL_COMPLETED: times out
        assert done == {ran} and not_done == {never}
        never.cancel()
        done, not_done = dls.wait([never, ran], timeout=20)
        assert done == {never, ran} and not not_done
    with pytest.raises(ValueError, match="return_when"):
        dls.wait([ran], return_when="SOMETIMES")


def test_as_completed_yields_each_call_once_first_ended_first(plane: CountingPlane) -> None:
    slow = square.submit(6, _dispatch=plane)  # queued first, and no worker yet
    with Worker(plane, queue="fast"):
        fast = square.submit(7, _dispatch=plane, _queue="fast")
        order = []
        it = dls.as_completed([slow, fast], timeout=20)
        order.append(next(it))
        assert order == [fast]
        with Worker(plane):
            order += list(it)
    assert order == [fast, slow] and [i.result() for i in order] == [49, 36]
    assert plane.awaits == 0  # every outcome came in a batch
    ids = [str(i) for i in order]  # plain ids work too, on the default plane or the Calls' plane
    assert sorted(dls.as_completed(dls.Calls(ids, dispatch=plane))) == sorted(ids)
    with pytest.raises(TimeoutError, match="1 of 1 calls still pending"):
        list(dls.as_completed([square.submit(1, _dispatch=plane, _queue="nobody")], timeout=0.2))


def test_calls_results_are_read_in_batches_with_progress(
    plane: CountingPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = square.map(range(1200), _dispatch=plane)
    assert all(isinstance(c, dls.Invocation) for c in calls)
    with Worker(plane):
        done, _ = dls.wait(calls, timeout=120)
    assert len(done) == 1200
    before = len(plane.batches)
    got = list(calls.results(return_exceptions=True, progress="text"))
    assert len(plane.batches) == before and plane.awaits == 0  # the outcomes are on the handles
    assert got[:3] == [0, 1, 4] and isinstance(got[3], DispatchError) and got[4] == 16
    assert capsys.readouterr().err.splitlines()[-1] == "calls: 1200/1200 done, 1 failed, 0 running"

    fresh = square.map(range(1200), _dispatch=plane)
    with Worker(plane):
        values = list(fresh.results(60, return_exceptions=True))
    assert values[5] == 25 and len(values) == 1200
    assert max(plane.batches) == 1000 and len(plane.batches) - before < 1200  # batches, not one per call


def test_progress_shows_a_tqdm_bar_with_the_counts(
    plane: CountingPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = square.map(range(20), _dispatch=plane)
    with Worker(plane):
        ended = list(dls.as_completed(calls, timeout=60, progress=True))  # tqdm is installed here
    assert sorted(ended) == sorted(calls)
    err = capsys.readouterr().err
    assert "calls: 100%" in err and "20/20" in err and "failed=1" in err, err


def test_an_unknown_id_is_not_found(plane: CountingPlane) -> None:
    (inv,) = dls.as_completed([dls.Invocation(new_ulid(), plane)], timeout=5)
    with pytest.raises(NotFound):
        inv.result()


def test_async_bodies_run_on_the_worker_and_the_sdk_awaits(plane: CountingPlane) -> None:
    assert asyncio.run(async_square(3)) == 9  # a local call is the plain coroutine
    with Worker(plane):
        assert async_square.submit(4, _dispatch=plane).result(10) == 16
        assert list(async_count.submit(3, _dispatch=plane).stream(timeout=10)) == [0, 1, 2]

        async def main() -> tuple[Any, ...]:
            value = await async_square.call_async(5, _dispatch=plane)
            inv = await async_count.submit_async(4, _dispatch=plane)
            streamed = [v async for v in inv.stream_async(timeout=10)]
            return value, streamed, await inv.result_async(10)

        assert asyncio.run(main()) == (25, [0, 1, 2, 3], None)


def test_an_async_udf_on_a_plane_that_cannot_run_it_is_refused_at_decoration() -> None:
    class OldPlane(Plane):  # keeps the protocol's runs_async = False
        trusted = False

    async def body() -> int:
        return 1

    with pytest.raises(TypeError, match="async def"):
        dls.udf(dispatch=OldPlane())(body)  # type: ignore[arg-type]
    dls.udf(dispatch=Dispatch(":memory:"))(body)  # the SDK's planes run it
    with pytest.raises(TypeError, match="async def"):
        dls.udf(body).submit(_dispatch=OldPlane())  # type: ignore[arg-type]


def test_example_09_runs_zero_infra() -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "09_handles_async.py")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "submitted 26 char id; result 49 succeeded",
        "first done: True",
        "failed: 1",
        "in order: [121, 144, DispatchError('ValueError: unlucky')]",
        "async call: LAKESHORE",
        "async stream: [0, 1, 2]",
    ]
    # the bar: tqdm's when it is installed, else the text line
    assert "20/20" in out.stderr and ("failed=1" in out.stderr or "1 failed" in out.stderr), out.stderr
