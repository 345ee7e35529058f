"""The entry's streams: a generator's values journaled as frames, with backpressure and sends.

A generator result gets ``frames.msgpack``: one VALUE frame per yield, appended (one ``os.write``
each, so a tail sees them at once) and then END (body ``wire.pack(return value)``) or ERROR; the
journal is fsynced after its last frame, before the result or error names the end
(:func:`_journaled`). An ``async def`` body runs through :func:`settled`.

Backpressure: with ``LAKESHORE_STREAM_WINDOW=<frames>:<bytes>`` set (nymph sets it), the generator
is paused at its next ``yield`` while that many of its frames (or bytes) are not yet delivered. The
delivered position is the file ``frames.delivered`` (``"<seq> <offset>"``, written by nymph), read
again with a short sleep (1 ms, doubling to 20 ms) until the window drains. Without the variable
(or with a malformed one) the generator is never paused.

Two-way: with ``LAKESHORE_SENDS`` (:mod:`dreamlake.lakeshore.twoway`) a generator's yields wait
for the answers nymph appends to ``sends.msgpack`` (:class:`_Sends`); its VALUE frames carry
``meta.send``, the yield's index.

Part of the entry bundle, like :mod:`dreamlake.lakeshore.daemon.entry`: importable on Python
3.9, no ``typing`` at runtime.
"""

from __future__ import annotations

import os
import time

from dreamlake.lakeshore import envvars, wire
from dreamlake.lakeshore.daemon.entry_outputs import (
    EXIT_OK,
    EXIT_RAISED,
    _fail,
    _write_all,
    _write_result,
    error_info,
)
from dreamlake.lakeshore.errors import Interrupted

TYPE_CHECKING = False  # no typing at runtime: start-up is what a noop invocation costs
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterator

    from dreamlake.lakeshore.daemon.entry_interrupts import _Interrupts

FRAMES_FILE = "frames.msgpack"
DELIVERED_FILE = "frames.delivered"
WINDOW_ENV = "LAKESHORE_STREAM_WINDOW"
SENDS_FILE = "sends.msgpack"  # twoway.SENDS_FILE (not imported before a two-way body runs)
SENDS_ENV = "LAKESHORE_SENDS"  # twoway.SENDS_ENV
_PAUSE_MIN_S = 0.001
_PAUSE_MAX_S = 0.02
_CO_GENERATOR = 0x20


def _window() -> tuple[int, int] | None:
    """``(frames, bytes)`` of ``LAKESHORE_STREAM_WINDOW``; None: never pause."""
    raw = envvars.string(WINDOW_ENV) or ""
    frames, _, nbytes = raw.partition(":")
    try:
        window = int(frames), int(nbytes)
    except ValueError:
        return None
    return window if window[0] > 0 and window[1] > 0 else None


class _Journal:
    """``frames.msgpack``: frames appended with one ``os.write`` each, so a tail sees them at once."""

    def __init__(self, path: str, window: tuple[int, int] | None = None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.seq = 0
        self.offset = 0  # bytes written
        self._window = window
        self._delivered = (-1, 0)  # the last (seq, offset) nymph said it delivered

    def append(self, kind: int, body: Any, send: int | None = None) -> None:
        meta: Dict[str, Any] = {"ts": time.time()}
        if send is not None:  # a two-way body's yield: the index its answer is sent to
            meta["send"] = send
        frame = wire.encode_frame(kind, self.seq, body, meta)
        _write_all(self._fd, frame)
        self.seq += 1
        self.offset += len(frame)

    def _over(self, window: tuple[int, int]) -> bool:
        frames, nbytes = window
        seq, offset = self._delivered
        return self.seq - 1 - seq >= frames or self.offset - offset >= nbytes

    def wait_window(self) -> None:
        """Block while the undelivered frames fill the window (see the module docstring)."""
        window = self._window
        if window is None or not self._over(window):
            return
        pause = _PAUSE_MIN_S
        while True:
            self._delivered = _read_delivered(self._delivered)
            if not self._over(window):
                return
            time.sleep(pause)
            pause = min(pause * 2, _PAUSE_MAX_S)

    def close(self, sync: bool = False) -> None:
        """Close the journal; ``sync``: its last frame (END or ERROR) is on disk first."""
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)


def _read_delivered(known: tuple[int, int]) -> tuple[int, int]:
    try:
        with open(DELIVERED_FILE, "rb") as f:
            seq, offset = f.read(64).split()
        return max(known, (int(seq), int(offset)))
    except (OSError, ValueError):
        return known


def settled(result: Any) -> Any:
    """What an ``async def`` body's call comes to: a coroutine run to completion (``asyncio.run``:
    its value, or its exception raised), an async generator as a generator that streams its
    values (on one event loop of its own); anything else as it is. The entry and the SDK's worker
    both run bodies through this, so an async body runs on every runner."""
    import types

    if isinstance(result, types.CoroutineType):
        import asyncio

        return asyncio.run(result)
    if isinstance(result, types.AsyncGeneratorType):
        return _sync_stream(result)
    return result


