"""The stream pump: an invocation's frames leave its workdir for the control plane, in batches,
with flow control back to the task.

A :class:`Pump` is the frame source of one invocation's lane in the outbox (:mod:`nymph.outbox`).
For a Python invocation it reads the entry's journal (``frames.msgpack``) from where delivery
stopped; for a ``script`` run it turns new bytes of ``stdout.log`` / ``stderr.log`` into LOG frames
(kind 4, meta ``{"stream": ..., "ts": ...}``). The outbox's sender asks it for a batch
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
the window. Undelivered bytes beyond ``max_bytes`` (a task that ignores the window, a script that
logs faster than delivery while the control plane is away) call ``on_overflow`` once: the job
stops the task and fails it with ``StreamOverflow``; nothing is dropped silently.

The workdir is the task's: every file in it is opened through :mod:`nymph.safeio` (no link
followed, only the task's or nymph's own regular files).

New frames are noticed without polling: a :class:`Watcher` (one thread, one inotify instance via
ctypes, for every pump) wakes the outbox on each write in a watched workdir, with a safety tick
each second. Where inotify is unavailable (or a watch cannot be added, or ``inotify=False`` for a
filesystem written from other hosts), the watcher polls those workdirs every ``poll_s``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import LakeshoreError
from nymph import observability as obs
from nymph import safeio
from nymph.workdir import FRAMES, STDERR, STDOUT

if TYPE_CHECKING:
    from nymph.outbox import Outbox

log = logging.getLogger(__name__)

STATE = "pump.json"
WATERMARK = "frames.delivered"
WINDOW_ENV = "LAKESHORE_STREAM_WINDOW"
_LOG_READ = 64 * 1024
_READ = 256 * 1024
_PAGE = 4096
MiB = 1024 * 1024


@dataclass(frozen=True)
class StreamLimits:
    """Flow-control settings of every stream (nymph's ``stream_*`` settings; docs/nymph.md)."""

    window_frames: int = 4096  # the task pauses while this many of its frames are undelivered
    window_bytes: int = 32 * MiB  # ... or this many bytes
    max_bytes: int = 1024 * MiB  # undelivered bytes on disk that fail the invocation (hard cap)
    batch_frames: int = 1000  # frames per request at most
    batch_bytes: int = MiB  # bytes per request at most (one larger frame goes alone)
    inotify: bool = True  # False: poll every poll_s (a workdir written from other hosts)
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("window_frames", "window_bytes", "max_bytes", "batch_frames", "batch_bytes"):
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


# --- the pump ---------------------------------------------------------------------------------------


class Pump:
    """The frame source of one invocation (see the module docstring). Thread-safe."""

    def __init__(
        self,
        workdir: Path,
        invocation_id: str,
        attempt: int,
        outbox: Outbox,
        *,
        worker_id: str = "",
        script: bool = False,
        limits: StreamLimits | None = None,
        on_overflow: Callable[[str], None] | None = None,
        ship: Callable[[int, bytes], dict[str, Any]] | None = None,
        inline_threshold: int | None = None,
    ) -> None:
        self.workdir = workdir
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
        state = self._load_state()
        self.delivered_seq: int = int(state.get("sent_seq", -1))  # last seq the control plane confirmed
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
        """Join the outbox: its sender takes batches from here; the watcher wakes it on writes."""
        if not self._script:
            self._write_watermark()
        self._outbox.open_stream(self)
        self._watch = self._outbox.watcher.add(self.workdir, self._on_write)

    def _on_write(self) -> None:
        """The watcher saw a write (or ticked): account the window, then wake the sender."""
        with self._lock:
            if not self._halted:
                self._check_window()
        self._outbox.wake()

    def stop(self) -> None:
        """The task ended: what is in the files now is all there will be."""
        with self._lock:
            self._ended = True
        self._outbox.wake()

    def finish(self, kind: int, body: bytes | dict[str, Any]) -> None:
        """Close the stream with END or ERROR after the journal, unless it holds a final frame."""
        with self._lock:
            self._ended = True
            if not self.final_sent:
                self._tail = (kind, body)
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
                self._offsets.update(batch.end)  # in memory only: pump.json keeps what was confirmed
                self.delivered_seq = batch.last_seq
                self.final_sent = self.final_sent or batch.final
                while self._entries and self._entries[0].seq <= batch.last_seq:
                    self._entries.popleft()
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
        try:
            return os.lstat(self.workdir / FRAMES).st_size > 0
        except OSError:
            return False

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
            self.delivered_seq = batch.last_seq
            self.final_sent = self.final_sent or batch.final
            self._offsets.update(batch.end)
            if not self._script:
                while self._entries and self._entries[0].seq <= batch.last_seq:
                    self._entries.popleft()
            if batch.final:
                self._tail = None
            self._save_state()
            if not self._script:
                self._write_watermark()
                self._release()
            self._lock.notify_all()
        if self.done:
            self._detach()

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
            frames = len(self._inflight.frames) if self._script and self._inflight else len(self._entries)
            return frames, self._undelivered_bytes()

    # --- reading ----------------------------------------------------------------------------------

    def _next_batch(self) -> Batch | None:
        if self._script:
            batch = self._log_batch()
        else:
            self._read_journal()
            batch = self._journal_batch()
        if batch is None and self._ended and self._tail is not None and self._drained_files():
            kind, body = self._tail
            if not self.final_sent and not self._final_seen:
                seq = self._last_seq() + 1
                data = wire.encode_frame(kind, seq, body, {"ts": time.time()})
                batch = Batch([data], seq, seq, True, {})
            else:
                self._tail = None
        return batch

    def _last_seq(self) -> int:
        return self._entries[-1].seq if self._entries else self.delivered_seq

    def _drained_files(self) -> bool:
        """Every byte written to the journal (or logs) was turned into frames."""
        if self._script:
            return all(self._size(name) <= self._offsets[name] for name in (STDOUT, STDERR))
        return self._broken or self._size(FRAMES) <= self._parsed_off

    def _size(self, name: str) -> int:
        try:
            if name == FRAMES and self._fd is not None:
                return os.fstat(self._fd).st_size
            return os.lstat(self.workdir / name).st_size  # a planted link is not followed
        except OSError:
            return 0

    def _open(self) -> int | None:
        """The journal, opened through :mod:`nymph.safeio` (the workdir is the task's: no link
        followed, only the task's own regular file); writable when it can be, to punch holes."""
        if self._fd is None:
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

    def _journal_batch(self) -> Batch | None:
        if not self._entries or self._fd is None:
            return None
        limits = self.limits
        first = self._entries[0]
        taken: list[_Entry] = []
        for entry in self._entries:
            if taken and (len(taken) >= limits.batch_frames or entry.end - first.start > limits.batch_bytes):
                break
            taken.append(entry)
            if entry.final:
                break
        last = taken[-1]
        data = os.pread(self._fd, last.end - first.start, first.start)
        if len(data) != last.end - first.start:
            raise OSError(f"journal of {self.invocation_id} shrank under the pump")
        view = memoryview(data)
        frames = [self._by_reference(bytes(view[e.start - first.start : e.end - first.start])) for e in taken]
        return Batch(frames, first.seq, last.seq, last.final, {FRAMES: last.end})

    def _by_reference(self, data: bytes) -> bytes:
        """``data`` (one encoded frame), or when its body is over the inline threshold the same
        frame with the body uploaded and replaced by ``{"ref": {bucket, key, size, sha256}}``."""
        if self._ship is None or self._threshold is None or len(data) <= self._threshold:
            return data
        frame = wire.decode_frame(data)
        if not isinstance(frame.body, bytes) or len(frame.body) <= self._threshold:
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

    def _log_batch(self) -> Batch | None:
        limits = self.limits
        frames: list[bytes] = []
        end: dict[str, int] = {}
        size = 0
        seq = self.delivered_seq
        for name, stream in ((STDOUT, "stdout"), (STDERR, "stderr")):
            offset = self._offsets[name]
            while len(frames) < limits.batch_frames and size < limits.batch_bytes:
                fh = safeio.open_output(self.workdir, name)  # never through a link the task planted
                if fh is None:
                    break
                with fh:
                    fh.seek(offset)
                    data = fh.read(_LOG_READ)
                if not data:
                    break
                offset += len(data)
                seq += 1
                meta = {"stream": stream, "ts": time.time()}
                frame = wire.encode_frame(wire.FRAME_LOG, seq, data, meta)
                frames.append(frame)
                size += len(frame)
            end[name] = offset
        if not frames:
            return None
        return Batch(frames, self.delivered_seq + 1, seq, False, end)

    # --- flow control -----------------------------------------------------------------------------

    def _undelivered_bytes(self) -> int:
        if self._script:
            return sum(max(0, self._size(n) - self._offsets[n]) for n in (STDOUT, STDERR))
        return max(0, self._size(FRAMES) - self._offsets[FRAMES])

    def _check_window(self) -> None:
        """Account the time the window is full (the task pauses) and enforce the hard cap."""
        limits = self.limits
        nbytes = self._undelivered_bytes()
        self._outbox.note_undelivered(nbytes)
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
        self._outbox.wake()

    def _load_state(self) -> dict[str, Any]:
        try:
            raw = json.loads(safeio.read_own(self.workdir, STATE) or b"{}")
        except ValueError:
            return {}
        return raw if isinstance(raw, dict) else {}

    def _save_state(self) -> None:
        state = {"sent_seq": self.delivered_seq, "final": self.final_sent, **self._offsets}
        try:
            safeio.write_file(self.workdir, STATE, json.dumps(state).encode())
        except OSError as exc:
            log.warning("invocation %s: cannot save pump progress: %s", self.invocation_id, exc)

    def _write_watermark(self) -> None:
        text = f"{self.delivered_seq} {self._offsets[FRAMES]}\n".encode()
        try:  # readable by the task, which runs as another user
            safeio.write_file(self.workdir, WATERMARK, text, 0o644)
        except OSError as exc:
            log.warning("invocation %s: cannot write %s: %s", self.invocation_id, WATERMARK, exc)


_HEAD = 11  # a frame's first bytes: fixarray(4), kind, seq (up to uint64)
_UINT = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


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


# --- the watcher ------------------------------------------------------------------------------------

_IN_MODIFY = 0x002
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
TICK_S = 1.0  # with inotify: a safety re-check of every watched workdir


class _Watch:
    def __init__(self, path: Path, callback: Callable[[], None], wd: int | None) -> None:
        self.path = path
        self.callback = callback
        self.wd = wd  # None: polled


class Watcher:
    """Wakes callbacks when files in watched directories are written (inotify, else polling)."""

    def __init__(self, *, inotify: bool = True, poll_s: float = 0.05) -> None:
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}  # id -> watch
        self._by_wd: dict[int, _Watch] = {}
        self._fd = self._init_inotify() if inotify else -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    @staticmethod
    def _init_inotify() -> int:
        init = getattr(_LIBC, "inotify_init1", None)
        if init is None:
            log.info("no inotify here: stream journals are polled")
            return -1
        fd = int(init(_IN_NONBLOCK | _IN_CLOEXEC))
        if fd < 0:
            log.warning(
                "inotify_init1 failed (%s): stream journals are polled", os.strerror(ctypes.get_errno())
            )
        return fd

    @property
    def inotify(self) -> bool:
        return self._fd >= 0

    def add(self, path: Path, callback: Callable[[], None]) -> _Watch:
        wd: int | None = None
        if self._fd >= 0:
            mask = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
            got = int(_LIBC.inotify_add_watch(self._fd, os.fsencode(path), mask))
            if got >= 0:
                wd = got
            else:
                log.warning("cannot watch %s with inotify (%s); polling it every %gs",
                            path, os.strerror(ctypes.get_errno()), self._poll_s)  # fmt: skip
        watch = _Watch(path, callback, wd)
        with self._lock:
            self._watches[id(watch)] = watch
            if wd is not None:
                self._by_wd[wd] = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nymph-watcher", daemon=True)
                self._thread.start()
        self._poke()
        return watch

    def remove(self, watch: _Watch) -> None:
        with self._lock:
            self._watches.pop(id(watch), None)
            if watch.wd is not None and self._by_wd.get(watch.wd) is watch:
                del self._by_wd[watch.wd]
                _LIBC.inotify_rm_watch(self._fd, watch.wd)  # EINVAL once the directory is gone: fine

    def close(self) -> None:
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fd = -1

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _run(self) -> None:
        next_tick = time.monotonic() + TICK_S
        while not self._stop.is_set():
            with self._lock:
                polled = [w for w in self._watches.values() if w.wd is None]
            timeout = self._poll_s if polled else max(0.0, next_tick - time.monotonic())
            fds = [self._wake_r] + ([self._fd] if self._fd >= 0 else [])
            try:
                ready, _, _ = select.select(fds, [], [], timeout)
            except (OSError, ValueError):
                return
            fired: dict[int, _Watch] = {}
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._fd >= 0 and self._fd in ready:
                fired.update(self._read_events())
            for w in polled:
                fired[id(w)] = w
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                with self._lock:
                    fired.update(self._watches)
            callbacks = {id(w.callback): w.callback for w in fired.values()}
            for callback in callbacks.values():
                try:
                    callback()
                except Exception:
                    log.exception("watcher: a wake-up callback failed")

    def _read_events(self) -> dict[int, _Watch]:
        fired: dict[int, _Watch] = {}
        while True:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return fired
            except OSError as exc:
                log.warning("reading inotify events failed: %s", exc)
                return fired
            pos = 0
            with self._lock:
                while pos + _EVENT.size <= len(buf):
                    wd, _mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                    pos += _EVENT.size + length
                    watch = self._by_wd.get(wd)
                    if watch is not None:
                        fired[id(watch)] = watch
