"""The stream pump: frames leave the workdir for the control plane as they appear.

For a Python invocation it tails the entry's journal (``frames.msgpack``) with a
:class:`~dreamlake.lakeshore.wire.FrameReader`; for a ``script`` run it turns new bytes of
``stdout.log`` / ``stderr.log`` into LOG frames (kind 4, meta ``{"stream": ..., "ts": ...}``).
Every frame goes to the durable outbox (``/v1/daemon/result-chunk``) in seq order, so a frame is
on disk before it is sent. Progress is saved in ``pump.json`` in the workdir after each frame, so
a restarted nymph resumes where it stopped (at worst it re-sends a frame: duplicates are safe).
The workdir is the task's: every file is opened through :mod:`nymph.safeio` (no link followed).

One thread per running invocation polls the files every ``interval_s``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import DecodeError
from nymph import safeio
from nymph.outbox import Outbox
from nymph.workdir import FRAMES, STDERR, STDOUT

log = logging.getLogger(__name__)

STATE = "pump.json"
_READ = 64 * 1024


class Pump:
    """Tails one invocation's journal (or script logs) into the outbox."""

    def __init__(
        self,
        workdir: Path,
        invocation_id: str,
        attempt: int,
        outbox: Outbox,
        *,
        worker_id: str | None = None,
        script: bool = False,
        interval_s: float = 0.05,
    ) -> None:
        self.workdir = workdir
        self.invocation_id = invocation_id
        self.attempt = attempt
        self.worker_id = (
            worker_id  # sent with every frame: the control plane takes frames from the lease holder only
        )
        self._outbox = outbox
        self._script = script
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        state = self._load_state()
        self.sent_seq: int = int(state.get("sent_seq", -1))  # last seq handed to the outbox
        self.final_sent: bool = bool(state.get("final", False))
        self._offsets: dict[str, int] = {
            STDOUT: int(state.get(STDOUT, 0)),
            STDERR: int(state.get(STDERR, 0)),
        }
        self._journal_pos = 0
        self._reader = wire.FrameReader()
        self._broken = False

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"nymph-pump-{self.invocation_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then drain whatever is left in the files (call after the task ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()

    def halt(self) -> None:
        """Stop the thread without draining (the job failed; safe after :meth:`stop`)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll()
            except Exception:  # the pump must never kill the agent
                log.exception("invocation %s: pump failed", self.invocation_id)

    def poll(self) -> int:
        """Forward new frames; return how many were queued."""
        with self._lock:
            return self._poll_logs() if self._script else self._poll_journal()

    # --- the frames --------------------------------------------------------------------------------

    def _poll_journal(self) -> int:
        if self._broken:
            return 0
        fh = safeio.open_output(self.workdir, FRAMES)  # never through a link the task planted
        if fh is None:
            return 0
        with fh:
            fh.seek(self._journal_pos)
            data = fh.read()
        if not data:
            return 0
        self._journal_pos += len(data)
        try:
            frames = self._reader.feed(data)
        except DecodeError as exc:
            log.error("invocation %s: frame journal is corrupt, stop tailing: %s", self.invocation_id, exc)
            self._broken = True
            return 0
        queued = 0
        for frame in frames:
            if frame.seq <= self.sent_seq:
                continue
            self._send(
                wire.encode_frame(frame.kind, frame.seq, frame.body, frame.meta), frame.seq, frame.final
            )
            queued += 1
        return queued

    def _poll_logs(self) -> int:
        queued = 0
        for name, stream in ((STDOUT, "stdout"), (STDERR, "stderr")):
            while True:
                fh = safeio.open_output(self.workdir, name)
                if fh is None:
                    break
                with fh:
                    fh.seek(self._offsets[name])
                    data = fh.read(_READ)
                if not data:
                    break
                self._offsets[name] += len(data)
                seq = self.sent_seq + 1
                meta = {"stream": stream, "ts": time.time()}
                self._send(wire.encode_frame(wire.FRAME_LOG, seq, data, meta), seq, False)
                queued += 1
        return queued

    def finish(self, kind: int, body: bytes | dict[str, Any]) -> None:
        """Close the stream with END or ERROR unless a final frame was already sent."""
        with self._lock:
            if self.final_sent:
                return
            seq = self.sent_seq + 1
            self._send(wire.encode_frame(kind, seq, body, {"ts": time.time()}), seq, True)

    @property
    def sent_any(self) -> bool:
        return self.sent_seq >= 0

    def _send(self, frame: bytes, seq: int, final: bool) -> None:
        self._outbox.chunk(
            {
                "invocation_id": self.invocation_id,
                "seq": seq,
                "bytes": frame,
                "final": final,
                "attempt": self.attempt,
                **({"worker_id": self.worker_id} if self.worker_id else {}),
            }
        )
        self.sent_seq = seq
        self.final_sent = self.final_sent or final
        self._save_state()

    # --- progress ----------------------------------------------------------------------------------

    def _load_state(self) -> dict[str, Any]:
        try:
            raw = json.loads(safeio.read_own(self.workdir, STATE) or b"{}")
        except ValueError:
            return {}
        return raw if isinstance(raw, dict) else {}

    def _save_state(self) -> None:
        state = {"sent_seq": self.sent_seq, "final": self.final_sent, **self._offsets}
        try:
            safeio.write_file(self.workdir, STATE, json.dumps(state).encode())
        except OSError as exc:
            log.warning("invocation %s: cannot save pump progress: %s", self.invocation_id, exc)
