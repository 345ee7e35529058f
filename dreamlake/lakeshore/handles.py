"""Handles on submitted calls: :class:`Invocation`, :func:`wait`, :func:`as_completed`, progress.

``f.submit(...)`` returns an :class:`Invocation`: the invocation id (a ``str`` subclass, so every
use of an id keeps working: printing it, storing it, passing it to ``SyncQueue`` or the CLI) that
also knows its plane and queue, with ``.result(timeout)``, ``.stream(since)``, ``.logs(follow)``,
``.status()``, ``.cancel()`` and the awaitable ``.result_async()`` / ``.stream_async()``. It
pickles and packs as the plain id.

Many calls are read in bulk. :func:`wait` and :func:`as_completed` (and ``Calls.results()``) ask
their plane for the outcomes of up to ``AWAIT_BATCH_MAX`` calls per request (``await_batch``:
over HTTP ``POST /v1/producer/await-batch``, which answers as soon as one of them ended), never
one request per call: a sweep of 100,000 calls reads its results in about 100 requests. An
outcome read that way stays on its handle, so ``inv.result()`` after ``as_completed`` costs no
request. ``progress=True`` shows a bar with the done / failed / running counts: tqdm when it is
installed (``pip install 'dreamlake-lakeshore[progress]'``), else rich, else one line of text on
stderr.

The awaitable variants run the same (thread-safe) client in a worker thread
(``asyncio.to_thread``): the event loop never blocks, and a result, a retry or an error is the
same as the blocking call's. This module is part of the entry bundle (Python >= 3.9, msgpack only).
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import namedtuple

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Iterator
    from typing import Any

    from dreamlake.lakeshore.dispatch import Plane
    from dreamlake.lakeshore.queue import LogChunk, Stream

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
    "DoneAndNotDone",
    "Invocation",
    "as_completed",
    "wait",
]

FIRST_COMPLETED = "FIRST_COMPLETED"
FIRST_EXCEPTION = "FIRST_EXCEPTION"
ALL_COMPLETED = "ALL_COMPLETED"
AWAIT_BATCH_MAX = 1000  # ids per await_batch request (the control plane's limit)
POLL_S = 30.0  # the longest one await_batch request waits on the server
# After an answer that ended few of the calls asked, the next request waits this long since the
# last: a sweep's reader asks about 10 times a second, not once per result (each ask reads up to
# 1,000 rows, and a reader in a tight loop slows the workers writing them).
PACE_S = 0.1
WINDOW_MIN = 64
_UNKNOWN = {"state": "unknown"}

if TYPE_CHECKING:
    from typing import NamedTuple

    class DoneAndNotDone(NamedTuple):
        done: set[Invocation]
        not_done: set[Invocation]

else:
    DoneAndNotDone = namedtuple("DoneAndNotDone", ("done", "not_done"))


class Invocation(str):
    """A submitted call: its invocation id (a ``str``), and the plane and queue it went to."""

    _dispatch: Plane | None
    _queue: str
    _outcome: dict[str, Any] | None

    def __new__(cls, invocation_id: str, dispatch: Plane | None = None, queue: str = "default") -> Invocation:
        self = str.__new__(cls, invocation_id)
        self._dispatch = dispatch
        self._queue = queue
        self._outcome = None  # the terminal outcome, once read in bulk
        return self

    def __reduce__(self) -> Any:  # pickles as the plain id: a plane holds connections
        return (str, (str(self),))

    @property
    def id(self) -> str:
        """The invocation id as a plain ``str``."""
        return str(self)

    @property
    def dispatch(self) -> Plane:
        """The plane the call went to, else the process default."""
        if self._dispatch is not None:
            return self._dispatch
        from dreamlake.lakeshore.default_dispatch import get_default_dispatch

        return get_default_dispatch()

    def _q(self) -> Any:
        from dreamlake.lakeshore.queue import SyncQueue

        return SyncQueue(self._queue, dispatch=self._dispatch)

    def result(self, timeout: float = 60.0) -> Any:
        """The return value (a generator's: its return value); ``DispatchError`` when the call
        failed; ``TimeoutError`` when it is still pending after ``timeout`` s."""
        if self._outcome is not None:
            return _value(self, self._outcome)
        return self._q().result(self, timeout)

    def stream(self, since: int = -1, timeout: float = 30.0) -> Stream:
        """The values a generator call yields after ``since``: replay, then follow live."""
        return self._q().stream(self, since, timeout)  # type: ignore[no-any-return]

    def logs(self, follow: bool = False, since: int = -1, timeout: float | None = None) -> Iterator[LogChunk]:
        """Its stdout and stderr as ``LogChunk`` s; ``follow`` until it ends."""
        return self._q().logs(self, follow, since, timeout)  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        """Its record: state, queue, attempt, times, error, children."""
        return self._q().status(self)  # type: ignore[no-any-return]

    def cancel(self, descendants: bool = True) -> str:
        """Cancel it (and, by default, the tasks it submitted); the state after the call."""
        return self._q().cancel(self, descendants)  # type: ignore[no-any-return]

    def done(self) -> bool:
        """Whether it ended (one status request, none once its outcome was read)."""
        if self._outcome is not None:
            return True
        from dreamlake.lakeshore.states import TERMINAL_STATES

        return self.status().get("state") in TERMINAL_STATES

    async def result_async(self, timeout: float = 60.0) -> Any:
        """``await inv.result_async()``: :meth:`result` without blocking the event loop."""
        import asyncio

        return await asyncio.to_thread(self.result, timeout)

    async def stream_async(self, since: int = -1, timeout: float = 30.0) -> AsyncIterator[Any]:
        """``async for v in inv.stream_async()``: :meth:`stream` without blocking the event loop."""
        import asyncio

        stream = await asyncio.to_thread(self.stream, since, timeout)
        done = object()
        try:
            while True:
                value = await asyncio.to_thread(next, stream, done)
                if value is done:
                    return
                yield value
        finally:
            stream.close()


def _value(inv: Invocation, outcome: dict[str, Any]) -> Any:
    """The value of a terminal ``outcome`` (an await answer), or its error raised."""
    if outcome.get("state") == "unknown":
        from dreamlake.lakeshore.errors import NotFound

        raise NotFound(f"unknown invocation {inv}: check the id returned by submit()", 404)
    from dreamlake.lakeshore.queue import SyncQueue

    return SyncQueue(inv._queue, dispatch=inv._dispatch)._settle(inv, outcome, 0.0, 0.0)


def failed(inv: Invocation) -> bool:
    """Whether a handle whose outcome was read ended in anything but success."""
    return inv._outcome is not None and inv._outcome.get("state") != "succeeded"


def handles(calls: Iterable[Any], dispatch: Plane | None = None) -> list[Invocation]:
    """``calls`` as handles: an :class:`Invocation` as it is, a plain id on ``dispatch`` (a
    ``Calls``' own plane, else the default)."""
    plane = dispatch if dispatch is not None else getattr(calls, "dispatch", None)
    out = []
    for c in calls:
        if isinstance(c, Invocation):
            out.append(c)
        elif isinstance(c, str):
            out.append(Invocation(c, plane))
        else:
            raise TypeError(f"expected invocation ids (what submit() returns), got {type(c).__name__}")
    return out


class Tracker:
    """The outcomes of many handles, read in batches from their planes (``await_batch``).

    ``step(timeout)`` asks about a window of the first pending handles in input order (grouped
    by plane; 4x what ended last time, ``WINDOW_MIN`` to ``AWAIT_BATCH_MAX``) and returns the ones
    that ended, their outcome set; ``running`` counts the pending handles the last answers said
    were running."""

    def __init__(self, invs: list[Invocation]) -> None:
        self.pending: dict[str, Invocation] = {}
        for inv in invs:
            if inv._outcome is not None:
                continue
            self.pending.setdefault(str(inv), inv)
        self.states: dict[str, str] = {}
        self.done = 0
        self.failed = 0
        self._paced_until = 0.0
        self._window = AWAIT_BATCH_MAX  # calls asked about per request; follows the pace they end

    @property
    def running(self) -> int:
        return sum(1 for s in self.states.values() if s == "running")

    def step(self, timeout: float) -> list[Invocation]:
        if not self.pending:
            return []
        pause = min(self._paced_until - time.monotonic(), timeout)
        if pause > 0:
            time.sleep(pause)
            timeout -= pause
        asked = 0
        groups: dict[int, tuple[Any, list[Invocation]]] = {}
        # the window: the first pending calls in input order, by plane
        for inv in itertools.islice(self.pending.values(), self._window):
            plane = inv.dispatch
            groups.setdefault(id(plane), (plane, []))[1].append(inv)
        wait = timeout if len(groups) == 1 else min(timeout, 0.2)
        ended: list[Invocation] = []
        for plane, invs in groups.values():
            asked += len(invs)
            answer = _await_batch(plane, invs, max(0.0, wait))
            for inv_id, outcome in answer["results"].items():
                ended += self._end(inv_id, outcome)
            for inv_id in answer["unknown"]:
                ended += self._end(inv_id, dict(_UNKNOWN))
            for inv_id, state in answer["states"].items():
                if inv_id in self.pending:
                    self.states[inv_id] = state
            if ended:
                wait = 0.0  # the other planes: only what already ended
        small = len(ended) * 4 < asked  # most of the window still pending: ask again a bit later
        self._paced_until = time.monotonic() + PACE_S if small else 0.0
        # the next window: four times what ended (what ends in order is near the front), so a
        # request reads a few rows per result, not 1,000 rows for a few results
        self._window = max(WINDOW_MIN, min(AWAIT_BATCH_MAX, 4 * len(ended)))
        return ended

    def _end(self, inv_id: str, outcome: dict[str, Any]) -> list[Invocation]:
        inv = self.pending.pop(inv_id, None)
        if inv is None:
            return []
        self.states.pop(inv_id, None)
        inv._outcome = outcome
        self.done += 1
        self.failed += outcome.get("state") != "succeeded"
        return [inv]


def _await_batch(plane: Any, invs: list[Invocation], timeout: float) -> dict[str, Any]:
    """``plane.await_batch`` of the handles (one await of the first on a plane that keeps the
    protocol's default)."""
    return plane.await_batch([str(i) for i in invs], timeout)  # type: ignore[no-any-return]


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    return time.monotonic() + timeout


def _left(deadline: float | None) -> float:
    return POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))


