"""A fleet of waiting daemons over real HTTP: one submit wakes one poll, not all of them.

Hundreds of long polls are held open by a cheap asyncio client (one connection each); the store
transactions polls run are counted with the server's ``lakeshore_poll_passes`` counter. Re-checks
are set far beyond the test's length, so every pass counted was caused by a wake-up. Across two
replicas on PostgreSQL, a poll on one replica must be woken by LISTEN/NOTIFY from the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dreamlake.lakeshore.errors import Unavailable
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.app import create_app
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.store import open_store
from nymph.client import ControlPlaneClient
from tests.integration.conftest import MSGPACK, ControlPlane, ServerThread, running_control_plane
from tests.integration.fleet_kit import NO_RECHECK, POLL_S, headers, poll_once, submit_one
from tests.stack.wait import until_async

WAITERS = 200
SETTLE_S = 60.0  # a deadline for conditions the test waits for, never a measured bound


def _passes(cp: ControlPlane) -> float:
    resp = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    assert resp.status_code == 200
    for family in text_string_to_metric_families(resp.text):
        if family.name == "lakeshore_poll_passes":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no lakeshore_poll_passes counter on /metrics")


def test_one_submit_wakes_one_of_200_waiting_polls_and_a_burst_wakes_each_once(store_url: str) -> None:
    with running_control_plane(store_url, config=NO_RECHECK) as cp:
        hub = cp.app.state.ctx.polls
        queue = f"fleet-{new_ulid()}"

        async def main() -> None:
            limits = httpx.Limits(max_connections=WAITERS + 8, max_keepalive_connections=WAITERS + 8)
            async with (
                httpx.AsyncClient(
                    base_url=cp.url, headers=headers(cp.daemon_token), limits=limits, timeout=POLL_S + 30
                ) as daemons,
                httpx.AsyncClient(base_url=cp.url, headers=headers(cp.producer_token)) as producer,
            ):
                workers = [new_ulid() for _ in range(WAITERS)]
                polls = {asyncio.ensure_future(poll_once(daemons, w, queue)): w for w in workers}
                await until_async(lambda: hub.waiting == WAITERS, f"{WAITERS} polls waiting", SETTLE_S)
                before = await asyncio.to_thread(_passes, cp)

                inv = await submit_one(producer, queue)
                done, pending = await asyncio.wait(polls, return_when=asyncio.FIRST_COMPLETED)
                (winner,) = done
                (cmd,) = winner.result()["commands"]
                assert cmd["body"]["invocation_id"] == inv
                await until_async(
                    lambda: hub.waiting == WAITERS - 1, "the other polls to wait again", SETTLE_S
                )
                assert all(not p.done() for p in pending)  # nobody else answered
                assert await asyncio.to_thread(_passes, cp) - before <= 2
                row = cp.store.get(inv)
                assert row is not None and row.worker_id == polls[winner] and row.attempt == 1

                # a burst: each waiting poll is woken once and claims one invocation
                burst = set(await asyncio.gather(*(submit_one(producer, queue) for _ in pending)))
                answers = await asyncio.gather(*pending)
                claimed = [c["body"]["invocation_id"] for a in answers for c in a["commands"]]
                assert sorted(claimed) == sorted(burst)
                assert await asyncio.to_thread(_passes, cp) - before <= WAITERS + 4

        asyncio.run(main())


def test_daemons_bound_to_different_namespaces_share_a_queue_name(store_url: str) -> None:
    """Each submit wakes a poll that may claim it, even when an older poll of another namespace waits
    on the same queue name. Re-checks are 600 s away: work given to the wrong poll would wait for
    the end of the right one's poll (80-100 s), past the 30 s this test waits for each claim."""
    with running_control_plane(store_url, config=NO_RECHECK) as cp:
        hub = cp.app.state.ctx.polls
        queue = f"shared-{new_ulid()}"
        spaces = ("team-a", "team-b")
        daemon_tokens = {
            ns: cp.store.create_token("daemon", f"d-{ns}-{queue}", namespace=ns) for ns in spaces
        }
        producer_tokens = {
            ns: cp.store.create_token("producer", f"p-{ns}-{queue}", namespace=ns) for ns in spaces
        }

        async def main() -> None:
            async with contextlib.AsyncExitStack() as stack:
                daemons = {
                    ns: await stack.enter_async_context(
                        httpx.AsyncClient(base_url=cp.url, headers=headers(t), timeout=POLL_S + 30)
                    )
                    for ns, t in daemon_tokens.items()
                }
                producers = {
                    ns: await stack.enter_async_context(
                        httpx.AsyncClient(base_url=cp.url, headers=headers(t))
                    )
                    for ns, t in producer_tokens.items()
                }
                workers = {ns: new_ulid() for ns in spaces}
                polls: dict[str, asyncio.Future[dict[str, Any]]] = {}
                for ns in reversed(spaces):  # team-b's poll waits longest
                    polls[ns] = asyncio.ensure_future(poll_once(daemons[ns], workers[ns], queue))
                    await until_async(lambda: hub.waiting == len(polls), f"{ns}'s poll waiting", SETTLE_S)
                # team-a twice with team-b's poll older, then team-b twice with team-a's older, ...
                for ns in ("team-a", "team-a", "team-b", "team-b", "team-a", "team-b"):
                    before = await asyncio.to_thread(_passes, cp)
                    inv = await submit_one(producers[ns], queue)
                    answer = await asyncio.wait_for(polls[ns], timeout=30)
                    (cmd,) = answer["commands"]
                    assert cmd["body"]["invocation_id"] == inv
                    assert all(not p.done() for p in polls.values() if p is not polls[ns])
                    polls[ns] = asyncio.ensure_future(poll_once(daemons[ns], workers[ns], queue))
                    await until_async(lambda: hub.waiting == 2, "both polls waiting again", SETTLE_S)
                    # the claim, and the opening pass of the winner's next poll: no poll of the
                    # other namespace was woken for it
                    assert await asyncio.to_thread(_passes, cp) - before == 2
                    row = cp.store.get(inv)
                    assert row is not None and row.worker_id == workers[ns] and row.namespace == ns
                for p in polls.values():
                    p.cancel()

        asyncio.run(main())


