"""The poll hub's routing rules, on a real notifier without a server: who a wake-up goes to."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dreamlake.lakeshore.server.polls import (
    EXEC,
    HANDED,
    MAX_HANDOFFS,
    RECHECK,
    RUN,
    SHUTDOWN,
    TIMEOUT,
    WOKEN,
    WORKER,
    PollHub,
    PollsFull,
    Ticket,
    Wake,
    parse_wake,
)
from dreamlake.lakeshore.store.api import PollRequest, SubmitRequest
from dreamlake.lakeshore.store.notify import Notifier, exec_queue_channel, run_queue_channel

LONG = 600.0  # no re-check fires during a test


def _hub(**kw: Any) -> PollHub:
    args: dict[str, Any] = {"max_polls": 100, "recheck_s": LONG, "safety_recheck_s": LONG, **kw}
    return PollHub(Notifier(), **args)


def run(test: Callable[[PollHub], Awaitable[None]], **kw: Any) -> None:
    hub = _hub(**kw)

    async def main() -> None:
        hub.start(asyncio.get_running_loop())
        try:
            await test(hub)
        finally:
            hub.stop()

    asyncio.run(main())


async def _settled() -> None:
    """Let the loop run the notifier's call_soon_threadsafe callbacks and the woken waits."""
    for _ in range(5):
        await asyncio.sleep(0)


def _wait(t: Ticket, since: int, timeout: float = LONG) -> asyncio.Task[str]:
    return asyncio.ensure_future(t.wait(timeout, since))


def test_channels_parse_to_wakes() -> None:
    assert parse_wake(run_queue_channel("team-a", "gpu")) == Wake(RUN, "gpu", "team-a")
    assert Wake(RUN, "gpu", "team-a").channel == "run-queue:team-a:gpu"
    assert parse_wake(exec_queue_channel("team-a", "gpu")) == Wake(EXEC, "gpu", "team-a")
    assert Wake(EXEC, "gpu", "team-a").channel == "exec-queue:team-a:gpu"
    # queue:<q> keeps the notifier's wake-all (in-process workers); the hub routes run-queue:
    for other in (
        "queue:gpu",
        "inv:01H",
        "worker:01H",
        "exec:01H",
        "exec-queue:gpu",
        "run-queue:gpu",
        "topic:t",
    ):
        assert parse_wake(other) is None


def test_one_notification_wakes_the_longest_waiting_poll_only() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        tickets = [hub.ticket(f"w{i}", ["q"], takes_exec=True, namespace=None) for i in range(3)]
        waits = [_wait(t, mark) for t in tickets]
        await _settled()
        assert hub.waiting == 3
        hub.notifier.notify(run_queue_channel("default", "q"))
        hub.notifier.notify(run_queue_channel("default", "q"))
        await _settled()
        assert [w.done() for w in waits] == [True, True, False]
        assert waits[0].result() == WOKEN and tickets[0].woken == [Wake(RUN, "q", "default")]
        assert hub.waiting == 1
        waits[2].cancel()
        await _settled()
        assert hub.waiting == 0

    run(test)


def test_a_poll_of_several_queues_is_woken_once_and_the_next_wake_is_kept() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        both = hub.ticket("w1", ["a", "b"], takes_exec=False, namespace=None)
        waiting = _wait(both, mark)
        await _settled()
        hub.notifier.notify(run_queue_channel("default", "a"))
        hub.notifier.notify(run_queue_channel("default", "b"))
        await _settled()
        assert waiting.result() == WOKEN and both.woken == [Wake(RUN, "a", "default")]
        # nobody waits on b: its wake is kept for a poll whose pass may have missed that work ...
        late = hub.ticket("w2", ["b"], takes_exec=False, namespace=None)
        assert await late.wait(LONG, mark) == WOKEN and late.woken == [Wake(RUN, "b", "default")]
        # ... and a poll whose fruitless pass started after it drops it rather than waking for it
        hub.notifier.notify(run_queue_channel("default", "c"))
        await _settled()
        after = hub.notifier.mark()
        stale = hub.ticket("w3", ["c"], takes_exec=False, namespace=None)
        assert await stale.wait(0.01, after) == TIMEOUT
        assert await hub.ticket("w4", ["c"], takes_exec=False, namespace=None).wait(0.01, mark) == TIMEOUT

    run(test)


