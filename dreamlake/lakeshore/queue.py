"""The consumer side of a queue: :class:`SyncQueue` (results, streams, status, cancel) and :class:`Topic`.

Streams are the frame journal read with a cursor. ``since`` is the last seq the consumer saw
(``-1`` replays from the start); a stream resumes in any process, at any time, without loss or
duplication. ``timeout`` is patience for silence, reset by every frame, not a deadline for the
whole stream: ``SyncQueue.stream`` waits 30 s by default, ``Topic.stream`` / ``Topic.listen`` 5 s.

An invocation stream ends for exactly one of three reasons: an END frame, an ERROR frame (raised
here as :class:`DispatchError` with the producer's exception type and message), or a terminal
invocation state with no further frames (raised as :class:`DispatchError` too when that state is
``failed``, ``killed`` or ``timeout``, e.g. a gate refused the function before it could yield).

A requeued invocation (its nymph died, or a failure it retries) never splices two executions: the
new attempt's frames follow a RESTART marker in the journal, which ``next()`` raises as
:class:`StreamRestarted` (the values before it came from the earlier attempt, those after it are
the new attempt's from its first). Catch it and keep iterating the same stream; ``since`` cursors
keep counting across it (docs/protocol.md, "Retries and stream restarts"). The ERROR frame of an
attempt that is retried is not the stream's end and is not raised.

An invocation's output (its stdout and stderr, captured by the worker on every runner) travels in the
same journal as LOG frames: ``SyncQueue.stream`` skips them, ``SyncQueue.logs`` yields them as
:class:`LogChunk` s (text as it was written, chunk by chunk: a chunk holds whole lines where it can),
while the invocation runs (``follow=True``) and after it ended, for as long as the invocation is kept.

``SyncQueue.stream`` and ``Topic.stream`` return a :class:`Stream`, a generator. The stream of a
two-way body (one that uses its ``yield`` expressions, :mod:`dreamlake.lakeshore.twoway`) is two-way
like a local generator: ``next(s)`` primes it, ``s.send(v)`` delivers ``v`` into the paused body (the
value of its ``yield``) and returns the next value, ``s.throw(exc)`` raises ``exc`` at that yield
(the builtin exception of that name; another type as ``RuntimeError``) and ``s.close()`` raises
``GeneratorExit`` there. Each answer is journaled (``send:<id>``, by the yield's index), so a
consumer that resumes from a cursor (``since``) sends into the yield at that cursor, and a repeat
of an answer already delivered is ignored. Other streams are one-way: ``send(None)`` pulls like
``next()``, ``send(value)`` raises ``NotImplementedError``.
"""

from __future__ import annotations

import codecs
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import DispatchError, StreamRestarted

if TYPE_CHECKING:
    from dreamlake.lakeshore.dispatch import Plane
    from dreamlake.lakeshore.envelope import Envelope
    from dreamlake.lakeshore.wire import Frame

__all__ = ["LogChunk", "Stream", "SyncQueue", "Topic", "log_chunks"]

log = logging.getLogger(__name__)

STREAM_TIMEOUT_S = 30.0
TOPIC_TIMEOUT_S = 5.0
RESULT_TIMEOUT_S = 60.0
FAILED_STATES = frozenset({"failed", "killed", "timeout"})
LOGS_SETTLE_S = 0.5  # logs without follow: the journal so far, once this long passed without a frame


@dataclass(frozen=True)
class LogChunk:
    """Output of an invocation as the worker captured it: one LOG frame, decoded as UTF-8.

    ``stream`` is ``"stdout"`` or ``"stderr"``; ``seq`` the frame's seq (resume with
    ``since=chunk.seq``); ``ts`` when the worker read it; ``truncated`` marks the one line that says
    the output passed the worker's cap (``stream_log_max_bytes``) and the rest was not kept."""

    stream: str
    text: str
    seq: int
    ts: float | None = None
    truncated: bool = False

    def __str__(self) -> str:
        return self.text


