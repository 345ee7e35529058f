"""A submit handed to the waiting poll that will claim it, over real HTTP (server/polls.py).

When a poll for a submit's queue waits on the replica the submit reaches, the poll's pass runs in
the submit's own transaction and the poll answers once it commits: no wake-up travels, no second
transaction runs. The passes polls run are counted by reason with ``lakeshore_poll_passes``;
re-checks are 600 s away, so every pass counted was caused by the test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
from prometheus_client.parser import text_string_to_metric_families

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body
from tests.integration.fleet_kit import NO_RECHECK, POLL_S, headers, poll_once, submit_one
from tests.stack.wait import until_async


def _passes(cp: ControlPlane) -> dict[str, float]:
    """Poll passes so far, by reason."""
    resp = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    assert resp.status_code == 200
    for family in text_string_to_metric_families(resp.text):
        if family.name == "lakeshore_poll_passes":
            return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("no lakeshore_poll_passes counter on /metrics")


@contextlib.asynccontextmanager
async def _clients(cp: ControlPlane) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A daemon's client (long polls) and a producer's."""
    async with (
        httpx.AsyncClient(base_url=cp.url, headers=headers(cp.daemon_token), timeout=POLL_S + 30) as d,
        httpx.AsyncClient(base_url=cp.url, headers=headers(cp.producer_token)) as producer,
    ):
        yield d, producer


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_a_submit_is_claimed_in_its_own_transaction_by_the_longest_waiting_poll(store_url: str) -> None:
    with running_control_plane(store_url, config=NO_RECHECK) as cp:
        hub = cp.app.state.ctx.polls
        queue = f"handoff-{new_ulid()}"

        async def main() -> None:
            async with _clients(cp) as (d, producer):
                workers = [new_ulid() for _ in range(3)]
                polls: dict[str, asyncio.Future[dict[str, Any]]] = {}
                for k, w in enumerate(workers):  # one at a time: the order they wait in is known
                    polls[w] = asyncio.ensure_future(poll_once(d, w, queue))
                    await until_async(lambda k=k: hub.waiting == k + 1, f"{k + 1} polls waiting")
                before = await asyncio.to_thread(_passes, cp)

                inv = await submit_one(producer, queue)
                answer = await asyncio.wait_for(polls[workers[0]], 30)
                assert [c["body"]["invocation_id"] for c in answer["commands"]] == [inv]
                row = cp.store.get(inv)
                assert row is not None and row.state == "running" and row.worker_id == workers[0]
                # one pass, in the submit's transaction; nobody else was woken
                assert _delta(before, await asyncio.to_thread(_passes, cp)) == {"handed": 1.0}
                assert hub.waiting == 2 and not polls[workers[1]].done() and not polls[workers[2]].done()

                # a repeat of that submit makes nothing: the poll handed it finds nothing, waits
                # again (at the back of the line), and is not answered
                before = await asyncio.to_thread(_passes, cp)
                resp = await producer.post(
                    "/v1/producer/submit", content=msgpack.packb(submit_body(inv, queue))
                )
                assert resp.status_code == 200, resp.content
                await until_async(lambda: _delta(before, _passes(cp)) == {"handed": 1.0}, "the repeat's pass")
                await until_async(lambda: hub.waiting == 2, "the handed poll to wait again")
                assert not polls[workers[1]].done() and not polls[workers[2]].done()

                # so the next submit goes to the poll that has now waited longest
                nxt = await submit_one(producer, queue)
                answer = await asyncio.wait_for(polls[workers[2]], 30)
                assert [c["body"]["invocation_id"] for c in answer["commands"]] == [nxt]
                assert not polls[workers[1]].done()
                polls[workers[1]].cancel()

        asyncio.run(main())


def test_a_batch_is_handed_to_every_waiting_poll_and_the_rest_waits_for_the_next(store_url: str) -> None:
    """Five submits in one submit-batch, two polls waiting (``max`` 1): each poll is handed one,
    the three left are kept wakes, and the next polls claim them on their first pass."""
    with running_control_plane(store_url, config=NO_RECHECK) as cp:
        hub = cp.app.state.ctx.polls
        queue = f"handoff-batch-{new_ulid()}"

        async def main() -> None:
            async with _clients(cp) as (d, producer):
                first = [asyncio.ensure_future(poll_once(d, new_ulid(), queue)) for _ in range(2)]
                await until_async(lambda: hub.waiting == 2, "2 polls waiting")
                before = await asyncio.to_thread(_passes, cp)
                ids = [new_ulid() for _ in range(5)]
                body = {"submits": [submit_body(i, queue) for i in ids]}
                resp = await producer.post("/v1/producer/submit-batch", content=msgpack.packb(body))
                assert resp.status_code == 200, resp.content
                answers = await asyncio.wait_for(asyncio.gather(*first), 30)
                claimed = [c["body"]["invocation_id"] for a in answers for c in a["commands"]]
                assert len(claimed) == 2 and set(claimed) <= set(ids)
                assert _delta(before, await asyncio.to_thread(_passes, cp)) == {"handed": 2.0}

                more = [await poll_once(d, new_ulid(), queue) for _ in range(3)]
                claimed += [c["body"]["invocation_id"] for a in more for c in a["commands"]]
                assert sorted(claimed) == sorted(ids)

        asyncio.run(main())


def test_a_new_shapes_first_submit_goes_to_a_waiting_poll_that_can_run_it(store_url: str) -> None:
    """The first call of a placement shape the control plane has not seen yet (its needs are named
    in the submit's own transaction) is handed to the longest-waiting poll whose offer fits it, not
    to an older poll that cannot run it: that one's pass would claim nothing and spend the call's
    only wake-up, and the call would wait queued for a re-check (600 s here, 15-30 s by default)
    although a poll that fits was waiting."""
    with running_control_plane(store_url, config=NO_RECHECK) as cp:
        hub = cp.app.state.ctx.polls
        queue = f"shape-{new_ulid()}"

        async def main() -> None:
            async with _clients(cp) as (d, producer):
                cpu = asyncio.ensure_future(poll_once(d, new_ulid(), queue))  # waits longest, no GPU
                await until_async(lambda: hub.waiting == 1, "the CPU poll waiting")
                gpu = asyncio.ensure_future(poll_once(d, new_ulid(), queue, {"gpus": 1}))
                await until_async(lambda: hub.waiting == 2, "the GPU poll waiting")
                inv = new_ulid()
                body = submit_body(inv, queue, run_config={"resources": {"gpus": 1}})
                resp = await producer.post("/v1/producer/submit", content=msgpack.packb(body))
                assert resp.status_code == 200, resp.content
                try:
                    answer = await asyncio.wait_for(asyncio.shield(gpu), 10)
                    assert [c["body"]["invocation_id"] for c in answer["commands"]] == [inv]
                    assert not cpu.done() and hub.waiting == 1  # the CPU poll still waits
                finally:
                    cpu.cancel()

        asyncio.run(main())
