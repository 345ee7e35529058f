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

The outbox's sender asks the pump for a batch
(:meth:`Pump.take`: every complete frame that built up since the last request, up to
``batch_frames`` / ``batch_bytes``; the first frame goes alone, at once) and posts it to
``/v1/daemon/result-chunks``; a batch is taken again, identical, until the control plane confirmed
it (:meth:`Pump.confirm`). Nothing of the journal is copied to the outbox directory: the journal is
the durable copy, and ``pump.json`` (the delivered seq and offsets, saved after each confirmed
batch) lets a restarted nymph resume exactly there (at worst it re-sends a batch: the control
plane answers duplicates).

Flow control. After each confirmed batch the pump writes ``frames.delivered`` (``"<seq>
<offset>"``: the last delivered seq and the journal offset just past it) in the workdir; the entry,
told the window by ``LAKESHORE_STREAM_WINDOW=<frames>:<bytes>``, pauses at its next ``yield``
while its undelivered frames reach the window and resumes when this file says they drained (see
:mod:`dreamlake.lakeshore.daemon.entry`). That works on every runner: the workdir is all the task
shares with nymph. The delivered prefix of the journal is released with
``fallocate(PUNCH_HOLE)`` where the filesystem supports it, so the journal's disk use stays near
the window. Undelivered journal bytes beyond ``max_bytes`` (a task that ignores the window, e.g.
one writing the journal itself) call ``on_overflow`` once: the job stops the task and fails it with
``StreamOverflow``; no frame is dropped silently. Output never does that: past its cap it is cut
with a line that says so.

The workdir is the task's: every file in it is opened through :mod:`nymph.safeio` (no link
followed, only the task's or nymph's own regular files).

New frames are noticed without polling: the outbox's :class:`nymph.watcher.Watcher` wakes it on
each write in a watched workdir.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import LakeshoreError
from dreamlake.lakeshore.protocol.limits import by_reference
from nymph import observability as obs
from nymph import safeio
from nymph.workdir import FRAMES, STDERR, STDOUT

if TYPE_CHECKING:
    from nymph.watcher import Watcher

log = logging.getLogger(__name__)

STATE = "pump.json"
WATERMARK = "frames.delivered"
WINDOW_ENV = "LAKESHORE_STREAM_WINDOW"
MiB = 1024 * 1024
_LOG_READ = 64 * 1024
PARTIAL_HOLD_S = 0.1  # a line without its newline yet waits this long (after the last write) for it
LOG_PUNCH_STEP = MiB  # taken output is released from the logs' disk in steps of this much
LOG_TAIL_KEEP = 64 * 1024  # ... but for their last bytes
_READ = 256 * 1024
_PAGE = 4096