def log_chunks(
    plane: Plane, inv: str, *, since: int = -1, follow: bool = False, timeout: float | None = None
) -> Iterator[LogChunk]:
    """The LOG frames of invocation ``inv`` after ``since`` as :class:`LogChunk` s.

    Without ``follow``: what is journaled now (the stream is read until it ends or stays silent for
    ``LOGS_SETTLE_S``). With ``follow``: also what comes, until the invocation ends; ``timeout``
    None waits through any silence, a number raises TimeoutError after that many seconds of it.
    A character split between two chunks is decoded whole (one decoder per stream)."""
    from dreamlake.lakeshore import wire

    decoders: dict[str, Any] = {}
    last = since
    while True:
        patience = (timeout if timeout is not None else STREAM_TIMEOUT_S) if follow else LOGS_SETTLE_S
        try:
            for frame in plane.frames(inv, last, patience):
                last = frame.seq
                if frame.kind != wire.FRAME_LOG or not isinstance(frame.body, bytes):
                    continue
                meta = frame.meta if isinstance(frame.meta, dict) else {}
                stream = "stderr" if meta.get("stream") == "stderr" else "stdout"
                decoder = decoders.get(stream)
                if decoder is None:
                    decoder = decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
                text = decoder.decode(frame.body)
                ts = meta.get("ts")
                yield LogChunk(stream, text, frame.seq, float(ts) if isinstance(ts, (int, float)) else None,
                               bool(meta.get("truncated")))  # fmt: skip
            return  # the stream ended (END, ERROR, or a terminal state with no more frames)
        except TimeoutError:
            if not follow or timeout is not None:
                if follow:
                    raise
                return


class _Paused:
    """A value of a two-way body, with the index of the yield it paused at (``meta.send``)."""

    __slots__ = ("index", "value")

    def __init__(self, value: Any, index: int) -> None:
        self.value, self.index = value, index


def send_index(frame: Frame) -> int | None:
    """The yield index a two-way body's VALUE frame waits at (``meta.send``); None otherwise."""
    index = frame.meta.get("send") if isinstance(frame.meta, dict) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else None


class _Restart:
    """A RESTART marker, yielded by :func:`_values` for :class:`Stream` to raise (the generator
    behind the stream stays alive, so the consumer can keep iterating)."""

    __slots__ = ("attempt", "seq")

    def __init__(self, attempt: int, seq: int) -> None:
        self.attempt, self.seq = attempt, seq


def restart_of(frame: Frame) -> int | None:
    """The attempt a RESTART marker announces (a LOG frame with ``meta.restart``); None otherwise."""
    from dreamlake.lakeshore import wire

    if frame.kind != wire.FRAME_LOG or not isinstance(frame.meta, dict):
        return None
    attempt = frame.meta.get("restart")
    return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None


def _values(frames: Iterator[Frame], what: str) -> Generator[Any, None, bool]:
    """Unpack VALUE bodies; stop at END; raise DispatchError at ERROR; a RESTART marker as a
    :class:`_Restart`. Other LOG frames are skipped.

    Returns True when the stream closed with a final frame, False when the frames simply ran out."""
    from dreamlake.lakeshore import wire

    for frame in frames:
        restart = restart_of(frame)
        if restart is not None:
            yield _Restart(restart, frame.seq)
        elif frame.kind == wire.FRAME_VALUE and isinstance(frame.body, bytes):
            index = send_index(frame)
            yield wire.unpack(frame.body) if index is None else _Paused(wire.unpack(frame.body), index)
        elif frame.kind == wire.FRAME_END:
            return True
        elif frame.kind == wire.FRAME_ERROR:
            body = frame.body if isinstance(frame.body, dict) else {"message": repr(frame.body)}
            raise DispatchError.from_info(body)
        else:
            log.debug("%s: skipping frame kind %s at seq %s", what, frame.kind, frame.seq)
    return False


class _Cursor(Iterator["Frame"]):
    """A stream's frames, remembering the seq of the last one read: the stream's cursor."""

    __slots__ = ("_frames", "seq")

    def __init__(self, frames: Iterator[Frame], since: int) -> None:
        self._frames = frames
        self.seq = since

    def __next__(self) -> Frame:
        frame = next(self._frames)
        self.seq = frame.seq
        return frame


