"""The frame journal as the pump reads it: an index of the entry's complete frames, by seq.

A Python invocation's entry appends its frames to ``frames.msgpack`` in the workdir
(:mod:`dreamlake.lakeshore.daemon.entry`). A :class:`Journal` reads that file from where delivery
stopped and indexes every complete frame (its kind and seq, read from the first bytes: frames are
skipped, not decoded), checks that the seqs follow one another, and stops at the final frame (END
or ERROR): nothing after it belongs to the stream. The pump (:mod:`nymph.pump`) takes the indexed
frames in batches, renumbered into its one seq space (:func:`renumbered`: only the seq in the
header changes), and once the control plane confirmed them :meth:`Journal.release` punches the
delivered prefix out of the file (:func:`nymph.flow.punch_hole`), so the journal's disk use stays
near the window.

The workdir is the task's: the journal is opened through :mod:`nymph.safeio` (no link followed,
only the task's own regular file).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack

from dreamlake.lakeshore import wire
from nymph import safeio
from nymph.flow import punch_hole
from nymph.workdir import FRAMES

log = logging.getLogger(__name__)

_READ = 256 * 1024
_PAGE = 4096
_HEAD = 11  # a frame's first bytes: fixarray(4), kind, seq (up to uint64)
_UINT = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


@dataclass
class Entry:
    """One complete frame of the journal, read and not yet confirmed."""

    seq: int
    start: int  # journal offset of the frame
    end: int  # journal offset just past it
    final: bool


class Journal:
    """The index of one invocation's frame journal (see the module docstring). Not thread-safe:
    the pump calls it under its lock."""

    def __init__(
        self,
        workdir: Path,
        invocation_id: str,
        offset: int,
        confirmed_seq: int,
        *,
        max_bytes: int,
        final_seen: bool,
    ) -> None:
        """``offset``: where the delivered frames end; ``confirmed_seq``: the entry's seq of the
        last frame confirmed; ``max_bytes``: the largest frame the parser takes."""
        self.workdir = workdir
        self.invocation_id = invocation_id
        self._path = os.path.join(os.fspath(workdir), FRAMES)
        self.confirmed_seq = confirmed_seq
        self.entries: deque[Entry] = deque()  # frames read and not yet confirmed
        self.read_off = offset  # bytes fed to the parser end here
        self.parsed_off = offset  # the last complete frame ends here
        self._unpacker_base = offset  # the parser's tell() counts from here
        self._raw = bytearray()  # the bytes fed since the last complete frame (from _raw_off)
        self._raw_off = offset
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max_bytes)
        self.fd: int | None = None
        self._punched = 0
        self._punch_ok = True
        self.final_seen = final_seen  # the final frame was read (or delivered)
        self.broken = False  # nothing more is read: the final frame was, or the journal is corrupt

    @property
    def last_seq(self) -> int:
        """The entry's seq of the last journal frame read."""
        return self.entries[-1].seq if self.entries else self.confirmed_seq

    def size(self) -> int:
        try:
            if self.fd is not None:
                return os.fstat(self.fd).st_size
            return os.lstat(self._path).st_size  # a planted link is not followed
        except OSError:
            return 0

    def drained(self) -> bool:
        """Every byte written to the journal was indexed (or it is broken: nothing more counts)."""
        return self.broken or self.size() <= self.parsed_off

    def open(self) -> int | None:
        """The journal, opened through :mod:`nymph.safeio` (the workdir is the task's: no link
        followed, only the task's own regular file); writable when it can be, to punch holes."""
        if self.fd is None:
            if self.size() <= self.read_off:  # no journal yet (a plain function: ever)
                return None
            try:
                self.fd = safeio.open_fd(self.workdir, FRAMES, os.O_RDWR)
            except FileNotFoundError:
                return None
            except PermissionError:  # not ours to write: read it, release nothing
                try:
                    self.fd = safeio.open_fd(self.workdir, FRAMES, os.O_RDONLY)
                except OSError:
                    return None
                self._punch_ok = False
            except OSError as exc:
                if not self.broken:
                    log.warning("invocation %s: journal not read: %s", self.invocation_id, exc)
                return None
        return self.fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def read(self) -> None:
        """Index every complete frame the entry appended (its window bounds how many). Frames are
        skipped, not decoded: only their kind and seq are read, from the first bytes."""
        if self.broken:
            return
        fd = self.open()
        if fd is None:
            return
        while True:
            data = os.pread(fd, _READ, self.read_off)
            if not data:
                return
            self.read_off += len(data)
            self._raw += data
            self._unpacker.feed(data)
            try:
                self._parse()
            except Exception as exc:
                log.error("invocation %s: frame journal is corrupt after offset %d, stop reading it: %s",
                          self.invocation_id, self.parsed_off, exc)  # fmt: skip
                self.broken = True
                return
            if self.broken:  # a final frame: nothing after it belongs to the stream
                return

    def _parse(self) -> None:
        while True:
            try:
                self._unpacker.skip()
            except msgpack.OutOfData:
                break
            end = self._unpacker_base + self._unpacker.tell()
            at = self.parsed_off - self._raw_off
            kind, seq = header(self._raw[at : at + _HEAD])
            if seq != self.last_seq + 1:
                raise ValueError(f"frame seq {seq} where seq {self.last_seq + 1} was next")
            final = kind in (wire.FRAME_END, wire.FRAME_ERROR)
            self.entries.append(Entry(seq, self.parsed_off, end, final))
            self.parsed_off = end
            if final:
                self.final_seen = True
                self.broken = True
                break
        del self._raw[: self.parsed_off - self._raw_off]
        self._raw_off = self.parsed_off

    def take(
        self, count: int, size: int, max_frames: int, max_bytes: int, final_ok: Callable[[], bool]
    ) -> list[tuple[Entry, memoryview]]:
        """The next indexed frames, each with its bytes, to add to a batch that holds ``count``
        frames of ``size`` bytes, within ``max_frames`` / ``max_bytes`` (a first frame goes alone
        whatever its size); the final frame only when ``final_ok()``."""
        if self.fd is None or not self.entries:
            return []
        first = self.entries[0]
        taken: list[Entry] = []
        for entry in self.entries:
            if (count or taken) and (
                count + len(taken) >= max_frames or size + entry.end - first.start > max_bytes
            ):
                break
            if entry.final and not final_ok():
                break
            taken.append(entry)
            if entry.final:
                break
        if not taken:
            return []
        last = taken[-1]
        data = os.pread(self.fd, last.end - first.start, first.start)
        if len(data) != last.end - first.start:
            raise OSError(f"journal of {self.invocation_id} shrank under the pump")
        view = memoryview(data)
        return [(e, view[e.start - first.start : e.end - first.start]) for e in taken]

    def confirm(self, seq: int) -> None:
        """The frames up to the entry's ``seq`` were delivered: drop them from the index."""
        self.confirmed_seq = seq
        while self.entries and self.entries[0].seq <= seq:
            self.entries.popleft()

    def release(self, offset: int) -> None:
        """Punch out the delivered prefix of the journal, up to ``offset`` (whole pages)."""
        upto = offset // _PAGE * _PAGE
        if not self._punch_ok or upto <= self._punched or self.fd is None:
            return
        if punch_hole(self.fd, upto):
            self._punched = upto
        else:
            err = ctypes.get_errno()
            self._punch_ok = False
            log.info("invocation %s: the journal's filesystem cannot punch holes (%s); it keeps its "
                     "delivered frames until the workdir goes", self.invocation_id, errno.errorcode.get(err, err))  # fmt: skip


def renumbered(frame: memoryview, seq: int) -> bytes:
    """The encoded ``frame`` with its seq replaced by ``seq`` (body and meta bytes kept as they are)."""
    tag = frame[2]
    width = 0 if tag < 0x80 else _UINT[tag]
    packed: bytes = msgpack.packb(seq)
    return b"\x94" + bytes(frame[1:2]) + packed + bytes(frame[3 + width :])


def header(head: bytes | bytearray) -> tuple[int, int]:
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