def test_exec_wakes_go_to_a_poll_that_may_claim_the_job() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        run_only = hub.ticket("w1", ["q"], takes_exec=False, namespace=None)
        bound_a = hub.ticket("w2", ["q"], takes_exec=True, namespace="a")
        unbound = hub.ticket("w3", ["q"], takes_exec=True, namespace=None)
        waits = {t.worker_id: _wait(t, mark) for t in (run_only, bound_a, unbound)}
        await _settled()
        hub.notifier.notify(exec_queue_channel("b", "q"))
        await _settled()
        assert [w for w, task in waits.items() if task.done()] == ["w3"]
        hub.notifier.notify(exec_queue_channel("a", "q"))
        await _settled()
        assert waits["w2"].done() and bound_a.woken == [Wake(EXEC, "q", "a")]
        assert not waits["w1"].done()
        waits["w1"].cancel()

    run(test)


def test_invocation_wakes_go_to_a_poll_of_their_namespace_or_an_unbound_one() -> None:
    """Daemons bound to different namespaces may share a queue name: an invocation of namespace a
    wakes a poll bound to a (or to none), never the older poll bound to b."""

    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        bound_b = hub.ticket("w1", ["q"], takes_exec=False, namespace="b")
        bound_a = hub.ticket("w2", ["q"], takes_exec=False, namespace="a")
        unbound = hub.ticket("w3", ["q"], takes_exec=False, namespace=None)
        waits = {t.worker_id: _wait(t, mark) for t in (bound_b, bound_a, unbound)}
        await _settled()
        hub.notifier.notify(run_queue_channel("a", "q"))
        await _settled()
        assert [w for w, task in waits.items() if task.done()] == ["w2"]
        assert bound_a.woken == [Wake(RUN, "q", "a")]
        hub.notifier.notify(run_queue_channel("c", "q"))  # only the unbound poll may claim it
        await _settled()
        assert [w for w, task in waits.items() if task.done()] == ["w2", "w3"]
        hub.notifier.notify(run_queue_channel("b", "q"))
        await _settled()
        assert waits["w1"].result() == WOKEN and bound_b.woken == [Wake(RUN, "q", "b")]
        # a wake no waiting poll may claim is kept for its namespace only
        hub.notifier.notify(run_queue_channel("a", "q"))
        await _settled()
        assert await hub.ticket("w4", ["q"], takes_exec=False, namespace="b").wait(0.01, mark) == TIMEOUT
        late = hub.ticket("w5", ["q"], takes_exec=False, namespace="a")
        assert await late.wait(LONG, mark) == WOKEN and late.woken == [Wake(RUN, "q", "a")]

    run(test)


def test_a_command_for_a_worker_wakes_its_poll_without_spending_work() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        mine, other = (hub.ticket(w, ["q"], takes_exec=True, namespace=None) for w in ("w1", "w2"))
        waits = [_wait(mine, mark), _wait(other, mark)]
        await _settled()
        hub.notifier.notify("worker:w1")
        await _settled()
        assert waits[0].result() == WORKER and mine.woken == [] and not waits[1].done()
        # a command queued while the poll was in its pass: the next wait does not sleep
        assert await hub.ticket("w1", ["q"], takes_exec=True, namespace=None).wait(LONG, mark) == WORKER
        waits[1].cancel()

    run(test)


@pytest.mark.parametrize(
    ("claimed", "limit", "handed_on"),
    [
        ([Wake(RUN, "a", "default")], 1, False),  # its own work: spent
        ([], 1, False),  # room to spare and nothing found: that work is gone
        ([Wake(RUN, "b", "default")], 1, True),  # full of other work: a's invocation may still be queued
        ([Wake(RUN, "b", "default")], 2, False),  # room left, so nothing of a's was claimable
    ],
)
def test_a_woken_poll_hands_its_wake_on_only_when_other_work_filled_it(
    claimed: list[Wake], limit: int, handed_on: bool
) -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        first = hub.ticket("w1", ["a", "b"], takes_exec=False, namespace=None)
        second = hub.ticket("w2", ["a"], takes_exec=False, namespace=None)
        waits = [_wait(first, mark), _wait(second, mark)]
        await _settled()
        hub.notifier.notify(run_queue_channel("default", "a"))
        await _settled()
        assert waits[0].result() == WOKEN and not waits[1].done()
        first.settle(claimed, limit)
        await _settled()
        assert waits[1].done() is handed_on
        first.close()
        if not handed_on:
            waits[1].cancel()

    run(test)