Sender = Callable[[int, str, Any], Any]  # (yield index, kind, body): Plane.send of one invocation


class Stream(Generator[Any, Any, None]):
    """The values of an invocation or topic stream, pulled with ``next()`` / ``for``.

    Two-way for a two-way body (see the module docstring): ``send``, ``throw`` and ``close`` reach
    the paused remote body. One-way otherwise: ``send(None)`` is ``next()``, ``send(value)`` raises
    ``NotImplementedError`` and the stream stays where it was. ``close()`` stops following it.
    """

    __slots__ = ("_at", "_gen", "_paused", "_pulled", "_resume", "_sender", "_what")

    def __init__(
        self,
        gen: Generator[Any, None, Any],
        what: str,
        sender: Sender | None = None,
        resume: Callable[[], int | None] | None = None,
        at: _Cursor | None = None,
    ) -> None:
        self._gen = gen
        self._at = at
        self._what = what
        self._sender = sender
        self._resume = resume  # the yield index at the cursor the stream resumed from, if any
        self._paused: int | None = None  # the yield index the body waits at for our answer
        self._pulled = resume is not None  # a value was pulled (or the stream resumed mid-way)

    def __iter__(self) -> Stream:
        return self

    @property
    def cursor(self) -> int:
        """The seq of the last frame this stream read (its ``since`` when none yet): resume with
        ``stream(inv, since=cursor)``, in any process."""
        return -1 if self._at is None else self._at.seq

    def __next__(self) -> Any:
        if self._pause_point():  # next() is send(None): the body waits for an answer first
            self._answer("value", _packed(None))
        return self._surface(next(self._gen))

    def _surface(self, value: Any) -> Any:
        if isinstance(value, _Restart):
            raise StreamRestarted(self._what.removeprefix("invocation "), value.attempt, value.seq)
        self._pulled = True
        if isinstance(value, _Paused):
            self._paused = value.index
            return value.value
        return value

    def _answer(self, kind: str, body: Any) -> None:
        index = self._paused
        assert index is not None and self._sender is not None
        self._sender(index, kind, body)  # refused (a 409, the plane away): the body still waits there
        self._paused = None

    def _pause_point(self) -> bool:
        """Whether the body waits for our answer (at the value last pulled, or, for a stream that
        resumed from a cursor and pulled nothing yet, at the yield at that cursor)."""
        if self._paused is None and self._resume is not None:
            resume, self._resume = self._resume, None
            self._paused = resume()
        return self._paused is not None

    def send(self, value: Any) -> Any:
        if value is None:
            return next(self)
        if self._sender is None or not self._pause_point():
            if self._sender is not None and not self._pulled:
                raise TypeError(
                    f"can't send a value into {self._what} before it yielded one: prime it with "
                    "next() first (that runs the body to its first yield), as with a local generator"
                )
            raise NotImplementedError(
                f"the stream of {self._what} is one-way: its body does not read what is sent (a "
                "generator that uses its yields, `x = yield v`, is two-way; or declare "
                "@dls.udf(two_way=True)). Use next() or send(None) to pull, or send values back "
                "over a Topic: topic.post(value) here, Topic(name).stream() in the body"
            )
        self._answer("value", _packed(value))
        return self._surface(next(self._gen))

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._sender is not None and self._pause_point():
            exc = typ if isinstance(typ, BaseException) else (val if isinstance(val, BaseException) else None)
            if exc is None:
                exc = typ() if val is None else typ(val)
            self._answer("throw", {"type": type(exc).__name__, "message": str(exc)})
            return self._surface(next(self._gen))
        if val is None and tb is None:
            return self._gen.throw(typ)
        return self._gen.throw(typ, val, tb)

    def close(self) -> None:
        if self._sender is not None and self._paused is not None:
            self._answer("close", None)
        self._gen.close()

    def __repr__(self) -> str:
        return f"<lakeshore Stream of {self._what}>"


def _packed(value: Any) -> bytes:
    from dreamlake.lakeshore import wire

    return wire.pack(value)


