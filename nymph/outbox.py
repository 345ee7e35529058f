"""The durable outbox: every ack and every frame is on disk before it is sent.

:meth:`Outbox.put` writes one message (route + msgpack body) to ``{state_dir}/outbox/`` atomically
(temp file, fsync, rename, fsync of the directory) and returns; a single sender thread delivers
messages in the order they were put, retrying transient failures with exponential backoff and
jitter (tenacity), and deletes a message only when the control plane has settled it: 2xx
(including ``duplicate: true``), or a final refusal (409 superseded, 404 unknown, other 4xx, which
are logged). On start-up the directory is replayed, so an outage or a restart costs latency,
never results. File names sort by a per-outbox sequence, which keeps frames before their ack.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import tenacity

from nymph.client import AuthRejected, ClientError, ControlPlaneClient, FatalError, is_retryable

log = logging.getLogger(__name__)

ACK = "/v1/daemon/ack"
CHUNK = "/v1/daemon/result-chunk"
NAMESPACE_ROUTES = "/v1/namespaces/"
_SUFFIX = ".msg"


@dataclass(frozen=True)
class Message:
    path: Path
    route: str
    body: dict[str, Any]

    @property
    def invocation_id(self) -> str:
        return str(self.body.get("invocation_id") or self.body.get("exec_id", ""))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Outbox:
    """Durable, ordered delivery of acks and frames to the control plane."""

    def __init__(
        self,
        state_dir: Path,
        client: ControlPlaneClient,
        *,
        on_sent: Callable[[bool], None] | None = None,
        max_backoff_s: float = 10.0,
    ) -> None:
        self.dir = state_dir / "outbox"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._client = client
        self._on_sent = on_sent
        self._max_backoff_s = max_backoff_s
        self._cond = threading.Condition()
        self._queue: list[Message] = []
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_flight: Message | None = None  # popped from the queue, being delivered
        self._replay()

    # --- producer side -----------------------------------------------------------------------------

    def put(self, route: str, body: dict[str, Any]) -> None:
        """Persist one message (fsync'd) and queue it for delivery."""
        data = msgpack.packb({"route": route, "body": body}, use_bin_type=True)
        with self._cond:
            self._seq = max(self._seq + 1, time.time_ns())
            name = f"{self._seq:020d}-{body.get('invocation_id') or body.get('exec_id', 'x')}{_SUFFIX}"
            path = self.dir / name
            tmp = self.dir / (name + ".tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.dir)
            self._queue.append(Message(path, route, body))
            self._cond.notify_all()

    def ack(self, body: dict[str, Any]) -> None:
        self.put(ACK, body)

    def chunk(self, body: dict[str, Any]) -> None:
        self.put(CHUNK, body)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (1 if self._in_flight is not None else 0)

    def pending_for(self, invocation_id: str) -> bool:
        """Whether a message for ``invocation_id`` is queued or being sent."""
        with self._cond:
            queued = [*self._queue, *([self._in_flight] if self._in_flight is not None else [])]
            return any(m.invocation_id == invocation_id for m in queued)

    # --- sender ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nymph-outbox", daemon=True)
        self._thread.start()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything was delivered (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait(1.0)
                if self._stop.is_set():
                    return
                msg = self._queue.pop(0)
                self._in_flight = msg
            try:
                self._deliver(msg)
            except Exception:  # a poison message must not stop every later ack (nor the next start)
                log.exception(
                    "invocation %s: %s cannot be sent; moved aside as .bad", msg.invocation_id, msg.route
                )
                with contextlib.suppress(OSError):
                    os.replace(msg.path, msg.path.with_suffix(".bad"))
            finally:
                with self._cond:
                    self._in_flight = None
                    self._cond.notify_all()

    def _deliver(self, msg: Message) -> None:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: is_retryable(e) or isinstance(e, AuthRejected)),
            wait=tenacity.wait_exponential(multiplier=0.1, max=self._max_backoff_s)
            + tenacity.wait_random(0, 0.5),
            stop=tenacity.stop_when_event_set(self._stop),
            sleep=self._sleep,
            before_sleep=lambda rs: self._report(msg, rs),
            reraise=True,
        )
        try:
            if msg.route.startswith(NAMESPACE_ROUTES):  # exec results: JSON, without our exec_id key
                body = {k: v for k, v in msg.body.items() if k != "exec_id"}
                answer = retrying(self._client.call_json, msg.route, body)
            else:
                answer = retrying(self._client.call, msg.route, msg.body)
        except FatalError as exc:
            log.warning("invocation %s: %s refused, dropped: %s", msg.invocation_id, msg.route, exc)
            self._done(msg)
            return
        except ClientError:
            # stopped while the control plane was away: keep the file for the next start
            with self._cond:
                self._queue.insert(0, msg)
            return
        if answer.get("duplicate"):
            log.debug("invocation %s: %s was a duplicate", msg.invocation_id, msg.route)
        self._done(msg)
        if self._on_sent is not None:
            self._on_sent(True)

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _report(self, msg: Message, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        log.warning(
            "invocation %s: %s not delivered (try %d), will retry: %s",
            msg.invocation_id,
            msg.route,
            state.attempt_number,
            exc,
        )
        if self._on_sent is not None:
            self._on_sent(False)

    def _done(self, msg: Message) -> None:
        with contextlib.suppress(FileNotFoundError):
            msg.path.unlink()

    def _replay(self) -> None:
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        for path in sorted(self.dir.glob("*" + _SUFFIX)):
            try:
                raw = msgpack.unpackb(path.read_bytes(), raw=False)
                msg = Message(path, str(raw["route"]), dict(raw["body"]))
            except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                log.error("outbox: unreadable message %s moved aside: %s", path.name, exc)
                os.replace(path, path.with_suffix(".bad"))
                continue
            self._queue.append(msg)
            self._seq = max(self._seq, int(path.name.split("-", 1)[0]))
        if self._queue:
            log.info("outbox: replaying %d message(s) left by a previous run", len(self._queue))