def wait(
    calls: Iterable[Any], timeout: float | None = None, return_when: str = ALL_COMPLETED
) -> DoneAndNotDone:
    """Wait for the calls (handles or ids), as ``concurrent.futures.wait`` does: returns
    ``(done, not_done)``, two sets of :class:`Invocation` s, once ``return_when`` holds
    (``FIRST_COMPLETED``, ``FIRST_EXCEPTION``: one failed, or all ended; ``ALL_COMPLETED``) or
    ``timeout`` s passed (None: no limit). The outcomes come in batches and stay on the handles:
    ``inv.result()`` of a done one costs no request."""
    if return_when not in (FIRST_COMPLETED, FIRST_EXCEPTION, ALL_COMPLETED):
        raise ValueError(
            f"return_when must be FIRST_COMPLETED, FIRST_EXCEPTION or ALL_COMPLETED, got {return_when!r}"
        )
    invs = handles(calls)
    deadline = _deadline(timeout)
    tracker = Tracker(invs)
    done = {i for i in invs if i._outcome is not None}

    def satisfied() -> bool:
        if not tracker.pending:
            return True
        if return_when == FIRST_COMPLETED:
            return bool(done)
        if return_when == FIRST_EXCEPTION:
            return any(failed(i) for i in done)
        return False

    while not satisfied():
        done.update(tracker.step(_left(deadline)))
        if deadline is not None and time.monotonic() >= deadline:
            break
    return DoneAndNotDone(done, {i for i in invs if i not in done})