def _check_since(since: object) -> int:
    if isinstance(since, bool) or not isinstance(since, int) or since < -1:
        raise ValueError(f"since must be the last seq seen (an int >= -1; -1 replays all), got {since!r}")
    return since


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class SyncQueue:
    """A named queue on a dispatch plane, from the consumer's side."""

    def __init__(self, name: str, dispatch: Plane | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"queue name must be a non-empty str like 'render', got {name!r}")
        self.name = name
        self._dispatch = dispatch

    @property
    def dispatch(self) -> Plane:
        """The plane given to the queue, else the process default (``dls.set_default_dispatch``)."""
        if self._dispatch is not None:
            return self._dispatch
        from dreamlake.lakeshore.default_dispatch import get_default_dispatch

        return get_default_dispatch()

    def stream(self, inv: str, since: int = -1, timeout: float = STREAM_TIMEOUT_S) -> Stream:
        """The values an invocation yields, with ``seq > since``: replay, then follow live."""
        inv = ids.validate(inv, "invocation id")
        plane = self.dispatch
        since = _check_since(since)
        frames = _Cursor(plane.frames(inv, since, _check_timeout(timeout)), since)

        def sender(index: int, kind: str, body: Any) -> None:
            plane.send(inv, index, kind, body)

        def resume() -> int | None:  # the yield at the cursor: its frame is the one at ``since``
            frames = plane.frames(inv, since - 1, _check_timeout(timeout))
            try:
                at = next(iter(frames), None)
            finally:
                getattr(frames, "close", lambda: None)()
            return None if at is None or at.seq != since else send_index(at)

        resumed = resume if since >= 0 else None
        return Stream(self._follow(inv, frames), f"invocation {inv}", sender, resumed, frames)

    def _follow(self, inv: str, frames: Iterator[Frame]) -> Generator[Any, None, None]:
        closed = yield from _values(frames, f"invocation {inv}")
        if not closed:
            # no END/ERROR: the invocation reached a terminal state without one (cancelled before
            # it ran, refused by a gate, lease lost). A failure still reaches the consumer.
            record = self.dispatch.status(inv)
            if record.get("state") in FAILED_STATES:
                raise DispatchError.from_info(
                    record.get("error")
                    or {"type": str(record["state"]), "message": f"invocation {inv} failed"}
                )

    def frames(self, inv: str, since: int = -1, timeout: float = STREAM_TIMEOUT_S) -> Iterator[Frame]:
        """The raw decoded frames (kind, seq, body, meta): for a consumer that keeps its own cursor."""
        inv = ids.validate(inv, "invocation id")
        return self.dispatch.frames(inv, _check_since(since), _check_timeout(timeout))

    def logs(
        self, inv: str, follow: bool = False, since: int = -1, timeout: float | None = None
    ) -> Iterator[LogChunk]:
        """The invocation's stdout and stderr as :class:`LogChunk` s (``print(c.text, end="")``):
        what it wrote so far, and with ``follow`` what it writes until it ends (``timeout``: None
        waits through any silence; seconds of silence before TimeoutError). Readable while it runs
        and after it ended; the worker keeps at most ``stream_log_max_bytes`` of it per attempt."""
        inv = ids.validate(inv, "invocation id")
        if timeout is not None:
            _check_timeout(timeout)
        return log_chunks(self.dispatch, inv, since=_check_since(since), follow=follow, timeout=timeout)

    def result(self, inv: str, timeout: float = RESULT_TIMEOUT_S) -> Any:
        """The return value; DispatchError when the invocation failed; TimeoutError when pending."""
        inv = ids.validate(inv, "invocation id")
        deadline = time.monotonic() + _check_timeout(timeout)
        return self._settle(inv, None, deadline, timeout)

    def call(self, envelope: Envelope, run_config: dict[str, Any], parent: str | None, timeout: float) -> Any:
        """Submit ``envelope`` to this queue and wait for its value (``Thunk.call``): one request
        on a plane that submits and waits at once (the HTTP plane's ``submit_and_wait``), else a
        submit, then ``result``."""
        deadline = time.monotonic() + _check_timeout(timeout)
        inv, out = self.dispatch.submit_and_wait(envelope, self.name, run_config, parent, timeout)
        return self._settle(inv, out, deadline, timeout)

    def _settle(self, inv: str, out: dict[str, Any] | None, deadline: float, timeout: float) -> Any:
        """The value of ``inv`` from the await answer ``out`` (None: await first), awaiting again
        until ``deadline`` while it is pending."""
        from dreamlake.lakeshore import wire

        while True:
            if out is None:
                out = self.dispatch.await_result(inv, max(deadline - time.monotonic(), 0.0))
            state = out.get("state")
            if state == "succeeded":
                blob = out.get("result_blob")
                return wire.unpack(blob, limits=wire.limits_for(blob)) if blob else None
            if state not in (None, "pending", "queued", "running"):
                error = out.get("error") or {
                    "type": str(state).capitalize(),
                    "message": f"invocation {state}",
                }
                raise DispatchError.from_info(error)
            if time.monotonic() >= deadline:
                hint = f"; {out['warning']}" if out.get("warning") else ""
                raise TimeoutError(
                    f"invocation {inv} is still {state or 'pending'} after {timeout} s; "
                    f"call result() again with a longer timeout, or check status(){hint}"
                )
            out = None

    def status(self, inv: str) -> dict[str, Any]:
        """The invocation's record: state, queue, priority, attempt, times, error, and (over HTTP)
        ``children``: ``[{invocation_id, state}]`` of the tasks it submitted."""
        return self.dispatch.status(ids.validate(inv, "invocation id"))

    def cancel(self, inv: str, descendants: bool = True) -> str:
        """Cancel the invocation, and with ``descendants`` (the default) the tasks it submitted and
        theirs, wherever they run; returns the invocation's state after the call."""
        return self.dispatch.cancel(ids.validate(inv, "invocation id"), descendants=descendants)

    def topic(self, name: str | None = None) -> Topic:
        """A topic on this queue's plane; ``name`` defaults to a fresh ``topic-<ULID>``."""
        return Topic(name if name is not None else f"topic-{ids.new_ulid()}", dispatch=self._dispatch)

    def __repr__(self) -> str:
        return f"<SyncQueue {self.name!r}>"