def test_a_poll_whose_daemon_hung_up_leaves_the_fifo_at_once(tmp_path: Any) -> None:
    """A daemon killed while its poll waits (nymph kill -9, a dropped connection) must not hold
    its place at the head of the queue's FIFO until the poll's deadline: the next submit would be
    handed to it and passed on, and the server's shutdown would wait for it and cancel it."""
    with running_control_plane(str(tmp_path / "s.db"), config=NO_RECHECK) as cp:
        hub = cp.app.state.ctx.polls
        queue = f"hangup-{new_ulid()}"

        async def main() -> None:
            async with (
                httpx.AsyncClient(
                    base_url=cp.url, headers=headers(cp.daemon_token), timeout=POLL_S + 30
                ) as live,
                httpx.AsyncClient(base_url=cp.url, headers=headers(cp.producer_token)) as producer,
            ):
                # the oldest poll, over a raw socket we then close
                host, port = cp.url.removeprefix("http://").split(":")
                _reader, writer = await asyncio.open_connection(host, int(port))
                body = msgpack.packb({"worker_id": new_ulid(), "queues": [queue], "timeout_s": POLL_S})
                head = (
                    f"POST /v1/daemon/poll HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{cp.daemon_token}\r\nContent-Type: {MSGPACK}\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                writer.write(head.encode() + body)
                await writer.drain()
                await until_async(lambda: hub.waiting == 1, "the doomed poll waiting", SETTLE_S)
                worker = new_ulid()
                second = asyncio.ensure_future(poll_once(live, worker, queue))
                await until_async(lambda: hub.waiting == 2, "a live poll waiting behind it", SETTLE_S)
                writer.close()
                await writer.wait_closed()
                await until_async(lambda: hub.waiting == 1, "the hung-up poll to leave the hub", SETTLE_S)
                before = await asyncio.to_thread(_passes, cp)
                inv = await submit_one(producer, queue)
                (cmd,) = (await asyncio.wait_for(second, SETTLE_S))["commands"]
                assert cmd["body"]["invocation_id"] == inv
                assert await asyncio.to_thread(_passes, cp) - before == 1  # no detour
                row = cp.store.get(inv)
                assert row is not None and row.worker_id == worker and row.attempt == 1

        asyncio.run(main())


def test_past_max_polls_a_poll_is_refused_503_with_retry_after(tmp_path: Any) -> None:
    config = ServerConfig(max_polls=3, poll_retry_after_s=5, **_no_recheck())
    with running_control_plane(str(tmp_path / "s.db"), config=config) as cp:
        hub = cp.app.state.ctx.polls

        async def main() -> None:
            async with httpx.AsyncClient(
                base_url=cp.url, headers=headers(cp.daemon_token), timeout=POLL_S + 30
            ) as daemons:
                held = [asyncio.ensure_future(poll_once(daemons, new_ulid(), "full")) for _ in range(3)]
                await until_async(lambda: hub.waiting == 3, "3 polls waiting", SETTLE_S)
                body = {"worker_id": new_ulid(), "queues": ["full"], "timeout_s": 1}
                resp = await daemons.post("/v1/daemon/poll", content=msgpack.packb(body))
                assert resp.status_code == 503
                assert 5 <= int(resp.headers["Retry-After"]) <= 10
                assert (
                    "limit of 3 concurrent long polls (lakeshore server --max-polls)"
                    in (msgpack.unpackb(resp.content)["error"])
                )
                client = ControlPlaneClient(cp.url, cp.daemon_token)
                try:
                    with pytest.raises(Unavailable) as err:
                        await asyncio.to_thread(client.poll, body, timeout_s=1)
                finally:
                    client.close()
                assert err.value.status == 503 and err.value.retry_after in {5.0, 6.0, 7.0, 8.0, 9.0, 10.0}
                # the held polls still get their work
                async with httpx.AsyncClient(base_url=cp.url, headers=headers(cp.producer_token)) as producer:
                    invs = {await submit_one(producer, "full") for _ in range(3)}
                answers = await asyncio.gather(*held)
                assert {a["commands"][0]["body"]["invocation_id"] for a in answers} == invs

        asyncio.run(main())


def _no_recheck() -> dict[str, float]:
    return {"recheck_s": NO_RECHECK.recheck_s, "poll_recheck_s": NO_RECHECK.poll_recheck_s}


def test_a_submit_on_one_replica_wakes_a_poll_waiting_on_the_other(_pg_url: str) -> None:
    """Replica B never re-checks within the test: its poll can only learn of A's submit (and of a
    cancel for its worker) through PostgreSQL LISTEN/NOTIFY. Before B listens, A is alone: a wake
    nobody local takes is dropped, not sent (nobody else would hear it; its own echo it drops
    anyway); once B says it listens, A sends."""
    with running_control_plane(_pg_url, config=NO_RECHECK) as a:
        relay = a.app.state.ctx.polls.relay
        assert relay is not None

        async def alone() -> None:
            await until_async(lambda: relay.listening, "A to LISTEN", SETTLE_S)
            async with httpx.AsyncClient(base_url=a.url, headers=headers(a.producer_token)) as on_a:
                await submit_one(on_a, f"nobody-{new_ulid()}")  # no poll waits for it anywhere
            await until_async(lambda: relay.dropped >= 1, "A to drop the wake", SETTLE_S)
            assert relay.sent == 0

        asyncio.run(alone())
        b_app = create_app(open_store(_pg_url), config=NO_RECHECK)
        b = ServerThread(b_app)
        b.start()
        b_polls = b_app.state.ctx.polls
        try:

            async def main() -> None:
                await until_async(
                    lambda: b_polls.relay is not None and b_polls.relay.listening, "B to LISTEN", SETTLE_S
                )
                queue, worker = f"replicas-{new_ulid()}", new_ulid()
                async with (
                    httpx.AsyncClient(
                        base_url=b.url, headers=headers(a.daemon_token), timeout=POLL_S + 30
                    ) as on_b,
                    httpx.AsyncClient(base_url=a.url, headers=headers(a.producer_token)) as on_a,
                ):
                    waiting = asyncio.ensure_future(poll_once(on_b, worker, queue))
                    await until_async(lambda: b_polls.waiting == 1, "a poll waiting on B", SETTLE_S)
                    started = time.monotonic()
                    inv = await submit_one(on_a, queue)
                    (cmd,) = (await waiting)["commands"]
                    woken_after = time.monotonic() - started
                    assert cmd["body"]["invocation_id"] == inv
                    assert woken_after < 0.9  # B re-checks every 600 s: the wake came by NOTIFY
                    assert relay.sent >= 1

                    waiting = asyncio.ensure_future(poll_once(on_b, worker, queue))
                    await until_async(
                        lambda: b_polls.waiting == 1, "the worker's next poll waiting on B", SETTLE_S
                    )
                    resp = await on_a.post(f"/v1/producer/invocations/{inv}/cancel")
                    assert resp.status_code == 200
                    (cancel,) = (await waiting)["commands"]
                    assert cancel["kind"] == "cancel" and cancel["body"]["invocation_id"] == inv

            asyncio.run(main())
        finally:
            b.stop()
            b_app.state.ctx.store.close()
