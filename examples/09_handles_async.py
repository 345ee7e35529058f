"""Handles, sweeps and async: what ``submit()`` returns, ``dls.wait``, ``dls.as_completed`` with a
progress bar, and ``async def`` bodies with the awaitable SDK calls.

Zero infrastructure: the local plane (``Dispatch(":memory:")``) and two workers run in this process
(against a control plane, drop ``_dispatch=plane`` and run ``lakeshore worker`` or nymph instead).

    python examples/09_handles_async.py
"""

from __future__ import annotations

import asyncio
import threading

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import Dispatch

plane = Dispatch(":memory:")


@dls.udf(queue="jobs")
def score(x: int) -> int:
    if x == 13:
        raise ValueError("unlucky")
    return x * x


@dls.udf(queue="jobs")
async def fetch(name: str) -> str:
    await asyncio.sleep(0.01)  # an async body: the worker runs it to completion
    return name.upper()


@dls.udf(queue="jobs")
async def ticks(n: int):
    for i in range(n):
        await asyncio.sleep(0)
        yield i  # an async generator streams as a generator does


def main() -> None:
    stop = threading.Event()
    workers = [
        threading.Thread(
            target=dls.run_worker,
            args=("jobs",),
            kwargs={"dispatch": plane, "stop": stop, "poll_timeout": 0.2},
            daemon=True,
        )
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    try:
        inv = score.submit(7, _dispatch=plane)  # an Invocation: the id (a str) with methods
        print("submitted", len(inv), "char id; result", inv.result(timeout=10), inv.status()["state"])

        calls = score.map(range(20), _dispatch=plane)
        done, _ = dls.wait(calls, timeout=30, return_when=dls.FIRST_COMPLETED)
        print("first done:", len(done) >= 1)
        failed = 0
        for call in dls.as_completed(calls, timeout=30, progress=True):  # read in batches
            try:
                call.result()  # no request: the outcome came with the batch
            except dls.DispatchError:
                failed += 1
        print("failed:", failed)
        print("in order:", list(calls.results(return_exceptions=True))[11:14])

        async def use_async() -> None:
            print("async call:", await fetch.call_async("lakeshore", _dispatch=plane))
            stream = await ticks.submit_async(3, _dispatch=plane)
            print("async stream:", [v async for v in stream.stream_async(timeout=10)])

        asyncio.run(use_async())
    finally:
        stop.set()
        for w in workers:
            w.join(10)


if __name__ == "__main__":
    main()
