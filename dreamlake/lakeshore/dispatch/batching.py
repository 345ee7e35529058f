"""Frames in batches for the in-process worker's planes (``Dispatch``, ``HttpDispatch``).

``Plane.append_frame`` hands a frame to a :class:`FrameWriter`. The first frame of a stream (one
attempt of one invocation, from one worker) is written at once, in the caller's thread, so a
refusal of the stream itself (another worker, a superseded attempt, an unknown invocation) is
raised right there. Later frames are queued and written by one writer thread per plane: every
frame that built up while the previous write was in flight, up to ``max_frames`` / ``max_bytes``
per write (one store transaction on the local plane, one ``result-chunks`` request over HTTP).
Streams take turns, so one stream's backlog never delays another's frames.

Order is checked when a frame is appended, as the journal would: a frame past the next seq, or
after the stream's final frame, raises :class:`~dreamlake.lakeshore.errors.Conflict` at once
(a repeat of a seq goes through: the journal answers it as a duplicate). A write refused later
(the lease lapsed meanwhile) is kept and raised by the next ``append`` or ``flush`` of that
stream; its frames not yet written are dropped with it (they would be refused too).

Flow control: a producer more than ``window`` frames ahead of its writes waits in ``append``
until the writer caught up. ``flush`` waits until every frame of an invocation was written: the
planes flush before an ack, so the ack always follows its frames.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dreamlake.lakeshore.errors import Conflict

log = logging.getLogger(__name__)

Item = tuple[int, bytes, bool]  # seq, encoded frame, final
Key = tuple[str, int, str]  # invocation_id, attempt, worker_id
# (invocation_id, attempt, worker_id, frames); raises to refuse
Write = Callable[[str, int, str, Sequence[Item]], None]

MAX_FRAMES = 1000
MAX_BYTES = 1024 * 1024
WINDOW = 10_000
ORDER_HINT = "send frames in order, each once"


@dataclass
class _Stream:
    next_seq: int  # the seq the stream takes next
    final_seq: int | None = None  # its final frame, once appended
    queue: deque[Item] = field(default_factory=deque)
    writing: int = 0  # frames in the write in flight
    error: BaseException | None = None


class FrameWriter:
    """One writer thread for the frames of every stream of one plane (see the module docstring)."""

    def __init__(
        self, write: Write, *, max_frames: int = MAX_FRAMES, max_bytes: int = MAX_BYTES, window: int = WINDOW
    ) -> None:
        if max_frames < 1 or max_bytes < 1 or window < 1:
            raise ValueError("max_frames, max_bytes and window must be >= 1")
        self._write = write
        self._max_frames = max_frames
        self._max_bytes = max_bytes
        self._window = window
        self._cond = threading.Condition()
        self._streams: OrderedDict[Key, _Stream] = OrderedDict()
        self._closed = False
        self._thread: threading.Thread | None = None

    def append(
        self, invocation_id: str, attempt: int, seq: int, data: bytes, final: bool, *, worker_id: str = ""
    ) -> None:
        """Write or queue one frame of ``attempt`` held by ``worker_id`` (see the module docstring)."""
        key = (invocation_id, attempt, worker_id)
        with self._cond:
            if self._closed:
                raise RuntimeError("the frame writer is closed")
            stream = self._streams.get(key)
            if stream is not None:
                self._check(invocation_id, stream, seq)
                while len(stream.queue) + stream.writing >= self._window and stream.error is None:
                    self._cond.wait()
                if stream.error is not None:
                    raise stream.error
                self._appended(stream, seq, final)
                stream.queue.append((seq, data, final))
                self._cond.notify_all()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="lakeshore-frames", daemon=True)
                    self._thread.start()
                return
        self._write(invocation_id, attempt, worker_id, [(seq, data, final)])  # the first frame, at once
        with self._cond:
            stream = self._streams.setdefault(key, _Stream(next_seq=seq))
            self._appended(stream, seq, final)

    @staticmethod
    def _check(invocation_id: str, stream: _Stream, seq: int) -> None:
        if stream.error is not None:
            raise stream.error
        if stream.final_seq is not None and seq > stream.final_seq:
            raise Conflict(
                f"the stream of {invocation_id} ended with final frame {stream.final_seq}; {ORDER_HINT}", 409
            )
        if seq > stream.next_seq:
            raise Conflict(
                f"frame {seq} of {invocation_id} skips ahead: the next frame is {stream.next_seq}; {ORDER_HINT}",
                409,
            )

    @staticmethod
    def _appended(stream: _Stream, seq: int, final: bool) -> None:
        stream.next_seq = max(stream.next_seq, seq + 1)
        if final and stream.final_seq is None:
            stream.final_seq = seq

    def flush(self, invocation_id: str, timeout: float | None = None) -> None:
        """Wait until every queued frame of ``invocation_id`` was written, then forget its streams;
        raises what refused a write (TimeoutError after ``timeout``)."""
        if not self._streams:  # no stream at all (plain calls): nothing to wait for, no lock to take
            return
        with self._cond:
            streams = [(k, s) for k, s in self._streams.items() if k[0] == invocation_id]
            if not streams:  # nothing of it appended: nothing to wait for
                return
            done = self._cond.wait_for(
                lambda: all(s.error is not None or (not s.queue and not s.writing) for _k, s in streams),
                timeout,
            )
            if not done:
                raise TimeoutError(f"frames of {invocation_id} not written after {timeout} s")
            for key, stream in streams:
                if self._streams.get(key) is stream:
                    del self._streams[key]
            for _key, stream in streams:
                if stream.error is not None:
                    raise stream.error

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _next(self) -> tuple[Key, _Stream, list[Item]] | None:
        """The next batch, streams in turn; None once closed and empty."""
        with self._cond:
            while True:
                for key, stream in self._streams.items():
                    if stream.queue and not stream.writing:
                        batch: list[Item] = []
                        size = 0
                        while stream.queue and len(batch) < self._max_frames:
                            item = stream.queue[0]
                            if batch and size + len(item[1]) > self._max_bytes:
                                break
                            batch.append(stream.queue.popleft())
                            size += len(item[1])
                        stream.writing = len(batch)
                        self._streams.move_to_end(key)  # the others go first next time
                        return key, stream, batch
                if self._closed:
                    return None
                self._cond.wait()

    def _run(self) -> None:
        while (work := self._next()) is not None:
            (invocation_id, attempt, worker_id), stream, batch = work
            error: BaseException | None = None
            try:
                self._write(invocation_id, attempt, worker_id, batch)
            except Exception as exc:
                error = exc
                log.warning("frames %d..%d of %s refused: %s", batch[0][0], batch[-1][0], invocation_id, exc)
            with self._cond:
                stream.writing = 0
                if error is not None:
                    stream.error = error
                    stream.queue.clear()
                self._cond.notify_all()
