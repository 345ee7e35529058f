"""What lets an idle daemon's renewals and heartbeats skip the store (``server/idle.py``), and
what makes them write again: the memo's rules, the hub's dropped wakes, the notifier's memory."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dreamlake.lakeshore.server import idle
from dreamlake.lakeshore.server.idle import DaemonMemo
from dreamlake.lakeshore.server.polls import KEPT_PER_QUEUE, PollHub
from dreamlake.lakeshore.store import notify
from dreamlake.lakeshore.store.notify import Notifier, run_queue_channel

KEY = (("default",), True, None)


def _memo() -> DaemonMemo:
    return DaemonMemo(PollHub(Notifier(), max_polls=10, recheck_s=600.0, safety_recheck_s=600.0))


def test_a_renewal_skips_its_pass_once_and_only_for_the_same_poll() -> None:
    memo = _memo()
    mark = memo.hub.notifier.mark()
    assert memo.renewal("w", KEY) is None  # never written here
    memo.wrote("w", (mark, 0), "0.1.4")
    assert memo.renewal("w", KEY) is None  # its poll has not ended empty yet
    memo.left_nothing("w", KEY, mark)
    assert memo.renewal("w", (("other",), True, None)) is None  # other queues: it passes
    memo.left_nothing("w", KEY, mark)
    assert memo.renewal("w", KEY) == (mark, "0.1.4")
    assert memo.renewal("w", KEY) is None  # taken once: the next renewal needs its own empty end


def test_the_memo_stands_only_while_fresh_reliable_and_uncommanded(monkeypatch: pytest.MonkeyPatch) -> None:
    memo = _memo()
    hub = memo.hub
    memo.wrote("w", memo.begin(), None)
    assert memo.known("w") == (None,)
    hub.shared_store = True  # another replica's wake-ups may be missed (no relay listening)
    assert memo.known("w") is None
    hub.shared_store = False
    hub.notifier.notify("worker:w")  # a command may be waiting: a full write takes it
    assert memo.known("w") is None
    memo.wrote("w", memo.begin(), None)
    assert memo.known("w") == (None,)
    monkeypatch.setattr(idle, "FULL_EVERY_S", 0.0)  # past its period, an idle daemon is written
    memo.wrote("w", memo.begin(), None)
    assert memo.known("w") is None
    monkeypatch.undo()
    memo.wrote("w", memo.begin(), None)
    memo.forget_all()  # a pin
    assert memo.known("w") is None
    assert memo.quiet_heartbeat("w") is None
    # a write that began before a pin (or a register) may have read what it replaced: not kept
    for forget in (memo.forget_all, lambda: memo.forget("other")):
        began = memo.begin()
        forget()
        memo.wrote("w", began, "old")
        assert memo.known("w") is None
    memo.wrote("w", memo.begin(), "new")
    assert memo.known("w") == ("new",)


def test_a_heartbeat_is_quiet_only_while_its_daemons_poll_waits() -> None:
    async def main() -> None:
        memo = _memo()
        hub = memo.hub
        hub.start(asyncio.get_running_loop())
        memo.wrote("w", memo.begin(), "0.2")
        assert memo.quiet_heartbeat("w") is None
        ticket = hub.ticket("w", ["default"], takes_exec=True, namespace=None)
        waiting = asyncio.ensure_future(ticket.wait(600.0, hub.notifier.mark()))
        await asyncio.sleep(0)
        assert memo.quiet_heartbeat("w") == ("0.2",)
        waiting.cancel()
        hub.stop()

    asyncio.run(main())


def test_a_kept_wake_that_falls_off_makes_older_renewals_pass() -> None:
    async def main() -> None:
        memo = _memo()
        hub = memo.hub
        hub.start(asyncio.get_running_loop())
        mark = hub.notifier.mark()
        memo.wrote("w", (mark, 0), None)
        for _ in range(KEPT_PER_QUEUE + 1):  # no poll waits: kept, until the oldest falls off
            hub.notifier.notify(run_queue_channel("default", "default"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert hub.dropped_upto > mark
        memo.left_nothing("w", KEY, mark)
        assert memo.renewal("w", KEY) is None
        hub.stop()

    asyncio.run(main())


def test_a_channel_the_notifier_forgot_counts_as_fired(monkeypatch: Any) -> None:
    monkeypatch.setattr(notify, "MAX_CHANNELS", 3)
    n = Notifier()
    since = n.mark()
    n.notify("worker:a")  # a command for worker a, after ``since``
    assert n.fired(["worker:a"], since) and not n.fired(["worker:b"], since)
    for i in range(3):
        n.notify(f"inv:{i}")  # worker:a falls out of the notifier's memory
    # it still fired after ``since``; of worker:b the notifier can no longer tell, so it says so
    assert n.fired(["worker:a"], since) and n.fired(["worker:b"], since)
    later = n.mark()
    assert not n.fired(["worker:a"], later)  # nothing forgotten after ``later``
