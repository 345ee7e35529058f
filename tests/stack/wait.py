"""Waiting on a condition with a deadline, never a bare sleep.

:func:`until` polls a predicate until it answers something truthy, and returns that value; at the
deadline it fails the test with ``gave up after <limit>s waiting for <what>``. :func:`within` is the
same wait that answers None at the deadline (for a test that asserts on more than the condition).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

LIMIT_S = 60.0  # the suite's bound on one step of a test (an await, a start)
DEADLINE_S = 90.0  # until()'s default: only a failing test ever waits this long
STEP_S = 0.05


def until(
    predicate: Callable[[], Any], what: str, limit_s: float = DEADLINE_S, step_s: float = STEP_S
) -> Any:
    """Poll ``predicate`` every ``step_s`` until it is truthy; its value. Fails after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up after {limit_s:g}s waiting for {what}"
        time.sleep(step_s)


def within(predicate: Callable[[], Any], limit_s: float = DEADLINE_S, step_s: float = STEP_S) -> Any:
    """Poll ``predicate`` until it is truthy; its value, or None once ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(step_s)


async def until_async(
    predicate: Callable[[], Any | Awaitable[Any]],
    what: str,
    limit_s: float = DEADLINE_S,
    step_s: float = 0.02,
) -> Any:
    """:func:`until` inside an event loop: sleeps with ``asyncio.sleep``; ``predicate`` may be a
    coroutine function."""
    deadline = time.monotonic() + limit_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up after {limit_s:g}s waiting for {what}"
        await asyncio.sleep(step_s)
