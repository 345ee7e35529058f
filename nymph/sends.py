"""What consumers send into a running two-way generator, fetched for its task.

A two-way call (``run_config.two_way``, see :mod:`dreamlake.lakeshore.twoway`) waits at each
``yield`` for its answer. A :class:`SendRelay` (one thread per running two-way invocation; plain
calls and one-way streams have none) long-polls ``POST /v1/daemon/sends`` for the sends after the
last one it wrote and appends them, frame by frame as the control plane journaled them, to
``sends.msgpack`` in the task's workdir (``O_APPEND``, no link followed, nymph's own file, readable
by the task), where the entry reads them. A restarted relay (a new attempt, a restarted nymph)
starts from what the file already holds. The relay stops with the job; a control plane that is away
costs retries with backoff, never the task (the body's own ``send_timeout_s`` bounds its wait).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import DecodeError, PlaneError
from dreamlake.lakeshore.twoway import SENDS_FILE
from nymph import safeio

if TYPE_CHECKING:
    from nymph.client import ControlPlaneClient

log = logging.getLogger(__name__)

WAIT_S = 30.0
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0


def _fetched(workdir: Path) -> int:
    """The index of the last send ``sends.msgpack`` holds (-1: none)."""
    data = safeio.read_own(workdir, SENDS_FILE, limit=1 << 30) or b""
    try:
        frames = wire.FrameReader().feed(data)
    except DecodeError:
        return -1
    return frames[-1].seq if frames else -1


class SendRelay:
    """Fetch the sends into ``invocation_id`` (attempt ``attempt``) into ``workdir``'s sends file."""

    def __init__(
        self, client: ControlPlaneClient, workdir: Path, invocation_id: str, attempt: int, worker_id: str
    ) -> None:
        self._client = client
        self._workdir = workdir
        self._body = {"invocation_id": invocation_id, "attempt": attempt, "worker_id": worker_id}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nymph-sends-{invocation_id}", daemon=True)

    def start(self) -> SendRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop fetching (the job ended); an answer in flight is dropped with the thread."""
        self._stop.set()

    def _run(self) -> None:
        since = _fetched(self._workdir)
        pause = RETRY_MIN_S
        while not self._stop.is_set():
            try:
                answer = self._client.sends(
                    {**self._body, "since": since, "wait_s": WAIT_S}, timeout_s=WAIT_S + 10
                )
            except PlaneError as exc:
                if exc.status in (403, 404, 409):  # the lease is gone: nothing more is ours to fetch
                    log.info("sends of %s: %s; relay stops", self._body["invocation_id"], exc)
                    return
                self._stop.wait(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = RETRY_MIN_S
            frames = [bytes(f) for f in answer.get("frames") or []]
            if frames and not self._stop.is_set():
                safeio.append_stream(self._workdir, SENDS_FILE, frames)
                last = wire.decode_frame(frames[-1])
                since = last.seq
                if last.kind == wire.FRAME_END:
                    return  # closed: the body takes nothing more (a throw is not the end)