def _sync_stream(agen: Any) -> Iterator[Any]:
    """The values of async generator ``agen``, pulled one by one on an event loop of their own;
    closing this generator closes ``agen`` (its ``finally`` blocks run)."""
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                value = loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
            yield value
    finally:
        try:
            loop.run_until_complete(agen.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _is_stream(fn: Callable[..., Any], result: Any) -> bool:
    import types
    from collections.abc import Iterator

    if isinstance(result, types.GeneratorType):
        return True
    flags = getattr(getattr(fn, "__code__", None), "co_flags", 0)
    return bool(flags & _CO_GENERATOR) and isinstance(result, Iterator)


def _journaled(
    journal: _Journal,
    body: Callable[[], bytes],
    interrupts: _Interrupts | None,
    settle: Callable[[BaseException], BaseException] | None = None,
) -> int:
    """Run ``body`` (it journals a generator's values and returns its packed return value), then
    END; on a raise, ERROR frame + error.json (``settle`` may turn the exception first). The journal
    is synced before result.msgpack names the call done. Returns the exit code."""
    ended = False
    try:
        try:
            returned = body()
            if interrupts is not None:
                interrupts.close()
        except BaseException as exc:
            if interrupts is not None:
                interrupts.close()
            info = error_info(exc if settle is None else settle(exc))
            journal.append(wire.FRAME_ERROR, info)
            ended = True
            journal.close(sync=True)
            return _fail(info, EXIT_RAISED)
        journal.append(wire.FRAME_END, returned)
        ended = True
        journal.close(sync=True)  # the END frame on disk before result.msgpack names it done
    finally:
        if not ended:
            journal.close()
    _write_result(returned)
    return EXIT_OK


def _drain(stream: Iterator[Any], interrupts: _Interrupts | None = None) -> int:
    """Journal every yield, then END; on a raise, ERROR frame + error.json. Returns the exit code.
    An Interrupted that arrives while the generator is paused at its yield is thrown in there."""
    journal = _Journal(FRAMES_FILE, _window())
    inside = False

    def body() -> bytes:
        nonlocal inside
        while True:
            try:
                inside = True
                value = next(stream)
                inside = False
            except StopIteration as stop:
                inside = False
                return wire.pack(stop.value)
            journal.append(wire.FRAME_VALUE, wire.pack(value))
            journal.wait_window()  # the generator stays paused at its yield meanwhile

    def settle(exc: BaseException) -> BaseException:
        if isinstance(exc, Interrupted) and not inside and hasattr(stream, "throw"):
            try:  # at its current yield: its finally and with blocks run
                stream.throw(exc)
            except BaseException as thrown:
                return thrown
        return exc

    return _journaled(journal, body, interrupts, settle)


class _Sends:
    """``sends.msgpack``: the answers to a two-way body's yields (one frame each, its seq the
    yield's index), appended by nymph; read on from where the last read stopped, through one fd
    kept open once the file exists. A wait looks again every 0.2 ms for its first 50 ms (a consumer
    in a loop answers within a few ms), then every 1 ms, after a second every 5 ms and after two
    every 50 ms (a person at a notebook costs nothing)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._reader = wire.FrameReader()
        self._frames: Dict[int, wire.Frame] = {}

    def _read(self) -> None:
        if self._fd is None:
            try:
                self._fd = os.open(SENDS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return  # nothing sent yet
        while True:
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                return
            for frame in self._reader.feed(chunk):
                self._frames[frame.seq] = frame

    def wait(self, index: int, timeout_s: float) -> wire.Frame | None:
        start = time.monotonic()
        while True:
            self._read()
            if index in self._frames:
                return self._frames.pop(index)
            waited = time.monotonic() - start
            if waited >= timeout_s:
                return None
            pause = 0.0002 if waited < 0.05 else 0.001 if waited < 1.0 else 0.005 if waited < 2.0 else 0.05
            time.sleep(min(pause, timeout_s - waited))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _drain_two_way(gen: Any, timeout_s: float, interrupts: _Interrupts | None = None) -> int:
    """:func:`_drain` for a two-way body: each yield's VALUE frame names its index (``meta.send``),
    and the body waits there for the answer nymph puts in ``sends.msgpack`` (twoway.py). An
    Interrupted that arrives while it waits is raised at that yield (twoway.drive)."""
    from dreamlake.lakeshore import twoway

    journal = _Journal(FRAMES_FILE)
    sends = _Sends()

    def emit(value: Any, index: int) -> None:
        journal.append(wire.FRAME_VALUE, wire.pack(value), send=index)

    try:
        return _journaled(
            journal,
            lambda: wire.pack(twoway.drive(gen, emit, lambda index: sends.wait(index, timeout_s), timeout_s)),
            interrupts,
        )
    finally:
        sends.close()


def _sends_timeout() -> float | None:
    """The seconds a two-way body waits at a yield (``LAKESHORE_SENDS``); None: not two-way."""
    value = envvars.number(SENDS_ENV, default=0.0)
    return value if value > 0 else None
