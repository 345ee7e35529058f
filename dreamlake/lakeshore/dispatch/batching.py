"""Frames in batches for the in-process worker's planes (``Dispatch``, ``HttpDispatch``).

``Plane.append_frame`` hands a frame to a :class:`FrameWriter` and returns: one writer thread per
plane writes each invocation's frames in order, the first at once and then every frame that built
up while the previous write was in flight, up to ``max_frames`` / ``max_bytes`` per write (one
store transaction on the local plane, one ``result-chunks`` request over HTTP). Invocations take
turns, so one stream's backlog never delays another's frames.

Flow control: a producer more than ``window`` frames ahead of its writes waits in
``append`` until the writer caught up. A refused write (a superseded attempt, an out-of-order
frame) is kept and raised by the next ``append`` or ``flush`` of that invocation; its frames not
yet written are dropped with it (they would be refused too). ``flush`` waits until every frame of
an invocation was written: the planes flush before an ack, so the ack always follows its frames.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Item = tuple[int, bytes, bool]  # seq, encoded frame, final
Write = Callable[[str, int, Sequence[Item]], None]  # (invocation_id, attempt, frames); raises to refuse

MAX_FRAMES = 1000
MAX_BYTES = 1024 * 1024
WINDOW = 10_000


@dataclass
class _Stream:
    attempt: int
    queue: deque[Item] = field(default_factory=deque)
    writing: int = 0  # frames in the write in flight
    error: BaseException | None = None


class FrameWriter:
    """One writer thread for the frames of every invocation of one plane (see the module docstring)."""

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
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._closed = False
        self._thread: threading.Thread | None = None

    def append(self, invocation_id: str, attempt: int, seq: int, data: bytes, final: bool) -> None:
        """Queue one frame; waits while the invocation is ``window`` frames ahead of its writes.
        Raises what refused an earlier write of this invocation."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the frame writer is closed")
            stream = self._streams.get(invocation_id)
            if stream is None or stream.attempt != attempt:
                stream = self._streams[invocation_id] = _Stream(attempt)
            self._raise(invocation_id, stream)
            while len(stream.queue) + stream.writing >= self._window and stream.error is None:
                self._cond.wait()
            self._raise(invocation_id, stream)
            stream.queue.append((seq, data, final))
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lakeshore-frames", daemon=True)
                self._thread.start()

    def flush(self, invocation_id: str, timeout: float | None = None) -> None:
        """Wait until every queued frame of ``invocation_id`` was written, then forget it; raises
        what refused a write (TimeoutError after ``timeout``)."""
        with self._cond:
            stream = self._streams.get(invocation_id)
            if stream is None:
                return
            done = self._cond.wait_for(
                lambda: stream.error is not None or (not stream.queue and not stream.writing), timeout
            )
            if not done:
                raise TimeoutError(f"frames of {invocation_id} not written after {timeout} s")
            if self._streams.get(invocation_id) is stream:
                del self._streams[invocation_id]
            if stream.error is not None:
                raise stream.error

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @staticmethod
    def _raise(invocation_id: str, stream: _Stream) -> None:
        if stream.error is not None:
            raise stream.error

    def _next(self) -> tuple[str, _Stream, list[Item]] | None:
        """The next batch, invocations in turn; None once closed and empty."""
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
            invocation_id, stream, batch = work
            error: BaseException | None = None
            try:
                self._write(invocation_id, stream.attempt, batch)
            except Exception as exc:
                error = exc
                log.warning("frames %d..%d of %s refused: %s", batch[0][0], batch[-1][0], invocation_id, exc)
            with self._cond:
                stream.writing = 0
                if error is not None:
                    stream.error = error
                    stream.queue.clear()
                self._cond.notify_all()