def test_a_poll_that_ends_without_its_pass_hands_the_wake_on() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        gone = hub.ticket("w1", ["q"], takes_exec=False, namespace=None)
        live = hub.ticket("w2", ["q"], takes_exec=False, namespace=None)
        waits = [_wait(gone, mark), _wait(live, mark)]
        await _settled()
        hub.notifier.notify(run_queue_channel("default", "q"))
        await _settled()
        assert waits[0].result() == WOKEN
        gone.close()  # the daemon hung up before the pass
        await _settled()
        assert waits[1].result() == WOKEN and live.woken == [Wake(RUN, "q", "default")]

    run(test)


def test_relayed_work_is_not_sent_back_and_local_work_nobody_takes_is_relayed() -> None:
    class Relay:
        listening = True

        def __init__(self) -> None:
            self.sent: list[str] = []

        def publish(self, channel: str) -> None:
            self.sent.append(channel)

    async def test(hub: PollHub) -> None:
        relay = Relay()
        hub.relay = relay
        hub.notifier.notify(run_queue_channel("default", "q"))
        hub.notifier.notify(run_queue_channel("default", "r"), relayed=True)
        hub.notifier.notify("worker:w9")
        await _settled()
        assert relay.sent == ["run-queue:default:q", "worker:w9"]
        mark = hub.notifier.mark()
        t = hub.ticket("w1", ["q"], takes_exec=False, namespace=None)
        waiting = _wait(t, mark)
        await _settled()
        hub.notifier.notify(
            run_queue_channel("default", "q")
        )  # taken here: no other replica needs to hear of it
        await _settled()
        assert waiting.result() == WOKEN and relay.sent == ["run-queue:default:q", "worker:w9"]

    run(test)


def test_waits_recheck_sooner_while_other_replicas_wakes_may_be_missed() -> None:
    class Down:
        listening = False

        def publish(self, channel: str) -> None:
            pass

    async def test(hub: PollHub) -> None:
        hub.shared_store = True
        hub.relay = Down()
        assert not hub.reliable
        t = hub.ticket("w1", ["q"], takes_exec=False, namespace=None)
        assert await t.wait(LONG, hub.notifier.mark()) == RECHECK

    run(test, recheck_s=0.02)


def test_admission_stops_at_max_polls() -> None:
    hub = _hub(max_polls=2)
    with hub.admitted(), hub.admitted():
        assert hub.active == 2
        with pytest.raises(PollsFull, match="limit of 2 concurrent long polls"), hub.admitted():
            pass
    assert hub.active == 0


def _submit(queue: str, namespace: str = "default", inv: str = "01HSUBMIT") -> SubmitRequest:
    return SubmitRequest(inv, queue, {}, b"", {}, namespace=namespace)


def _preparing(t: Ticket) -> list[PollRequest]:
    """Give ``t`` a pass to be handed (as the poll route does); the list collects what it wrote."""
    made: list[PollRequest] = []

    def prepare() -> tuple[PollRequest, Any]:
        made.append(PollRequest(t.worker_id, list(t.queues), namespace=t.namespace, duties=False))
        return made[-1], f"back-{t.worker_id}"

    t.prepare = prepare
    return made


