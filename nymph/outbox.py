"""The outbox: every ack and every frame reaches the control plane, per invocation in order.

Messages (acks, exec results) are durable: :meth:`Outbox.put` writes one (route + msgpack body) to
``{state_dir}/outbox/`` atomically (temp file, fsync, rename, fsync of the directory) and returns.
On a full state dir (``ENOSPC``), or any other failed write (``EIO``, ``EROFS``, ``EACCES``), a
message is kept in memory instead and delivered all the same (see :meth:`Outbox.put`); a failed
write leaves no partial file, and messages already written stay.
Frames are not copied here while their job runs: an invocation's stream is a
:class:`~nymph.pump.Pump` over its journal in the workdir (durable there), opened with
:meth:`Outbox.open_stream`. A finished job whose frames cannot be delivered for a while (the
control plane is away) puts them here as ``result-chunks`` messages ahead of its ack, while the
messages on disk stay below ``max_bytes`` (:meth:`Outbox.has_room`).

Lanes. Everything of one invocation (or exec job) is one lane, delivered in order: its frames
first, in batches (``/v1/daemon/result-chunks``), then its messages; a message waits only for
its own lane's stream, never behind another invocation's backlog. One sender thread serves the
lanes round robin, one request at a time (a batch of frames, or one message). A lane is given up
message by message only when the control plane settled it: 2xx (including ``duplicate``), or a
final refusal (409 superseded, 404 unknown, other 4xx: logged; a refused stream ends its lane's
frames). A transient failure (connection, timeout, 5xx, 429, a refused token) pauses the sender as
a whole, with exponential backoff and jitter, and the same request is tried first again: the
control plane is one for every lane. On start-up the directory is replayed in the order it was
written, so an outage or a restart costs latency, never results. A file there that is not a
message nymph wrote (a stray name, a directory, a link, unreadable or corrupt bytes) never stops
the start-up: it is moved aside as ``.bad`` (logged once, saying where) and never sent. Those are
kept for a look, within bounds: each start deletes the oldest past ``BAD_KEEP`` and any older than
``BAD_MAX_AGE_S`` (one line says how many).

:meth:`Outbox.pending_entries` names the invocations with frames or an ack not yet confirmed
here: the heartbeat keeps renewing their leases (a lease is given up only by the ack). Metrics (:meth:`Outbox.stats`):
messages pending and their bytes on disk (and the peak), undelivered stream frames and bytes (and
the peak of one stream's bytes), and the outbox age: how long the lane that waits longest has gone
without delivering anything.

Acks on the poll. An ack at the head of its lane (its frames all delivered) may instead ride on
the poller's next ``/v1/daemon/poll`` (:meth:`Outbox.take_acks`), which writes it in the same
group commit as the claim that refills the slot: one request per invocation, not two. While it
rides, the sender leaves it alone; the poll's answer (``acked``, one per ack, in order) settles it
as the sender would (:meth:`Outbox.acks_answered`): 2xx and final refusals end it, a retryable
answer or a failed poll hands it back to the sender, whose it stays (no poll takes it again). The message stays on disk until then, so a
crash meanwhile replays it (the control plane answers ``duplicate``). An ack put while a poll is
imminent (``poll_imminent``, the poller's :meth:`~nymph.poller.Poller.poll_soon`) is held back
from the sender for :data:`HOLD_S` so that poll can take it; a poll that does not come in time
leaves it to the sender.

One idea: durable, in-order delivery per lane through one :class:`Outbox`. Its disk side (put,
replay), its lanes and sender, and the acks that ride on a poll share one lock, one set of lanes
and one message's life (written, sent or taken by a poll, settled, unlinked); split apart, each
piece would reach into the others' state.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from dreamlake.lakeshore.backoff import backoff_s
from dreamlake.lakeshore.client import error_for
from dreamlake.lakeshore.errors import PlaneError, Refused, Unauthorized
from dreamlake.lakeshore.protocol import routes
from nymph import observability as obs
from nymph.client import ControlPlaneClient, is_retryable
from nymph.errors import is_disk_full
from nymph.safeio import read_all, write_all
from nymph.watcher import Watcher

if TYPE_CHECKING:
    from nymph.pump import Batch, Pump

log = logging.getLogger(__name__)

# the routes a message names (written to disk with it, replayed after a restart)
ACK = routes.ACK
CHUNK = routes.RESULT_CHUNK
CHUNKS = routes.RESULT_CHUNKS
NAMESPACE_ROUTES = routes.NAMESPACE_ROUTES
_SUFFIX = ".msg"
_NAME = re.compile(r"([0-9]+)-(.*)\.msg")  # what put names a message: {sequence}-{invocation id}.msg
# a message is read without following a link, and without blocking on a FIFO (see nymph.safeio)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_IDLE_S = 1.0
HOLD_S = 0.05  # how long an ack put while a poll is imminent waits for that poll before the sender takes it
# files moved aside (``.bad``) are kept for the operator to look at, within bounds: at each start
# the oldest past BAD_KEEP, and any older than BAD_MAX_AGE_S, are deleted (a poison message that
# recurs must not fill the state directory, which the acks of every call need)
BAD_KEEP = 64
BAD_MAX_AGE_S = 14 * 86400.0


@dataclass(frozen=True)
class Message:
    path: Path
    route: str
    body: dict[str, Any]
    created: float = field(default_factory=time.time, compare=False)
    size: int = 0  # bytes on disk
    durable: bool = True  # False: kept in memory only (it could not be written when it was put)

    @property
    def invocation_id(self) -> str:
        return str(self.body.get("invocation_id") or self.body.get("exec_id", ""))


@dataclass
class _Lane:
    key: str
    messages: deque[Message] = field(default_factory=deque)
    stream: Pump | None = None
    since: float = field(default_factory=time.time)  # the oldest undelivered item was made then

    @property
    def empty(self) -> bool:
        return not self.messages and self.stream is None


def _retryable(status: Any) -> bool:
    """Whether an ack a poll carried, answered not ok with ``status``, goes again: a retryable
    status (5xx, 429), a refused token (401: nymph's, not the ack's), or none the sender could act
    on; a final refusal of the ack itself (another 4xx) does not."""
    if not isinstance(status, int) or status < 400 or status == 401:
        return True
    return is_retryable(error_for(status, ""))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Outbox:
    """Durable, per-invocation ordered delivery of frames, acks and exec results."""

    def __init__(
        self,
        state_dir: Path,
        client: ControlPlaneClient,
        *,
        on_sent: Callable[[bool], None] | None = None,
        max_backoff_s: float = 10.0,
        watcher: Watcher | None = None,
        max_bytes: int = 1024 * 1024 * 1024,
        on_full: Callable[[BaseException], None] | None = None,
        poll_imminent: Callable[[], bool] | None = None,
    ) -> None:
        self.dir = state_dir / "outbox"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._client = client
        self._on_sent = on_sent
        self._on_full = on_full
        self._max_backoff_s = max_backoff_s
        self.watcher = watcher or Watcher()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the sender waits on it: something may be ready to send
        self._settled = threading.Condition(lock)  # flush() waits on it: a lane was settled or emptied
        self._lanes: OrderedDict[str, _Lane] = OrderedDict()
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._woken = False
        self._paused_until = 0.0
        self._failures = 0
        self._sending: Message | None = None  # the message the sender's request carries
        self._riding: set[Path] = set()  # acks a poll carries (by path): the sender leaves them alone
        self._held: dict[Path, float] = {}  # acks held for an imminent poll: until then (monotonic)
        self._senders: set[Path] = set()  # acks a poll handed back: the sender's from then on
        self._poll_imminent = poll_imminent
        self._next_lane: str | None = None  # round robin: serve this lane first
        self._peak_bytes = 0
        self.max_bytes = max_bytes
        self._disk_bytes = 0  # of the messages on disk
        self._disk_peak = 0
        self._replay()
        obs.bind_outbox(self)

    # --- producer side -----------------------------------------------------------------------------

    def put(self, route: str, body: dict[str, Any]) -> None:
        """Persist one message (fsync'd) and queue it on its lane.

        When the state dir's filesystem is full (``ENOSPC``, ``EDQUOT``) the message is queued in
        memory only (``on_full`` is told): it is delivered like any other, and only a death of
        nymph before that loses it, after which the lease lapses and the invocation runs again
        (at least once, as after any crash). Messages already on disk are never touched by it.
        Any other failed write (``EIO``, ``EROFS``, ``EACCES`` ...) is treated the same way, but
        ``on_full`` is not told (no room to wait for): this never raises an ``OSError``, so an ack
        is never lost to a failing state dir while nymph lives. One line is logged per message.
        """
        data = msgpack.packb({"route": route, "body": body}, use_bin_type=True)
        with self._cond:
            self._seq = max(self._seq + 1, time.time_ns())
            name = f"{self._seq:020d}-{body.get('invocation_id') or body.get('exec_id', 'x')}{_SUFFIX}"
            path = self.dir / name
            try:
                self._write(path, data)
            except OSError as exc:
                full = is_disk_full(exc)
                log.error(
                    "outbox: %s for invocation %s kept in memory, not on disk (%s); it is still "
                    "delivered, but lost if nymph dies first (then its lease lapses and it runs again)%s",
                    route, body.get("invocation_id") or body.get("exec_id"), exc,
                    "" if full else f" -- writes to {self.dir} fail: check that filesystem "
                    "(read-only? I/O errors? permissions?)",
                )  # fmt: skip
                if full and self._on_full is not None:
                    self._on_full(exc)
                msg = Message(path, route, body, size=0, durable=False)
            else:
                msg = Message(path, route, body, size=len(data))
                self._count_disk(len(data))
            self._lane(msg.invocation_id).messages.append(msg)
            if route == ACK and self._poll_imminent is not None and self._poll_imminent():
                self._held[path] = time.monotonic() + HOLD_S
            self._wake_locked()

    def _write(self, path: Path, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically and durably; on failure leave nothing behind."""
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # the first error is the one to report; a start-up
                tmp.unlink(missing_ok=True)  # removes a temporary file left here all the same
            raise
        try:
            _fsync_dir(self.dir)
        except OSError as exc:  # the message is in place; only its durability across a host crash is in doubt
            log.warning("outbox: fsync of %s failed: %s", self.dir, exc)

    def ack(self, body: dict[str, Any]) -> None:
        self.put(ACK, body)

    def chunk(self, body: dict[str, Any]) -> None:
        """One frame as a durable message (``/v1/daemon/result-chunk``); streams use open_stream."""
        self.put(CHUNK, body)

    def open_stream(self, pump: Pump, *, wake: bool = True) -> None:
        """Deliver ``pump``'s frames ahead of any message of its invocation put after this call;
        ``wake``: whether the sender has something to send already (a fresh stream has nothing
        until its pump wakes it)."""
        with self._cond:
            lane = self._lane(pump.invocation_id)
            lane.stream = pump
            if wake:
                self._wake_locked()

    def close_stream(self, pump: Pump) -> None:
        """``pump`` is done (delivered, refused or halted): the messages behind it may go, and the
        sender is woken only when there are some."""
        with self._cond:
            lane = self._lanes.get(pump.invocation_id)
            if lane is None or lane.stream is not pump:
                return
            lane.stream = None
            if lane.messages:
                self._wake_locked()
            else:
                self._drop_if_empty(lane)

    def take_acks(self, worker_id: str, limit: int) -> list[Message]:
        """Up to ``limit`` acks for a poll to carry (see the module docstring): each at the head of
        its lane, with no stream before it, not being sent, and of ``worker_id``'s (an ack of an
        earlier worker id goes its own way). They ride until :meth:`acks_answered`."""
        out: list[Message] = []
        with self._cond:
            for lane in self._lanes.values():
                if len(out) >= limit:
                    break
                if lane.stream is not None or not lane.messages:
                    continue
                msg = lane.messages[0]
                if msg.route != ACK or msg is self._sending or msg.path in self._riding | self._senders:
                    continue
                if msg.body.get("worker_id") not in (None, worker_id):
                    continue
                self._riding.add(msg.path)
                self._held.pop(msg.path, None)
                out.append(msg)
        return out

    def acks_answered(self, msgs: list[Message], answers: list[Any] | None) -> None:
        """The poll that carried ``msgs`` was answered with ``answers`` (its ``acked``: one per ack,
        in order), or failed (None). Settled acks end, as the sender ends them; the others (a
        retryable answer, none at all) go back to the sender."""
        answered = list(answers or [])
        settled = False
        for i, msg in enumerate(msgs):
            answer = answered[i] if i < len(answered) and isinstance(answered[i], dict) else None
            status = answer.get("status") if answer is not None else None
            if answer is None or (not answer.get("ok") and _retryable(status)):
                self._hand_back(msg)
                continue
            if answer.get("ok"):
                if answer.get("duplicate"):
                    log.debug("invocation %s: %s was a duplicate", msg.invocation_id, msg.route)
            else:
                log.warning(
                    "invocation %s: %s refused, dropped: %s (%s)",
                    msg.invocation_id, msg.route, answer.get("error"), status,
                )  # fmt: skip
            with self._cond:
                lane = self._lanes.get(msg.invocation_id)
            try:
                if lane is not None:
                    self._done(lane, msg)
            except OSError as exc:  # settled, but still on disk: the sender deals with it
                log.warning("invocation %s: settling its ack failed: %s", msg.invocation_id, exc)
                self._hand_back(msg)
                continue
            with self._cond:
                self._riding.discard(msg.path)
            if answer.get("ok"):
                obs.ACKS.labels(via="poll").inc()
            settled = True
        if settled and self._on_sent is not None:
            self._on_sent(True)

    def _hand_back(self, msg: Message) -> None:
        """An ack a poll carried but did not settle: the sender's (no poll takes it again)."""
        with self._cond:
            self._riding.discard(msg.path)
            self._senders.add(msg.path)
            self._wake_locked()

    def has_room(self) -> bool:
        """Whether the messages on disk stay below ``max_bytes`` (a finished job may spill its
        undelivered frames here; otherwise it keeps waiting, holding its slot)."""
        with self._cond:
            return self._disk_bytes < self.max_bytes

    def _count_disk(self, delta: int) -> None:
        self._disk_bytes += delta
        self._disk_peak = max(self._disk_peak, self._disk_bytes)

    def wake(self) -> None:
        """Something may be ready to send (a write in a journal, a confirmed batch)."""
        with self._cond:
            self._wake_locked()

    def note_undelivered(self, nbytes: int) -> None:
        """A stream reports its undelivered bytes: keep the peak of any one stream for /metrics."""
        if nbytes > self._peak_bytes:
            self._peak_bytes = nbytes

    # --- what is pending -----------------------------------------------------------------------------

    def pending(self) -> int:
        """Messages not yet settled, plus streams not yet fully delivered."""
        with self._cond:
            return sum(len(lane.messages) + (lane.stream is not None) for lane in self._lanes.values())

    def pending_for(self, invocation_id: str) -> bool:
        """Whether anything of ``invocation_id`` is queued or being sent."""
        with self._cond:
            lane = self._lanes.get(invocation_id)
            return lane is not None and not lane.empty

    def pending_entries(self) -> list[dict[str, Any]]:
        """``{invocation_id, attempt}`` of every invocation with frames or an ack on disk here."""
        with self._cond:
            out: dict[str, dict[str, Any]] = {}
            for lane in self._lanes.values():
                for msg in lane.messages:
                    attempt = msg.body.get("attempt")
                    if msg.route in (ACK, CHUNKS, CHUNK) and isinstance(attempt, int):
                        out[lane.key] = {"invocation_id": lane.key, "attempt": attempt}
            return list(out.values())

    def stats(self) -> dict[str, float]:
        """Figures for /metrics: messages, undelivered stream frames and bytes, oldest age, peak."""
        with self._cond:
            lanes = list(self._lanes.values())
        frames = nbytes = 0
        stalled: list[float] = []
        for lane in lanes:
            f = b = 0
            stream = lane.stream
            if stream is not None:
                f, b = stream.undelivered()
                frames += f
                nbytes += b
            if lane.messages or f or b:
                stalled.append(lane.since)
        oldest = min(stalled, default=None)
        return {
            "messages": float(sum(len(lane.messages) for lane in lanes)),
            "frames": float(frames),
            "bytes": float(nbytes),
            "bytes_peak": float(self._peak_bytes),
            "disk_bytes": float(self._disk_bytes),
            "disk_peak": float(self._disk_peak),
            "oldest_s": 0.0 if oldest is None else max(0.0, time.time() - oldest),
        }

    # --- sender ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nymph-outbox", daemon=True)
        self._thread.start()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything was delivered (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(not lane.empty for lane in self._lanes.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(min(left, 0.1))
        return True

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            self._settled.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.watcher.close()

    def _lane(self, key: str) -> _Lane:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key)
        return lane

    def _wake_locked(self) -> None:
        self._woken = True
        self._cond.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._serve_one():
                    self._idle()
            except Exception:  # the sender must not die: the next pass tries again
                log.exception("outbox: unexpected failure in the sender")
                self._stop.wait(0.1)

    def _idle(self) -> None:
        with self._cond:
            if self._woken:
                self._woken = False
                return
            wait = _IDLE_S
            if self._paused_until:
                wait = max(0.0, min(wait, self._paused_until - time.monotonic()))
            if self._held:  # a held ack is the sender's once its poll did not come
                wait = max(0.0, min(wait, min(self._held.values()) - time.monotonic()))
            self._cond.wait(wait)
            self._woken = False

    def _order(self) -> list[_Lane]:
        """The lanes, starting with the one round robin serves next."""
        with self._cond:
            lanes = list(self._lanes.values())
            first = self._next_lane
        if first is not None:
            for i, lane in enumerate(lanes):
                if lane.key == first:
                    return lanes[i:] + lanes[:i]
        return lanes

    def _serve_one(self) -> bool:
        """Send one request (a batch or a message) of the first lane that has one; False if none."""
        if time.monotonic() < self._paused_until:
            return False
        with self._cond:
            self._woken = False
        for lane in self._order():
            if self._stop.is_set():
                return False
            stream = lane.stream
            if stream is not None:
                batch = stream.take()
                if batch is not None:
                    self._send_batch(lane, stream, batch)
                    return True
                if not stream.done:
                    continue  # its messages wait for the rest of its frames
                with self._cond:
                    if lane.stream is stream:
                        lane.stream = None
            with self._cond:
                msg = lane.messages[0] if lane.messages else None
                if msg is None:
                    self._drop_if_empty(lane)
                    continue
                if msg.path in self._riding:
                    continue  # a poll carries it
                until = self._held.get(msg.path)
                if until is not None:
                    if time.monotonic() < until:
                        continue  # held for the poll about to start
                    del self._held[msg.path]
                self._sending = msg
            try:
                self._send_message(lane, msg)
            finally:
                with self._cond:
                    self._sending = None
            return True
        return False

    def _drop_if_empty(self, lane: _Lane) -> None:
        if lane.empty and self._lanes.get(lane.key) is lane:
            del self._lanes[lane.key]
            self._settled.notify_all()

    def _served(self, lane: _Lane) -> None:
        """A request of ``lane`` was settled: reset the backoff, let the next lane go first."""
        with self._cond:
            self._failures = 0
            self._paused_until = 0.0
            keys = list(self._lanes)
            if lane.key in keys:
                i = keys.index(lane.key)
                self._next_lane = keys[(i + 1) % len(keys)]
            lane.since = time.time()
            self._drop_if_empty(lane)  # flush() is told when that emptied the outbox's last lane
            if not lane.empty:  # settled by a poll (not the sender): what waits behind it goes now
                self._wake_locked()

    def _send_batch(self, lane: _Lane, stream: Pump, batch: Batch) -> None:
        body = {
            "invocation_id": stream.invocation_id,
            "attempt": stream.attempt,
            "worker_id": stream.worker_id,
            "frames": batch.frames,
        }
        what = f"frames {batch.first_seq}..{batch.last_seq}"
        try:
            self._client.result_chunks(body)
        except Unauthorized as exc:  # nymph's token, not these frames: they wait for a good one
            self._failed(lane, what, exc)
            return
        except Refused as exc:
            log.warning("invocation %s: %s refused, the stream ends here: %s", lane.key, what, exc)
            stream.refuse(str(exc))
            self._served(lane)
            return
        except PlaneError as exc:
            self._failed(lane, what, exc)
            return
        stream.confirm(batch)
        obs.STREAM_FRAMES_SENT.inc(len(batch.frames))
        self._served(lane)
        if self._on_sent is not None:
            self._on_sent(True)

    def _send_message(self, lane: _Lane, msg: Message) -> None:
        try:
            if msg.route.startswith(NAMESPACE_ROUTES):  # exec results: JSON, without our exec_id key
                body = {k: v for k, v in msg.body.items() if k != "exec_id"}
                answer = self._client.call_json(msg.route, body)
            else:
                answer = self._client.call(msg.route, msg.body)
        except Unauthorized as exc:  # nymph's token (unknown, expired, revoked), not this message:
            self._failed(lane, msg.route, exc)  # it waits, on disk, for the operator's new token
            return
        except Refused as exc:
            log.warning("invocation %s: %s refused, dropped: %s", msg.invocation_id, msg.route, exc)
            self._done(lane, msg)
            return
        except PlaneError as exc:
            self._failed(lane, msg.route, exc)
            return
        except Exception:  # a poison message must not stop every later ack (nor the next start)
            log.exception(
                "invocation %s: %s cannot be sent; moved aside as .bad", msg.invocation_id, msg.route
            )
            if msg.durable:
                with contextlib.suppress(OSError):
                    os.replace(msg.path, msg.path.with_suffix(".bad"))
            self._done(lane, msg, unlink=False)
            return
        if answer.get("duplicate"):
            log.debug("invocation %s: %s was a duplicate", msg.invocation_id, msg.route)
        self._done(lane, msg)
        if msg.route == ACK:
            obs.ACKS.labels(via="request").inc()
        if self._on_sent is not None:
            self._on_sent(True)

    def _failed(self, lane: _Lane, what: str, exc: PlaneError) -> None:
        """A transient failure (or a refused token): pause the sender; the same lane goes first
        on the next try."""
        with self._cond:
            self._failures += 1
            tries = self._failures
            delay = backoff_s(tries - 1, base=0.1, cap=self._max_backoff_s, doublings=16, jitter="add")
            self._paused_until = time.monotonic() + delay
            self._next_lane = lane.key
        # an outage is the client's one "control plane went away" line, not one per try
        level = logging.DEBUG if is_retryable(exc) else logging.WARNING
        log.log(level, "invocation %s: %s not delivered (try %d), will retry in %.2fs: %s",
                lane.key, what, tries, delay, exc)  # fmt: skip
        if self._on_sent is not None:
            self._on_sent(False)

    def _done(self, lane: _Lane, msg: Message, *, unlink: bool = True) -> None:
        if unlink and msg.durable:
            with contextlib.suppress(FileNotFoundError):
                msg.path.unlink()
        with self._cond:
            if lane.messages and lane.messages[0] is msg:
                lane.messages.popleft()
                self._count_disk(-msg.size)
            self._senders.discard(msg.path)
            self._held.pop(msg.path, None)
        self._served(lane)

    def _replay(self) -> None:
        """Queue the messages a previous run left, in the order they were written.

        Nothing found here stops the start-up: a temporary file of an interrupted write is removed
        (one that cannot be is set aside), and anything else that is not a message nymph wrote (see
        :meth:`_load`) is moved aside as ``.bad`` (:meth:`_set_aside`), so it is logged once and
        never sent, while every good message beside it is delivered.
        """
        for tmp in self.dir.glob("*.tmp"):
            try:
                tmp.unlink(missing_ok=True)
            except OSError as exc:  # a directory of that name: not an interrupted write of put's
                self._set_aside(tmp, f"cannot be removed ({exc.strerror or exc})")
        count = 0
        for path in sorted(self.dir.glob("*" + _SUFFIX)):
            loaded = self._load(path)
            if isinstance(loaded, str):
                self._set_aside(path, loaded)
                continue
            if loaded is None:
                continue  # gone since the listing
            seq, msg = loaded
            self._lane(msg.invocation_id).messages.append(msg)
            self._count_disk(msg.size)
            self._seq = max(self._seq, seq)
            count += 1
        if count:
            log.info("outbox: replaying %d message(s) left by a previous run", count)
        self._prune_aside()

    def _prune_aside(self) -> None:
        """Delete the ``.bad`` files past ``BAD_KEEP`` (the oldest first) and those older than
        ``BAD_MAX_AGE_S``; a file that cannot be looked at or deleted is left. Never raises."""
        aged: list[tuple[float, Path]] = []
        for path in self.dir.glob("*.bad"):
            with contextlib.suppress(OSError):
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    aged.append((st.st_mtime, path))
        aged.sort(reverse=True)  # the newest first
        cutoff = time.time() - BAD_MAX_AGE_S
        gone = 0
        for n, (mtime, path) in enumerate(aged):
            if n < BAD_KEEP and mtime >= cutoff:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                gone += 1
        if gone:
            log.warning(
                "outbox: deleted %d file(s) set aside (.bad) in %s: the oldest past %d, or older than "
                "%d days", gone, self.dir, BAD_KEEP, BAD_MAX_AGE_S // 86400,
            )  # fmt: skip

    def _load(self, path: Path) -> tuple[int, Message] | str | None:
        """``(sequence, message)`` of a message file :meth:`put` wrote; else why it is not one (a
        name put does not write, not a regular file, unreadable, corrupt); None when it is gone."""
        match = _NAME.fullmatch(path.name)
        if match is None:
            return "is not a name nymph writes ({sequence}-{invocation id}.msg)"
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return "is a symbolic link, not a message nymph wrote"
            return f"cannot be opened ({exc.strerror or exc})"
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "is not a regular file"
            data = read_all(fd)
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        finally:
            os.close(fd)
        try:
            raw = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # truncated, garbage, bad UTF-8, too deep: whatever msgpack says
            return f"is corrupt ({type(exc).__name__}: {exc})"
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("route"), str)
            or not isinstance(raw.get("body"), dict)
        ):
            return "is corrupt (not a route and a body)"
        return int(match[1]), Message(path, raw["route"], raw["body"], size=len(data))

    def _set_aside(self, path: Path, why: str) -> None:
        """Rename ``path`` to ``.bad`` (never over an earlier one), so no later start reads it
        again; one line says why and where it went. Never raises."""
        dest = path.with_suffix(".bad")
        if os.path.lexists(dest):
            dest = path.with_name(f"{path.stem}.{time.time_ns()}.bad")
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error(
                "outbox: %s %s; not sent, and it cannot be moved aside (%s): skipped at every start "
                "until it is removed (look at it, then delete it)",
                path, why, exc.strerror or exc,
            )  # fmt: skip
            return
        log.error("outbox: %s %s; not sent, moved aside to %s (look at it, then delete it)", path, why, dest)