def as_completed(
    calls: Iterable[Any], timeout: float | None = None, *, progress: bool | str = False
) -> Iterator[Invocation]:
    """The calls (handles or ids) as they end, first ended first, as :class:`Invocation` s whose
    ``result()`` costs no request. ``TimeoutError`` when ``timeout`` s (None: no limit) pass
    before the last one ended. ``progress``: a bar with done / failed / running counts (True:
    tqdm, else rich, else text; or name one: ``"tqdm"``, ``"rich"``, ``"text"``)."""
    invs = handles(calls)
    deadline = _deadline(timeout)
    tracker = Tracker(invs)
    bar = Progress(len(invs), progress)
    try:
        for inv in invs:
            if inv._outcome is not None and str(inv) not in tracker.pending:
                bar.add(1, failed(inv), tracker.running)
                yield inv
        while tracker.pending:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{len(tracker.pending)} of {len(invs)} calls still pending after {timeout} s"
                )
            for inv in tracker.step(_left(deadline)):
                bar.add(1, failed(inv), tracker.running)
                yield inv
            bar.add(0, False, tracker.running)
    finally:
        bar.close()


def results_in_order(
    invs: list[Invocation], timeout: float, return_exceptions: bool, progress: bool | str
) -> Iterator[Any]:
    """``Calls.results()``: each value in input order, read in batches; ``timeout`` is how long
    it waits for the next one in order."""
    from dreamlake.lakeshore.errors import DispatchError

    tracker = Tracker(invs)
    bar = Progress(len(invs), progress)
    try:
        for inv in invs:
            if inv._outcome is None and str(inv) not in tracker.pending:  # a repeat of an id: read once
                inv._outcome = next(i._outcome for i in invs if str(i) == str(inv) and i._outcome is not None)
            if inv._outcome is None:
                deadline = time.monotonic() + timeout
                while inv._outcome is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"invocation {inv} is still {tracker.states.get(str(inv), 'pending')} after "
                            f"{timeout} s; call results() again with a longer timeout, or check its status()"
                        )
                    for got in tracker.step(min(left, POLL_S)):
                        bar.add(1, failed(got), tracker.running)
                    bar.add(0, False, tracker.running)
            else:
                bar.add(1, failed(inv), tracker.running)
            outcome = inv._outcome
            assert outcome is not None
            try:
                value = _value(inv, outcome)
            except DispatchError as exc:
                if not return_exceptions:
                    raise
                value = exc
            yield value
    finally:
        bar.close()