@dataclass(frozen=True)
class StreamLimits:
    """Flow-control settings of every stream (nymph's ``stream_*`` settings; docs/nymph.md)."""

    window_frames: int = 4096  # the task pauses while this many of its frames are undelivered
    window_bytes: int = 32 * MiB  # ... or this many bytes
    max_bytes: int = 1024 * MiB  # undelivered bytes on disk that fail the invocation (hard cap)
    batch_frames: int = 1000  # frames per request at most
    batch_bytes: int = MiB  # bytes per request at most (one larger frame goes alone)
    log_max_bytes: int = 16 * MiB  # stdout + stderr sent per attempt; past it, one "truncated" line
    inotify: bool = True  # False: poll every poll_s (a workdir written from other hosts)
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        for name in (
            "window_frames",
            "window_bytes",
            "max_bytes",
            "batch_frames",
            "batch_bytes",
            "log_max_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"stream_{name} must be >= 1, got {getattr(self, name)}")
        if self.window_bytes >= self.max_bytes:
            raise ValueError(
                f"stream_window_bytes ({self.window_bytes}) must be below stream_max_bytes "
                f"({self.max_bytes}): the window is where the task pauses, the cap where it fails"
            )
        if not self.poll_s > 0:
            raise ValueError(f"stream_poll_s must be > 0, got {self.poll_s}")

    @property
    def env(self) -> str:
        """The value of ``LAKESHORE_STREAM_WINDOW`` for the entry."""
        return f"{self.window_frames}:{self.window_bytes}"


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


@dataclass
class _Entry:
    seq: int
    start: int  # journal offset of the frame
    end: int  # journal offset just past it
    final: bool


# --- punching holes ---------------------------------------------------------------------------------

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:  # pragma: no cover - no libc
        return None


_LIBC = _libc()


def punch_hole(fd: int, length: int) -> bool:
    """Release the disk blocks of ``[0, length)`` of ``fd`` (the size is kept); False when unsupported."""
    fallocate = getattr(_LIBC, "fallocate", None)
    if fallocate is None or length <= 0:
        return False
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    rc = fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, length)
    return bool(rc == 0)


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
        state = {} if fresh else self._load_state()
        self.delivered_seq: int = int(state.get("sent_seq", -1))  # last seq the control plane confirmed
        # the entry's seq of the last journal frame confirmed (a state from before LOG frames of
        # Python invocations: the two seq spaces were one)
        self._journal_seq: int = int(state.get("journal_seq", self.delivered_seq))
        self._log_bytes: int = int(state.get("log_bytes", 0))  # output sent, toward log_max_bytes
        self._truncated: bool = bool(state.get("truncated", False))  # the cap was hit, said so
        self.final_sent: bool = bool(state.get("final", False))
        self._offsets: dict[str, int] = {  # delivered up to here, per file
            FRAMES: int(state.get(FRAMES, 0)),
            STDOUT: int(state.get(STDOUT, 0)),
            STDERR: int(state.get(STDERR, 0)),
        }
        # journal reading: the index of the frames read and not yet confirmed, the parser's position
        self._entries: deque[_Entry] = deque()
        self._read_off = self._offsets[FRAMES]  # bytes fed to the parser end here
        self._parsed_off = self._read_off  # the last complete frame ends here
        self._unpacker_base = self._read_off  # the parser's tell() counts from here
        self._raw = bytearray()  # the bytes fed since the last complete frame (from _raw_off)
        self._raw_off = self._read_off
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=self.limits.max_bytes)
        self._fd: int | None = None
        self._punched = 0
        self._punch_ok = True
        self._log_punched: dict[str, int] = {}  # output released (punched out) up to here, per file
        self._log_punch_ok = True
        self._final_seen = self.final_sent
        self._broken = False
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
        if self._inflight is not None or self._entries:
            return False
        if self.final_sent:
            return True
        return self._ended and self._tail is None and self._drained_files()

    @property
    def has_frames(self) -> bool:
        """Whether the stream has any frame (delivered or in the journal)."""
        if self._script or self.delivered_seq >= 0 or self._entries:
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
            self._journal_seq = batch.journal_seq
            while self._entries and self._entries[0].seq <= batch.journal_seq:
                self._entries.popleft()
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
            frames = len(self._entries) + (self._inflight.log_frames if self._inflight else 0)
            return frames, self._undelivered_bytes()

    # --- reading ----------------------------------------------------------------------------------

    def _next_batch(self) -> Batch | None:
        if self.final_sent:  # the stream is closed: nothing goes after its END or ERROR
            return None
        if not self._script:
            self._read_journal()
        limits = self.limits
        frames: list[bytes] = []
        end: dict[str, int] = {}
        # output first (what the task printed before the frames it yielded, mostly), but only half
        # a batch of it while journal frames wait
        share = 2 if self._entries else 1
        size, log_bytes, truncated = self._log_frames(
            frames, end, max(1, limits.batch_frames // share), max(1, limits.batch_bytes // share)
        )
        journal_seq = None
        final = False
        log_frames = len(frames)
        if self._entries:
            shift = self.delivered_seq + 1 + len(frames) - self._entries[0].seq
            taken = self._journal_frames(frames, end, size, shift)
            if taken is not None:
                journal_seq, final = taken
        if frames:
            first = self.delivered_seq + 1
            last = first + len(frames) - 1
            return Batch(frames, first, last, final, end, journal_seq, log_bytes, truncated, log_frames)
        if self._ended and self._tail is not None and self._drained_files():
            kind, body = self._tail
            if not self.final_sent and not self._final_seen:
                seq = self.delivered_seq + 1
                data = wire.encode_frame(kind, seq, body, {"ts": time.time()})
                return Batch([data], seq, seq, True, {})
            self._tail = None
        return None

    def _last_seq(self) -> int:
        """The entry's seq of the last journal frame read."""
        return self._entries[-1].seq if self._entries else self._journal_seq

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
        return self._logs_drained() and (self._broken or self._size(FRAMES) <= self._parsed_off)

    def _size(self, name: str) -> int:
        try:
            if name == FRAMES and self._fd is not None:
                return os.fstat(self._fd).st_size
            return os.lstat(self._paths[name]).st_size  # a planted link is not followed
        except OSError:
            return 0

    def _open(self) -> int | None:
        """The journal, opened through :mod:`nymph.safeio` (the workdir is the task's: no link
        followed, only the task's own regular file); writable when it can be, to punch holes."""
        if self._fd is None:
            if self._size(FRAMES) <= self._read_off:  # no journal yet (a plain function: ever)
                return None
            try:
                self._fd = safeio.open_fd(self.workdir, FRAMES, os.O_RDWR)
            except FileNotFoundError:
                return None
            except PermissionError:  # not ours to write: read it, release nothing
                try:
                    self._fd = safeio.open_fd(self.workdir, FRAMES, os.O_RDONLY)
                except OSError:
                    return None
                self._punch_ok = False
            except OSError as exc:
                if not self._broken:
                    log.warning("invocation %s: journal not read: %s", self.invocation_id, exc)
                return None
        return self._fd

    def _read_journal(self) -> None:
        """Index every complete frame the entry appended (its window bounds how many). Frames are
        skipped, not decoded: only their kind and seq are read, from the first bytes."""
        if self._broken:
            return
        fd = self._open()
        if fd is None:
            return
        while True:
            data = os.pread(fd, _READ, self._read_off)
            if not data:
                return
            self._read_off += len(data)
            self._raw += data
            self._unpacker.feed(data)
            try:
                self._parse()
            except Exception as exc:
                log.error("invocation %s: frame journal is corrupt after offset %d, stop reading it: %s",
                          self.invocation_id, self._parsed_off, exc)  # fmt: skip
                self._broken = True
                return
            if self._broken:  # a final frame: nothing after it belongs to the stream
                return

    def _parse(self) -> None:
        while True:
            try:
                self._unpacker.skip()
            except msgpack.OutOfData:
                break
            end = self._unpacker_base + self._unpacker.tell()
            at = self._parsed_off - self._raw_off
            kind, seq = _header(self._raw[at : at + _HEAD])
            if seq != self._last_seq() + 1:
                raise ValueError(f"frame seq {seq} where seq {self._last_seq() + 1} was next")
            final = kind in (wire.FRAME_END, wire.FRAME_ERROR)
            self._entries.append(_Entry(seq, self._parsed_off, end, final))
            self._parsed_off = end
            if final:
                self._final_seen = True
                self._broken = True
                break
        del self._raw[: self._parsed_off - self._raw_off]
        self._raw_off = self._parsed_off

    def _journal_frames(
        self, frames: list[bytes], end: dict[str, int], size: int, shift: int
    ) -> tuple[int, bool] | None:
        """Append the next journal frames to ``frames`` (renumbered by ``shift``) within the batch
        limits; ``(the entry's seq of the last one, whether it is final)``, None when none fit.
        The final frame waits until the task ended and its output is all in frames."""
        if self._fd is None:
            return None
        limits = self.limits
        first = self._entries[0]
        taken: list[_Entry] = []
        for entry in self._entries:
            if (frames or taken) and (
                len(frames) + len(taken) >= limits.batch_frames
                or size + entry.end - first.start > limits.batch_bytes
            ):
                break
            if entry.final and not (self._ended and self._logs_drained(end)):
                break
            taken.append(entry)
            if entry.final:
                break
        if not taken:
            return None
        last = taken[-1]
        data = os.pread(self._fd, last.end - first.start, first.start)
        if len(data) != last.end - first.start:
            raise OSError(f"journal of {self.invocation_id} shrank under the pump")
        view = memoryview(data)
        for e in taken:
            frame = view[e.start - first.start : e.end - first.start]
            frames.append(
                self._by_reference(bytes(frame) if shift == 0 else _renumbered(frame, e.seq + shift))
            )
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
        full = nbytes >= limits.window_bytes or len(self._entries) >= limits.window_frames
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
        """Punch out the delivered prefix of the journal (whole pages)."""
        upto = self._offsets[FRAMES] // _PAGE * _PAGE
        if not self._punch_ok or upto <= self._punched or self._fd is None:
            return
        if punch_hole(self._fd, upto):
            self._punched = upto
        else:
            err = ctypes.get_errno()
            self._punch_ok = False
            log.info("invocation %s: the journal's filesystem cannot punch holes (%s); it keeps its "
                     "delivered frames until the workdir goes", self.invocation_id, errno.errorcode.get(err, err))  # fmt: skip

    def _release_logs(self) -> None:
        """Punch out the output already taken (sent, or skipped past the cap) but its last
        ``LOG_TAIL_KEEP`` bytes (failure records quote the tail), once a ``LOG_PUNCH_STEP`` of it
        built up: a task printing without end never fills nymph's disk. Best effort: a log nymph
        cannot write, or a filesystem that cannot punch holes, keeps its bytes."""
        if not self._log_punch_ok:
            return
        for name in (STDOUT, STDERR):
            done = max(self._offsets[name], self._size(name) if self._truncated else 0)
            upto = (done - LOG_TAIL_KEEP) // _PAGE * _PAGE
            if upto - self._log_punched.get(name, 0) < LOG_PUNCH_STEP:
                continue
            try:
                fd = safeio.open_fd(self.workdir, name, os.O_WRONLY)
            except OSError:
                self._log_punch_ok = False
                return
            try:
                if punch_hole(fd, upto):
                    self._log_punched[name] = upto
                else:
                    self._log_punch_ok = False
            finally:
                os.close(fd)

    # --- progress ---------------------------------------------------------------------------------

    def _detach(self) -> None:
        """Leave the watcher and close the journal (the stream is done or halted)."""
        with self._lock:
            watch, self._watch = self._watch, None
            if self._full_since is not None:
                obs.STREAM_PAUSED.inc(time.monotonic() - self._full_since)
                self._full_since = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        if watch is not None:
            self._outbox.watcher.remove(watch)
        self._outbox.close_stream(self)

    def _load_state(self) -> dict[str, Any]:
        try:
            raw = json.loads(safeio.read_own(self.workdir, STATE) or b"{}")
        except ValueError:
            return {}
        return raw if isinstance(raw, dict) else {}

    def _save_state(self) -> None:
        state = {
            "sent_seq": self.delivered_seq,
            "journal_seq": self._journal_seq,
            "log_bytes": self._log_bytes,
            "truncated": self._truncated,
            "final": self.final_sent,
            **self._offsets,
        }
        try:
            safeio.write_file(self.workdir, STATE, json.dumps(state).encode())
        except OSError as exc:
            log.warning("invocation %s: cannot save pump progress: %s", self.invocation_id, exc)

    def _write_watermark(self) -> None:
        text = f"{self._journal_seq} {self._offsets[FRAMES]}\n".encode()
        try:  # readable by the task, which runs as another user
            safeio.write_file(self.workdir, WATERMARK, text, 0o644)
        except OSError as exc:
            log.warning("invocation %s: cannot write %s: %s", self.invocation_id, WATERMARK, exc)


_HEAD = 11  # a frame's first bytes: fixarray(4), kind, seq (up to uint64)
_UINT = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _renumbered(frame: memoryview, seq: int) -> bytes:
    """The encoded ``frame`` with its seq replaced by ``seq`` (body and meta bytes kept as they are)."""
    tag = frame[2]
    width = 0 if tag < 0x80 else _UINT[tag]
    packed: bytes = msgpack.packb(seq)
    return b"\x94" + bytes(frame[1:2]) + packed + bytes(frame[3 + width :])


def _header(head: bytes | bytearray) -> tuple[int, int]:
    """``(kind, seq)`` from the first bytes of an encoded frame (``[kind, seq, body, meta]``, as
    ``wire.encode_frame`` packs it); ValueError for anything else."""
    if len(head) < 3 or head[0] != 0x94 or head[1] not in wire.FRAME_KINDS:
        raise ValueError(f"not a frame header: {bytes(head[:3])!r}")
    tag = head[2]
    if tag < 0x80:
        return head[1], tag
    width = _UINT.get(tag)
    if width is None or len(head) < 3 + width:
        raise ValueError(f"frame seq of type 0x{tag:02x}: not an unsigned integer")
    return head[1], int.from_bytes(head[3 : 3 + width], "big")
