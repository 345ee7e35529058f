"""The stream pump: an invocation's frames leave its workdir for the control plane, in batches,
with flow control back to the task.

A :class:`Pump` is the frame source of one invocation's lane in the outbox (:mod:`nymph.outbox`).
It turns new bytes of ``stdout.log`` / ``stderr.log`` (every invocation's output: the runner or
the entry appends fd 1/2 there, see :func:`dreamlake.lakeshore.daemon.entry.capture_output`) into
LOG frames (kind 4, meta ``{"stream": ..., "ts": ...}``), and for a Python invocation it reads the
entry's journal (``frames.msgpack``) from where delivery stopped.

One stream, one seq space. The control plane journals an invocation's frames under consecutive
seqs, so the pump numbers what it sends: LOG frames take the next seqs as they are read, and each
journal frame is renumbered (its header rewritten, the rest of its bytes kept) to follow them; the
entry's own seqs stay the journal's (``frames.delivered`` speaks of those). The order between the
two is the order the pump reads them (a batch takes the output written so far, then the journal),
not the exact order the task wrote them. The journal's final frame (END or ERROR) is held until the
task ended and its output was read, so no LOG frame comes after it. While journal frames wait, the
output takes at most half a batch: a flood of prints never starves the values.

Output is bounded: a task's output past ``log_max_bytes`` (per attempt) is not sent. When the cap is
hit, one last LOG frame on ``stderr`` (meta ``truncated: true``) says so, and the rest is skipped
while the task runs on. The cap counts bytes taken, so the output never counts toward
``max_bytes`` beyond it. Output already taken (or skipped) is punched out of the log files (but
their last 64 KiB), so a task that prints without end does not fill nymph's disk either.

The outbox's sender asks the pump for a batch (:meth:`Pump.take`: every complete frame that built
up since the last request, up to ``batch_frames`` / ``batch_bytes``; the first frame goes alone, at
once) and posts it; the same batch is taken again until the control plane confirmed it
(:meth:`Pump.confirm`). The journal (read through :class:`nymph.journal.Journal`) is the durable
copy, never copied to the outbox; the cursor, watermark and hole punching are :mod:`nymph.flow`'s.
Undelivered journal bytes beyond ``max_bytes`` (a task that ignores the window) call
``on_overflow`` once: the job stops the task and fails it with ``StreamOverflow``; no frame is
dropped silently. Output never does that: past its cap it is cut with a line that says so. Every
file of the workdir (the task's) is opened through :mod:`nymph.safeio`.

New frames are noticed without polling: the outbox's :class:`nymph.watcher.Watcher` wakes it on
each write in a watched workdir.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import LakeshoreError
from dreamlake.lakeshore.protocol.limits import by_reference
from nymph import observability as obs
from nymph import safeio
from nymph.flow import StreamLimits, load_state, release_logs, save_state, write_watermark
from nymph.journal import Journal, renumbered
from nymph.workdir import FRAMES, STDERR, STDOUT

if TYPE_CHECKING:
    from nymph.watcher import Watcher

log = logging.getLogger(__name__)

_LOG_READ = 64 * 1024
PARTIAL_HOLD_S = 0.1  # a line without its newline yet waits this long (after the last write) for it


@dataclass
class Batch:
    """Frames to post together; ``end`` is where delivery stands once they are confirmed."""

    frames: list[bytes]
    first_seq: int
    last_seq: int
    final: bool
    end: dict[str, int] = field(default_factory=dict)  # file -> offset just past the batch
    journal_seq: int | None = None  # the entry's seq of the batch's last journal frame
    log_bytes: int = 0  # output bytes taken into the batch (toward log_max_bytes)
    truncated: bool = False  # the batch carries the "output truncated" line
    log_frames: int = 0  # how many of the frames are LOG frames read from the output (they come first)

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


class Outlet(Protocol):
    """What a pump needs of the sender that delivers its frames (:class:`nymph.outbox.Outbox`),
    declared here so that the pump does not import the outbox (which imports the pump)."""

    watcher: Watcher

    def open_stream(self, pump: Pump, *, wake: bool = True) -> None: ...

    def close_stream(self, pump: Pump) -> None: ...

    def wake(self) -> None: ...

    def note_undelivered(self, nbytes: int) -> None: ...


# --- the pump ---------------------------------------------------------------------------------------


class Pump:
    """The frame source of one invocation (see the module docstring). Thread-safe."""

    def __init__(
        self,
        workdir: Path,
        invocation_id: str,
        attempt: int,
        outbox: Outlet,
        *,
        worker_id: str = "",
        script: bool = False,
        limits: StreamLimits | None = None,
        on_overflow: Callable[[str], None] | None = None,
        ship: Callable[[int, bytes], dict[str, Any]] | None = None,
        inline_threshold: int | None = None,
        fresh: bool = False,
    ) -> None:
        """``fresh``: the workdir was made in this life of nymph's, so no stream state of an
        earlier life (``pump.json``) can be there to resume from (it is not looked for)."""
        self.workdir = workdir
        # the paths whose size the pump asks for on every wake-up, as strings once (not pathlib each time)
        self._paths = {name: os.path.join(os.fspath(workdir), name) for name in (FRAMES, STDOUT, STDERR)}
        # frames whose body is over the control plane's inline threshold: the body is uploaded
        # (``ship(seq, body) -> ref``) and the frame sent with the body ``{"ref": ref}``
        self._ship = ship
        self._threshold = inline_threshold
        self._spilling = False
        self.invocation_id = invocation_id
        self.attempt = attempt
        self.worker_id = worker_id
        self.limits = limits or StreamLimits()
        self._outbox = outbox
        self._script = script
        self._on_overflow = on_overflow
        self._lock = threading.Condition()
        state = {} if fresh else load_state(workdir)
        self.delivered_seq: int = int(state.get("sent_seq", -1))  # last seq the control plane confirmed
        self._log_bytes: int = int(state.get("log_bytes", 0))  # output sent, toward log_max_bytes
        self._truncated: bool = bool(state.get("truncated", False))  # the cap was hit, said so
        self.final_sent: bool = bool(state.get("final", False))
        self._offsets: dict[str, int] = {  # delivered up to here, per file
            FRAMES: int(state.get(FRAMES, 0)),
            STDOUT: int(state.get(STDOUT, 0)),
            STDERR: int(state.get(STDERR, 0)),
        }
        # the journal's index of the frames read and not yet confirmed; the entry's seq of the last
        # journal frame confirmed (a state from before LOG frames of Python invocations: the two
        # seq spaces were one)
        journal_seq = int(state.get("journal_seq", self.delivered_seq))
        self._journal = Journal(
            workdir, invocation_id, self._offsets[FRAMES], journal_seq,
            max_bytes=self.limits.max_bytes, final_seen=self.final_sent,
        )  # fmt: skip
        self._log_punched: dict[str, int] = {}  # output released (punched out) up to here, per file
        self._log_punch_ok = True
        # lifecycle
        self._inflight: Batch | None = None
        self._ended = False  # the task ended: nothing more will be written
        self._tail: tuple[int, bytes | dict[str, Any]] | None = None  # a final frame nymph adds
        self.refused: str | None = None  # the control plane refused the stream (409/404)
        self._halted = False
        self._overflowed = False
        self._full_since: float | None = None  # the window was full since then (the task paused)
        self._watch: Any = None

    # --- lifecycle (the job's side) ---------------------------------------------------------------

    def start(self) -> None:
        """Join the outbox: its sender takes batches from here; the watcher wakes it on writes.

        The watermark is written again only for a stream that delivered something (a restarted
        nymph's): with no file the entry counts nothing delivered, which a fresh stream's is."""
        if not self._script and (self.delivered_seq >= 0 or self._offsets[FRAMES] > 0):
            self._write_watermark()
        self._watch = self._outbox.watcher.add(self.workdir, self._on_write, names=(FRAMES, STDOUT, STDERR))
        # the sender is woken only when there is something to send: a write from now on is heard by
        # the watcher; what the task wrote before the watch (it started first) is seen here
        self._outbox.open_stream(self, wake=self.has_frames)

    def _on_write(self) -> None:
        """The watcher saw a write (or ticked): account the window, then wake the sender."""
        with self._lock:
            if not self._halted:
                self._check_window()
                if self._truncated:  # past the cap the output is skipped: keep its disk use bounded
                    self._release_logs()
        self._outbox.wake()

    def stop(self) -> None:
        """The task ended: what is in the files now is all there will be (the sender is woken
        when some of it is still to be sent; a stream with nothing left ends with its drain)."""
        with self._lock:
            self._ended = True
            done = self.done
        if not done:
            self._outbox.wake()

    def finish(self, kind: int, body: bytes | dict[str, Any]) -> None:
        """Close the stream with END or ERROR after the journal, unless it holds a final frame.

        The stream goes (back) on its lane: after :meth:`stop` a stream with nothing left looks
        done, and a pass of the sender in between lets go of it; its final frame must not then
        wait for a spill."""
        with self._lock:
            self._ended = True
            tail = not self.final_sent and not self._halted and self.refused is None
            if not self.final_sent:
                self._tail = (kind, body)
        if tail:
            self._outbox.open_stream(self)
        else:
            self._outbox.wake()

    def halt(self) -> None:
        """Stop delivering (the job failed, was lost, or shuts down): the rest is left on disk."""
        with self._lock:
            if self._halted:
                return
            self._halted = True
            self._lock.notify_all()
        self._detach()

    def drain(
        self,
        stop: Callable[[], bool],
        *,
        patience_s: float | None = None,
        room: Callable[[], bool] = lambda: True,
        step_s: float = 0.2,
    ) -> bool:
        """Block until every frame was confirmed (True). False when the stream was refused or
        halted, when ``stop()`` says to give up, or once ``patience_s`` passed while ``room()``
        (the outbox can take the rest: :meth:`spill`)."""
        deadline = None if patience_s is None else time.monotonic() + patience_s
        with self._lock:
            while not self.done:
                if stop() or (deadline is not None and time.monotonic() >= deadline and room()):
                    return False
                self._lock.wait(step_s)
            return self.refused is None and not self._halted

    def spill(self) -> list[list[bytes]]:
        """Stop delivering and return every frame not yet confirmed (the rest of the journal or
        logs, then the final frame nymph adds), in batches, for the outbox to keep on disk; the
        frames of a batch in flight are included (the control plane answers duplicates)."""
        batches: list[list[bytes]] = []
        with self._lock:
            if self._halted or self.refused is not None:
                return batches
            self._inflight = None
            self._ended = True
            self._spilling = True  # a big frame that cannot be uploaded now is kept inline
            while (batch := self._next_batch()) is not None:
                batches.append(batch.frames)
                self._advance(batch)  # in memory only: pump.json keeps what was confirmed
                if batch.final:
                    self._tail = None
                    break
        self.halt()
        return batches

    @property
    def done(self) -> bool:
        """Nothing more to deliver: all confirmed (final frame or ended), refused or halted."""
        if self._halted or self.refused is not None:
            return True
        if self._inflight is not None or self._journal.entries:
            return False
        if self.final_sent:
            return True
        return self._ended and self._tail is None and self._drained_files()

    @property
    def has_frames(self) -> bool:
        """Whether the stream has any frame (delivered or in the journal)."""
        if self._script or self.delivered_seq >= 0 or self._journal.entries:
            return True
        return any(self._size(name) > 0 for name in (FRAMES, STDOUT, STDERR))

    # --- the sender's side ------------------------------------------------------------------------

    def take(self) -> Batch | None:
        """The batch to post now (the same one again until confirmed); None when nothing waits."""
        with self._lock:
            if self._halted or self.refused is not None:
                return None
            if self._inflight is None:
                try:
                    self._inflight = self._next_batch()
                except LakeshoreError as exc:  # a big frame's upload failed: try again on the next take
                    log.warning("invocation %s: frame upload failed, retrying: %s", self.invocation_id, exc)
                    return None
            self._check_window()
            return self._inflight

    def confirm(self, batch: Batch) -> None:
        """The control plane journaled ``batch``: advance, save progress, release the journal."""
        with self._lock:
            if batch is not self._inflight:
                return
            self._inflight = None
            self._advance(batch)
            self._save_state()
            self._release_logs()
            if not self._script:
                self._write_watermark()
                self._release()
            self._lock.notify_all()
        if self.done:
            self._detach()

    def _advance(self, batch: Batch) -> None:
        """Delivery now stands past ``batch`` (confirmed, or spilled to the outbox)."""
        self.delivered_seq = batch.last_seq
        self.final_sent = self.final_sent or batch.final
        self._offsets.update(batch.end)
        self._log_bytes += batch.log_bytes
        self._truncated = self._truncated or batch.truncated
        obs.OUTPUT_BYTES_SENT.inc(batch.log_bytes)
        if batch.truncated:
            obs.OUTPUT_TRUNCATED.inc()
        if batch.journal_seq is not None:
            self._journal.confirm(batch.journal_seq)
        if batch.final:
            self._tail = None

    def refuse(self, reason: str) -> None:
        """The control plane refused the stream for good (superseded, unknown, out of order)."""
        with self._lock:
            self.refused = reason
            self._inflight = None
            self._lock.notify_all()
        self._detach()

    def undelivered(self) -> tuple[int, int]:
        """``(frames, bytes)`` not yet confirmed: the frames read from the journal (for a script,
        the batch in flight) and the bytes on disk past the delivered offset."""
        with self._lock:
            frames = len(self._journal.entries) + (self._inflight.log_frames if self._inflight else 0)
            return frames, self._undelivered_bytes()

    # --- reading ----------------------------------------------------------------------------------

    def _next_batch(self) -> Batch | None:
        if self.final_sent:  # the stream is closed: nothing goes after its END or ERROR
            return None
        if not self._script:
            self._journal.read()
        limits = self.limits
        frames: list[bytes] = []
        end: dict[str, int] = {}
        # output first (what the task printed before the frames it yielded, mostly), but only half
        # a batch of it while journal frames wait
        share = 2 if self._journal.entries else 1
        size, log_bytes, truncated = self._log_frames(
            frames, end, max(1, limits.batch_frames // share), max(1, limits.batch_bytes // share)
        )
        journal_seq = None
        final = False
        log_frames = len(frames)
        if self._journal.entries:
            shift = self.delivered_seq + 1 + len(frames) - self._journal.entries[0].seq
            taken = self._journal_frames(frames, end, size, shift)
            if taken is not None:
                journal_seq, final = taken
        if frames:
            first = self.delivered_seq + 1
            last = first + len(frames) - 1
            return Batch(frames, first, last, final, end, journal_seq, log_bytes, truncated, log_frames)
        if self._ended and self._tail is not None and self._drained_files():
            kind, body = self._tail
            if not self.final_sent and not self._journal.final_seen:
                seq = self.delivered_seq + 1
                data = wire.encode_frame(kind, seq, body, {"ts": time.time()})
                return Batch([data], seq, seq, True, {})
            self._tail = None
        return None

    def _logs_drained(self, end: dict[str, int] | None = None) -> bool:
        """Every byte of output was taken (delivered, or in a batch whose offsets ``end`` holds)."""
        if self._truncated:
            return True
        at = end or {}
        return all(self._size(name) <= at.get(name, self._offsets[name]) for name in (STDOUT, STDERR))

    def _drained_files(self) -> bool:
        """Every byte written to the journal and the logs was turned into frames."""
        if self._script:
            return self._logs_drained()
        return self._logs_drained() and self._journal.drained()

    def _size(self, name: str) -> int:
        try:
            if name == FRAMES:
                return self._journal.size()
            return os.lstat(self._paths[name]).st_size  # a planted link is not followed
        except OSError:
            return 0

    def _journal_frames(
        self, frames: list[bytes], end: dict[str, int], size: int, shift: int
    ) -> tuple[int, bool] | None:
        """Append the next journal frames to ``frames`` (renumbered by ``shift``) within the batch
        limits; ``(the entry's seq of the last one, whether it is final)``, None when none fit.
        The final frame waits until the task ended and its output is all in frames."""
        limits = self.limits
        taken = self._journal.take(
            len(frames),
            size,
            limits.batch_frames,
            limits.batch_bytes,
            lambda: self._ended and self._logs_drained(end),
        )
        for entry, frame in taken:
            frames.append(
                self._by_reference(bytes(frame) if shift == 0 else renumbered(frame, entry.seq + shift))
            )
        if not taken:
            return None
        last = taken[-1][0]
        end[FRAMES] = last.end
        return last.seq, last.final

    def _by_reference(self, data: bytes) -> bytes:
        """``data`` (one encoded frame), or when its body is over the inline threshold the same
        frame with the body uploaded and replaced by ``{"ref": {bucket, key, size, sha256}}``."""
        if self._ship is None or not by_reference(len(data), self._threshold):
            return data
        frame = wire.decode_frame(data)
        if not isinstance(frame.body, bytes) or not by_reference(len(frame.body), self._threshold):
            return data
        try:
            ref = self._ship(frame.seq, frame.body)
        except LakeshoreError as exc:
            if not self._spilling:
                raise
            log.warning(
                "invocation %s: frame %d (%d bytes) kept inline in the outbox: its upload failed: %s",
                self.invocation_id, frame.seq, len(frame.body), exc,
            )  # fmt: skip
            return data
        return wire.encode_frame(frame.kind, frame.seq, {"ref": ref}, frame.meta)

    def _log_frames(
        self, frames: list[bytes], end: dict[str, int], max_frames: int, max_bytes: int
    ) -> tuple[int, int, bool]:
        """Append LOG frames of the output not yet taken (the next seqs) to ``frames``, within
        ``max_frames`` / ``max_bytes`` and the cap; ``(their encoded size, the output bytes they
        carry, whether the "truncated" line is among them)``. Past the cap, output is skipped."""
        size = taken = 0
        seq = self.delivered_seq + len(frames)
        budget = self.limits.log_max_bytes - self._log_bytes
        truncated = self._truncated
        for name, stream in ((STDOUT, "stdout"), (STDERR, "stderr")):
            offset = self._offsets[name]
            if truncated:  # past the cap: what the task writes is skipped, not kept on our side
                end[name] = max(offset, self._size(name))
                continue
            while len(frames) < max_frames and size < max_bytes:
                if self._size(name) <= offset:  # nothing new (the common wake-up): no open, no read
                    break
                fh = safeio.open_output(self.workdir, name)  # never through a link the task planted
                if fh is None:
                    break
                room = max(0, budget - taken)
                with fh:
                    fh.seek(offset)
                    data = fh.read(min(_LOG_READ, room + 1))  # one byte past the room: is there more?
                    fresh = time.time() - os.fstat(fh.fileno()).st_mtime < PARTIAL_HOLD_S
                if not data:
                    break
                if len(data) > room:  # the cap: keep what fits, say so, skip the rest
                    data = data[:room]
                    truncated = True
                elif not self._ended and not data.endswith(b"\n"):
                    # whole lines where there are some: the rest of a line being written (an
                    # unbuffered print writes the text, then the newline) waits a moment for it
                    cut = data.rfind(b"\n") + 1
                    if cut:
                        data = data[:cut]
                    elif fresh and len(data) < _LOG_READ:
                        break  # a partial line written just now: the next wake-up or tick takes it
                if data:
                    offset += len(data)
                    taken += len(data)
                    seq += 1
                    frame = wire.encode_frame(
                        wire.FRAME_LOG, seq, data, {"stream": stream, "ts": time.time()}
                    )
                    frames.append(frame)
                    size += len(frame)
                if truncated:
                    break
            end[name] = offset
            if truncated:
                break
        if truncated and not self._truncated:
            for name in (STDOUT, STDERR):
                end[name] = max(end.get(name, self._offsets[name]), self._size(name))
            seq += 1
            note = (
                f"[lakeshore] output truncated: this attempt wrote more than log_max_bytes="
                f"{self.limits.log_max_bytes} bytes of stdout/stderr; the rest is not kept (the "
                "function keeps running; raise nymph's stream_log_max_bytes to keep more)\n"
            ).encode()
            meta = {"stream": "stderr", "ts": time.time(), "truncated": True}
            frame = wire.encode_frame(wire.FRAME_LOG, seq, note, meta)
            frames.append(frame)
            size += len(frame)
        return size, taken, truncated and not self._truncated

    # --- flow control -----------------------------------------------------------------------------

    def _undelivered_bytes(self) -> int:
        """Bytes on disk not yet delivered: the journal's, and the output's up to its cap."""
        return self._undelivered_output() + self._undelivered_journal()

    def _undelivered_output(self) -> int:
        if self._truncated:
            return 0
        logs = sum(max(0, self._size(n) - self._offsets[n]) for n in (STDOUT, STDERR))
        return min(logs, max(0, self.limits.log_max_bytes - self._log_bytes))

    def _undelivered_journal(self) -> int:
        if self._script:
            return 0
        return max(0, self._size(FRAMES) - self._offsets[FRAMES])

    def _check_window(self) -> None:
        """Account the time the window is full (the task pauses) and enforce the hard cap."""
        limits = self.limits
        nbytes = self._undelivered_journal()  # output is bounded by its own cap, never fails the task
        self._outbox.note_undelivered(nbytes + self._undelivered_output())
        full = nbytes >= limits.window_bytes or len(self._journal.entries) >= limits.window_frames
        now = time.monotonic()
        if full and self._full_since is None:
            self._full_since = now
        elif not full and self._full_since is not None:
            obs.STREAM_PAUSED.inc(now - self._full_since)
            self._full_since = None
        if nbytes > limits.max_bytes and not self._overflowed:
            self._overflowed = True
            message = (
                f"{nbytes} undelivered stream bytes exceed stream_max_bytes={limits.max_bytes} "
                f"(delivered up to seq {self.delivered_seq}); the task was stopped"
            )
            log.error("invocation %s: %s", self.invocation_id, message)
            if self._on_overflow is not None:
                self._on_overflow(message)

    def _release(self) -> None:
        """Punch out the delivered prefix of the journal."""
        self._journal.release(self._offsets[FRAMES])

    def _release_logs(self) -> None:
        """Punch out the output already taken (sent, or skipped past the cap) but its tail
        (:func:`nymph.flow.release_logs`): a task printing without end never fills nymph's disk.
        Best effort: a log nymph cannot write, or a filesystem that cannot punch holes, keeps it."""
        if self._log_punch_ok:
            done = {
                n: max(self._offsets[n], self._size(n) if self._truncated else 0) for n in (STDOUT, STDERR)
            }
            self._log_punch_ok = release_logs(self.workdir, done, self._log_punched)

    # --- progress ---------------------------------------------------------------------------------

    def _detach(self) -> None:
        """Leave the watcher and close the journal (the stream is done or halted)."""
        with self._lock:
            watch, self._watch = self._watch, None
            if self._full_since is not None:
                obs.STREAM_PAUSED.inc(time.monotonic() - self._full_since)
                self._full_since = None
            self._journal.close()
        if watch is not None:
            self._outbox.watcher.remove(watch)
        self._outbox.close_stream(self)

    def _save_state(self) -> None:
        state = {
            "sent_seq": self.delivered_seq,
            "journal_seq": self._journal.confirmed_seq,
            "log_bytes": self._log_bytes,
            "truncated": self._truncated,
            "final": self.final_sent,
            **self._offsets,
        }
        save_state(self.workdir, self.invocation_id, state)

    def _write_watermark(self) -> None:
        write_watermark(self.workdir, self.invocation_id, self._journal.confirmed_seq, self._offsets[FRAMES])
