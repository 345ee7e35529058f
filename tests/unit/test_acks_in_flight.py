"""Acks in flight (server/outcomes.py): a producer waiting on a call gets the outcome its ack
committed from memory, whether it wakes before or after the ack route ended the flight, and a
waiter that gives up takes nothing from the others."""

from __future__ import annotations

import asyncio

from dreamlake.lakeshore.server.outcomes import AcksInFlight

DONE = {"state": "succeeded", "result_blob": b"\x01", "error": None}


def test_a_waiter_woken_before_the_flight_ends_gets_its_committed_outcome() -> None:
    async def main() -> None:
        acks = AcksInFlight()
        flight = acks.begin("inv")
        early = asyncio.ensure_future(acks.outcome("inv", 10))
        quitter = asyncio.ensure_future(acks.outcome("inv", 0.01))
        assert await quitter is None  # gave up before the commit answered
        await asyncio.sleep(0)
        assert not early.done() and not flight.done()  # the flight is untouched by the quitter
        acks.end("inv", flight, DONE)
        assert await asyncio.wait_for(early, 5) == DONE
        assert await acks.outcome("inv", 0.0) == DONE  # kept for a waiter that wakes later

    asyncio.run(main())


def test_a_refused_ack_hands_nothing_over() -> None:
    async def main() -> None:
        acks = AcksInFlight()
        flight = acks.begin("inv")
        waiter = asyncio.ensure_future(acks.outcome("inv", 10))
        await asyncio.sleep(0)
        acks.end("inv", flight, None)
        assert await asyncio.wait_for(waiter, 5) is None
        assert await acks.outcome("inv", 0.0) is None
        assert await acks.outcome("nobody", 1.0) is None  # nothing in flight: no wait

    asyncio.run(main())
