"""Live frame fan-out: LocalFanout in process, RedisFanout over a real redis-server.

The contract the stream route relies on: a subscriber sees, in order, every frame published
after it subscribed; a lagging or failed subscriber is told (None / ``live`` False) so it falls
back to the store; a publish never raises because Redis is down.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from dreamlake.lakeshore.server.fanout import (
    STREAM_PREFIX,
    Fanout,
    LocalFanout,
    RedisFanout,
    Subscription,
    make_fanout,
)

if TYPE_CHECKING:
    from tests.integration.redis_fixture import RedisServer


Factory = Callable[[], Fanout]


@pytest.fixture(params=["local", "redis"])
def new_fanout(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """Builds fanouts of one backend; Redis ones share one server (as replicas would)."""
    if request.param == "local":
        shared = LocalFanout()
        yield lambda: shared
        return
    url = request.getfixturevalue("redis_url")
    yield lambda: RedisFanout(url)


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro_fn(), 30)

    return asyncio.run(main())


async def _drain(sub: Subscription, n: int) -> list[tuple[int, bytes, bool]]:
    got: list[tuple[int, bytes, bool]] = []
    for _ in range(n):
        item = await sub.get(timeout=10)
        assert item is not None, f"frame {len(got)} of {n} never arrived"
        got.append(item)
    return got


def _owner(request: pytest.FixtureRequest) -> str:
    return "01J" + str(abs(hash(request.node.nodeid)))[:20].ljust(23, "0")


def test_frames_arrive_in_order_with_data_and_final(
    new_fanout: Factory, request: pytest.FixtureRequest
) -> None:
    owner = _owner(request)

    async def body() -> list[tuple[int, bytes, bool]]:
        pub, follower = new_fanout(), new_fanout()
        async with follower.subscribe(owner) as sub:
            for seq in range(50):
                await pub.publish(owner, seq, b"frame-%d" % seq, seq == 49)
            got = await _drain(sub, 50)
        await pub.aclose()
        await follower.aclose()
        return got

    assert run(body) == [(seq, b"frame-%d" % seq, seq == 49) for seq in range(50)]


def test_only_frames_published_after_subscribing(new_fanout: Factory, request: pytest.FixtureRequest) -> None:
    owner = _owner(request)

    async def body() -> tuple[Any, Any]:
        fan = new_fanout()
        await fan.publish(owner, 0, b"before", False)
        async with fan.subscribe(owner) as sub:
            await fan.publish(owner, 1, b"after", True)
            first = await sub.get(timeout=10)
            rest = await sub.get(timeout=0.2)
        await fan.aclose()
        return first, rest

    assert run(body) == ((1, b"after", True), None)


def test_every_subscriber_gets_every_frame_and_owners_are_separate(
    new_fanout: Factory, request: pytest.FixtureRequest
) -> None:
    owner, other = _owner(request), _owner(request) + "-other"

    async def body() -> tuple[Any, Any, Any]:
        pub = new_fanout()
        subs = [new_fanout().subscribe(owner) for _ in range(3)]
        stranger = new_fanout().subscribe(other)
        for sub in [*subs, stranger]:
            await sub.__aenter__()
        for seq in range(5):
            await pub.publish(owner, seq, bytes([seq]), seq == 4)
        got = [await _drain(sub, 5) for sub in subs]
        silent = await stranger.get(timeout=0.2)
        for sub in [*subs, stranger]:
            await sub.aclose()
        return got, silent, subs[0].live

    got, silent, live = run(body)
    expected = [(seq, bytes([seq]), seq == 4) for seq in range(5)]
    assert got == [expected, expected, expected]
    assert silent is None
    assert live is False


def test_async_iteration_ends_after_the_final_frame(
    new_fanout: Factory, request: pytest.FixtureRequest
) -> None:
    owner = _owner(request)

    async def body() -> list[int]:
        fan = new_fanout()
        seen: list[int] = []
        async with fan.subscribe(owner) as sub:

            async def consume() -> None:
                async for seq, _data, _final in sub:
                    seen.append(seq)

            task = asyncio.create_task(consume())
            await asyncio.sleep(0)
            for seq in range(4):
                await fan.publish(owner, seq, b"x", seq == 3)
            await fan.publish(owner, 4, b"after the final frame", False)
            await task
        return seen

    assert run(body) == [0, 1, 2, 3]


def test_local_lagging_subscriber_is_told_then_keeps_following() -> None:
    async def body() -> tuple[Any, ...]:
        fan = LocalFanout(max_pending=3)
        sub = fan.subscribe("owner")
        for seq in range(5):  # the 4th overflows: pending frames dropped, lag flagged
            await fan.publish("owner", seq, b"x", False)
        signal = await sub.get(timeout=1)
        after = [await sub.get(timeout=1), await sub.get(timeout=1)]
        await fan.publish("owner", 5, b"y", True)
        last = await sub.get(timeout=1)
        return signal, after, last, sub.lagged, sub.live

    signal, after, last, lagged, live = run(body)
    assert signal is None  # "you missed frames: re-read the store"
    assert [item[0] for item in after] == [3, 4]
    assert last == (5, b"y", True)
    assert lagged == 1 and live is True


def test_local_forgets_closed_and_dropped_subscriptions() -> None:
    async def body() -> tuple[int, int, int, Any]:
        fan = LocalFanout()
        closed, dropped = fan.subscribe("o"), fan.subscribe("o")
        both = fan.subscriber_count("o")
        await closed.aclose()
        after_close = fan.subscriber_count("o")
        del dropped
        gc.collect()
        await fan.publish("o", 0, b"x", False)
        return both, after_close, fan.subscriber_count("o"), await closed.get(timeout=0)

    assert run(body) == (2, 1, 0, None)


def test_make_fanout_picks_the_backend(redis_url: str) -> None:
    assert isinstance(make_fanout(None), LocalFanout)
    assert isinstance(make_fanout(""), LocalFanout)
    fan = make_fanout(redis_url)
    assert isinstance(fan, RedisFanout)
    run(fan.aclose)


def test_redis_stream_is_capped_and_expires(redis_url: str, request: pytest.FixtureRequest) -> None:
    import redis

    owner = _owner(request)
    fan = RedisFanout(redis_url, maxlen=100, ttl_s=120)

    async def body() -> None:
        for seq in range(600):
            await fan.publish(owner, seq, b"x", False)
        await fan.aclose()

    run(body)
    client = redis.Redis.from_url(redis_url)
    key = STREAM_PREFIX + owner
    try:
        length, ttl = client.xlen(key), client.ttl(key)
    finally:
        client.delete(key)
        client.close()
    assert 100 <= length < 600
    assert 0 < ttl <= 120


def test_redis_that_dies_mid_run_is_logged_and_swallowed(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dreamlake.lakeshore.server.fanout")

    async def body() -> tuple[Any, ...]:
        fan = RedisFanout(private_redis.url)
        async with fan.subscribe("inv") as sub:
            await fan.publish("inv", 0, b"alive", False)
            first = await sub.get(timeout=10)
            waiting = asyncio.create_task(sub.get(timeout=1.0))  # blocked in XREAD when Redis dies
            await asyncio.sleep(0.1)
            private_redis.kill()
            await fan.publish("inv", 1, b"lost", False)  # must not raise
            during = await waiting
            after = await sub.get(timeout=0.2)
            live = sub.live
        late = fan.subscribe("inv")
        late_item = await late.get(timeout=0.2)
        await fan.publish("inv", 2, b"lost too", True)
        await fan.aclose()
        return first, during, after, live, late_item, late.live

    first, during, after, live, late_item, late_live = run(body)
    assert first == (0, b"alive", False)
    assert (during, after, live) == (None, None, False)
    assert (late_item, late_live) == (None, False)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("live publish of inv" in m for m in messages) == 2
    assert any("live follow of inv over Redis failed" in m for m in messages)


def test_owner_id_must_be_a_non_empty_string() -> None:
    with pytest.raises(ValueError, match="owner_id"):
        LocalFanout().subscribe("")