class Topic:
    """A named journal not tied to any invocation: post values, stream or listen with a cursor."""

    def __init__(self, name: str, dispatch: Plane | None = None) -> None:
        import re

        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", name):
            raise ValueError(
                f"invalid topic name {name!r}: use 1-128 characters of letters, digits, '.', '_' or '-'"
            )
        self.name = name
        self._dispatch = dispatch

    @property
    def dispatch(self) -> Plane:
        if self._dispatch is not None:
            return self._dispatch
        from dreamlake.lakeshore.default_dispatch import get_default_dispatch

        return get_default_dispatch()

    def post(self, value: Any, final: bool = False) -> int:
        """Append ``value`` (an END frame closing the topic when ``final``); returns its seq."""
        from dreamlake.lakeshore import wire

        return self.dispatch.topic_post(self.name, wire.pack(value), final=final)

    def stream(self, since: int = -1, timeout: float = TOPIC_TIMEOUT_S) -> Stream:
        """Values with ``seq > since`` until END; TimeoutError after ``timeout`` s of silence."""
        frames = self.dispatch.frames(self.name, _check_since(since), _check_timeout(timeout), topic=True)
        at = _Cursor(frames, since)
        return Stream(_values(at, f"topic {self.name}"), f"topic {self.name}", at=at)

    def listen(self, since: int = -1, timeout: float = TOPIC_TIMEOUT_S) -> Any:
        """The next value after ``since``, or None on timeout (or when the topic ended)."""
        frames = self.dispatch.frames(self.name, _check_since(since), _check_timeout(timeout), topic=True)
        try:
            for value in _values(frames, f"topic {self.name}"):
                return value
        except TimeoutError:
            return None
        finally:
            close = getattr(frames, "close", None)
            if close is not None:
                close()
        return None

    def __repr__(self) -> str:
        return f"<Topic {self.name!r}>"