class Progress:
    """A progress bar of ``total`` calls with done / failed / running counts: tqdm, rich or a line
    of text on stderr (``kind``: True picks the first installed; False shows nothing)."""

    def __init__(self, total: int, kind: bool | str) -> None:
        self.total, self.done, self.failed, self.running = total, 0, 0, 0
        self._bar: Any = None
        self._rich: Any = None
        self._last = 0.0
        self.kind = _pick(kind)
        if self.kind == "tqdm":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, unit="call", desc="calls")
        elif self.kind == "rich":
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress()
            self._rich.start()
            self._bar = self._rich.add_task(self._text(), total=total)

    def _text(self) -> str:
        return f"{self.done}/{self.total} done, {self.failed} failed, {self.running} running"

    def add(self, n: int, failed: bool, running: int) -> None:
        if self.kind is None:
            return
        self.done += n
        self.failed += bool(n) and failed
        self.running = running
        if self.kind == "tqdm":
            self._bar.set_postfix(failed=self.failed, running=self.running, refresh=False)
            if n:
                self._bar.update(n)
        elif self.kind == "rich":
            self._rich.update(self._bar, completed=self.done, description=self._text())
        else:
            now = time.monotonic()
            if now - self._last >= 1.0 or (self.done == self.total and n):
                self._last = now
                sys.stderr.write(f"calls: {self._text()}\n")
                sys.stderr.flush()

    def close(self) -> None:
        if self.kind == "tqdm":
            self._bar.close()
        elif self.kind == "rich":
            self._rich.stop()
        self.kind = None


def _pick(kind: bool | str) -> str | None:
    if kind is False or kind is None:
        return None
    if kind in ("tqdm", "rich", "text"):
        return str(kind)
    if kind is not True:
        raise ValueError(f"progress must be True, False, 'tqdm', 'rich' or 'text', got {kind!r}")
    import importlib.util

    for name in ("tqdm", "rich"):
        if importlib.util.find_spec(name) is not None:
            return name
    return "text"
