"""A stream's flow control, on disk: its limits (:class:`StreamLimits`), where its delivery stands
(the pump's cursor, the entry's watermark), and releasing what was delivered.

Three things in an invocation's workdir say how far its stream (:mod:`nymph.pump`) got:

- ``pump.json`` (the cursor, nymph's own): the last seq the control plane confirmed, the entry's seq
  of the last journal frame confirmed, the output bytes sent toward the cap, whether the cap was
  hit and the final frame sent, and the offset in each file delivery stands at. It is saved after
  each confirmed batch, so a restarted nymph resumes exactly there (at worst it re-sends a batch:
  the control plane answers duplicates).
- ``frames.delivered`` (the watermark, ``"<seq> <offset>"``: the entry's last delivered seq and the
  journal offset just past it), readable by the task: the entry, told the window by
  ``LAKESHORE_STREAM_WINDOW=<frames>:<bytes>``, pauses at its next ``yield`` while its undelivered
  frames reach the window and resumes when this file says they drained (see
  :mod:`dreamlake.lakeshore.daemon.entry`).
- the delivered bytes themselves are released with ``fallocate(PUNCH_HOLE)``
  (:func:`punch_hole`) where the filesystem supports it: the journal's delivered prefix
  (:meth:`nymph.journal.Journal.release`) and the output already taken, but its last
  ``LOG_TAIL_KEEP`` bytes (:func:`release_logs`).

The workdir is the task's: every file is opened through :mod:`nymph.safeio`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nymph import safeio

log = logging.getLogger(__name__)

WINDOW_ENV = "LAKESHORE_STREAM_WINDOW"
STATE = "pump.json"
WATERMARK = "frames.delivered"
MiB = 1024 * 1024
LOG_PUNCH_STEP = MiB  # taken output is released from the logs' disk in steps of this much
LOG_TAIL_KEEP = 64 * 1024  # ... but for their last bytes
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


def release_logs(workdir: Path, done: dict[str, int], punched: dict[str, int]) -> bool:
    """Punch out of each output file (name -> bytes taken, sent or skipped past the cap) what was
    taken but its last ``LOG_TAIL_KEEP`` bytes (failure records quote the tail), once a
    ``LOG_PUNCH_STEP`` of it built up (``punched``: released so far, updated). False once a log
    cannot be released (nymph cannot write it, or its filesystem cannot punch holes): stop trying."""
    ok = True
    for name, taken in done.items():
        upto = (taken - LOG_TAIL_KEEP) // _PAGE * _PAGE
        if upto - punched.get(name, 0) < LOG_PUNCH_STEP:
            continue
        try:
            fd = safeio.open_fd(workdir, name, os.O_WRONLY)
        except OSError:
            return False
        try:
            if punch_hole(fd, upto):
                punched[name] = upto
            else:
                ok = False
        finally:
            os.close(fd)
    return ok


# --- the cursor and the watermark -------------------------------------------------------------------


def load_state(workdir: Path) -> dict[str, Any]:
    """The cursor saved in ``pump.json`` ({} when there is none, or it is not one)."""
    try:
        raw = json.loads(safeio.read_own(workdir, STATE) or b"{}")
    except ValueError:
        return {}
    return raw if isinstance(raw, dict) else {}


def save_state(workdir: Path, invocation_id: str, state: dict[str, Any]) -> None:
    try:
        safeio.write_file(workdir, STATE, json.dumps(state).encode())
    except OSError as exc:
        log.warning("invocation %s: cannot save pump progress: %s", invocation_id, exc)


def write_watermark(workdir: Path, invocation_id: str, seq: int, offset: int) -> None:
    """Tell the entry its frames up to ``seq`` (the journal up to ``offset``) were delivered."""
    text = f"{seq} {offset}\n".encode()
    try:  # readable by the task, which runs as another user
        safeio.write_file(workdir, WATERMARK, text, 0o644)
    except OSError as exc:
        log.warning("invocation %s: cannot write %s: %s", invocation_id, WATERMARK, exc)