def test_a_submit_is_handed_to_the_head_poll_that_may_claim_it_with_its_wake() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        other = hub.ticket("other-ns", ["q"], takes_exec=True, namespace="team-b")
        tickets = [hub.ticket(f"w{i}", ["q"], takes_exec=True, namespace=None) for i in range(3)]
        for t in (other, *tickets):
            _preparing(t)
        waits = [_wait(t, mark) for t in (other, *tickets)]
        await _settled()

        handed = hub.hand_off([_submit("q", inv="A"), _submit("q", inv="B"), _submit("elsewhere")])
        # one pass per submit that a waiting poll may claim, in the order the polls waited; the
        # team-b poll may not claim default's work, and nobody serves "elsewhere"
        assert [(w.worker_id, w.handed) for w, _ in handed] == [("w0", ("A",)), ("w1", ("B",))]
        assert hub.waiting == 2 and not hub.is_waiting("w0") and hub.is_waiting("w2")
        assert tickets[0].woken == [Wake(RUN, "q", "default")]
        await _settled()
        assert not any(w.done() for w in waits)  # nothing is answered before the commit

        handed[1][1]("answer-B")
        handed[0][1]("answer-A")
        await _settled()
        assert waits[1].result() == waits[2].result() == HANDED
        assert tickets[0].handed == ("back-w0", "answer-A")
        assert tickets[1].handed == ("back-w1", "answer-B")
        assert not waits[0].done() and not waits[3].done()
        for w in waits:
            w.cancel()

    run(test)


def test_a_handed_poll_has_no_recheck_or_timeout_while_its_pass_is_in_the_store() -> None:
    async def test(hub: PollHub) -> None:
        t = hub.ticket("w", ["q"], takes_exec=True, namespace=None)
        _preparing(t)
        wait = asyncio.ensure_future(t.wait(0.05, hub.notifier.mark()))
        await _settled()
        ((_, deliver),) = hub.hand_off([_submit("q")])
        await asyncio.sleep(0.2)  # past the poll's own deadline
        assert not wait.done()
        deliver("answer")
        assert await wait == HANDED

    run(test)


def test_no_hand_off_to_a_poll_without_a_pass_to_hand_or_while_the_server_stops() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        bare = hub.ticket("bare", ["q"], takes_exec=True, namespace=None)
        wait = _wait(bare, mark)
        await _settled()
        assert hub.hand_off([_submit("q")]) == []  # the head cannot be handed: the wake will go
        assert hub.waiting == 1
        wait.cancel()

        t = hub.ticket("w", ["q"], takes_exec=True, namespace=None)
        _preparing(t)
        wait = _wait(t, mark)
        await _settled()
        hub.drain()
        assert await wait == SHUTDOWN
        assert hub.hand_off([_submit("q")]) == []

    run(test)


def test_hand_offs_stop_at_their_limit_per_batch() -> None:
    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        tickets = [
            hub.ticket(f"w{i}", ["q"], takes_exec=True, namespace=None) for i in range(MAX_HANDOFFS + 3)
        ]
        for t in tickets:
            _preparing(t)
        waits = [_wait(t, mark) for t in tickets]
        await _settled()
        handed = hub.hand_off([_submit("q", inv=f"i{k}") for k in range(len(tickets))])
        assert len(handed) == MAX_HANDOFFS and hub.waiting == 3
        for w in waits:
            w.cancel()

    run(test, max_polls=MAX_HANDOFFS + 10)


def test_a_handed_poll_that_hung_up_hands_its_wake_on_once_its_pass_committed() -> None:
    """The daemon left while its pass was in the store: its wake goes to the next poll, but only
    once the pass has its answer (a pass before the submit's commit would find nothing and spend
    the wake); that poll passes and finds whatever the first one did not take."""

    async def test(hub: PollHub) -> None:
        mark = hub.notifier.mark()
        first = hub.ticket("first", ["q"], takes_exec=True, namespace=None)
        _preparing(first)
        hangup: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gone = asyncio.ensure_future(first.wait(LONG, mark, hangup))
        await _settled()
        second = hub.ticket("second", ["q"], takes_exec=True, namespace=None)
        nxt = _wait(second, mark)
        await _settled()
        ((_, deliver),) = hub.hand_off([_submit("q")])
        hangup.set_result(None)
        assert await gone == "hangup"
        first.close()  # the route's finally
        await _settled()
        assert not nxt.done()  # the submit is not committed yet
        deliver("late")  # committed: nobody reads the answer, the wake moves on
        assert await nxt == WOKEN and second.woken == [Wake(RUN, "q", "default")]

    run(test)
