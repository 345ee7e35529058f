"""``Dispatch``: the in-process plane, over the store (an SQLite file, ``":memory:"``, or PostgreSQL).

Every operation is a call into the one store (``store.open_store``): claims, leases, the journal
and topics are the store's, never reimplemented here. Waits (stream follow, ``await_result``,
``claim``) sleep on the store's :class:`Notifier`, which wakes them within milliseconds of a change
made in this process; a change made by another process on the same file is seen at the next poll
(``poll_s``, default 0.1 s). Frames are written in batches, one transaction each, by a frame
writer (:mod:`~dreamlake.lakeshore.dispatch.batching`); an ack waits for its frames.

The local plane is its own trust domain: ``trusted = True``, so ``run_worker`` runs pickled
functions on it by default. It keeps the control plane's rules otherwise: submits are checked
(``store.values.check_run_config``), a plane opened with ``namespace=`` submits into that namespace,
sees only its invocations (NotFound for the rest) and claims only its work, and frames and acks
are taken only from the worker holding the lease, in seq order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.dispatch import NATIVE_FUNCTION, Claim, Plane, error_ends_stream
from dreamlake.lakeshore.dispatch.batching import FrameWriter
from dreamlake.lakeshore.errors import AuthError, BadRequest, Conflict, NotFound, PlaneError
from dreamlake.lakeshore.states import TERMINAL_STATES

if TYPE_CHECKING:
    from dreamlake.lakeshore.envelope import Envelope
    from dreamlake.lakeshore.store.api import Invocation, SubmitRequest
    from dreamlake.lakeshore.wire import Frame

__all__ = ["Dispatch"]


def _refusal(message: str, status: int) -> PlaneError:
    """The error the HTTP plane raises for the same refusal (404, 403 or 409)."""
    kind = {404: NotFound, 403: AuthError}.get(status, Conflict)
    return kind(message, status)


log = logging.getLogger(__name__)

TOPIC_PREFIX = "topic:"  # the store journals topic frames under this owner prefix
SEND_PREFIX = "send:"  # and what consumers send into a two-way body under this one


class Dispatch(Plane):
    """The local plane: ``Dispatch(":memory:")`` for one process, ``Dispatch("jobs.db")`` to share."""

    trusted = True
    runs_async = True  # run_worker runs an async def to completion (asyncio.run)
    wakes_on_commands = True  # wait_commands: a cancel reaches the worker's heartbeat at once

    def __init__(
        self,
        path: str | Path = ":memory:",
        *,
        poll_s: float = 0.1,
        lease_s: float = 30.0,
        namespace: str | None = None,
    ) -> None:
        from dreamlake.lakeshore.store import open_store

        if not poll_s > 0 or not lease_s > 0:
            raise ValueError("poll_s and lease_s must be positive numbers of seconds")
        self.store = open_store(path)
        self.notifier = self.store.notifier
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.namespace = namespace  # None: every namespace (submits go to "default")
        self._workers: set[str] = set()
        self._command_marks: dict[str, int] = {}  # notifier mark at each worker's last heartbeat
        self._next_expiry = 0.0
        self._frames = FrameWriter(self._write_frames)

    def _wait(self, channels: list[str], deadline: float, mark: int) -> None:
        left = deadline - time.monotonic()
        if left > 0:
            self.notifier.wait(channels, min(left, self.poll_s), since=mark)

    def _get(self, invocation_id: str) -> Invocation:
        from dreamlake.lakeshore.store.api import visible

        inv = self.store.get(ids.validate(invocation_id, "invocation id"))
        if inv is None or not visible(self.namespace, inv):
            raise NotFound(f"unknown invocation {invocation_id}: check the id returned by submit()", 404)
        return inv

    def _expire(self) -> None:
        """Reap lapsed leases now and then (the control plane does this with a reaper task)."""
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 1.0
            self.store.expire_leases()

    # -- producer side ------------------------------------------------------------------------------

    def submit(
        self, envelope: Envelope, queue: str, run_config: dict[str, Any], parent: str | None = None
    ) -> str:
        req = self._request(envelope.id, envelope.to_bytes(), queue, run_config, parent)
        return self.store.submit(req).invocation_id

    def _request(
        self, invocation_id: str, blob: bytes, queue: str, run_config: dict[str, Any], parent: str | None
    ) -> SubmitRequest:
        """The store's SubmitRequest of one call, its run config checked (PlaneError otherwise)."""
        from dreamlake.lakeshore.store.api import DEFAULT_NAMESPACE, SubmitRequest
        from dreamlake.lakeshore.store.values import check_run_config

        check_run_config(run_config)
        return SubmitRequest(
            invocation_id=invocation_id,
            queue=queue,
            function=dict(NATIVE_FUNCTION),
            args_blob=blob,
            run_config={**run_config, "queue": queue},
            parent_invocation_id=parent,
            namespace=self.namespace or DEFAULT_NAMESPACE,
        )

    def submit_batch(
        self, calls: Sequence[tuple[Envelope, str, dict[str, Any], str | None]]
    ) -> list[str | PlaneError]:
        """Submit many calls, ``(envelope, queue, run_config, parent)`` each, in one transaction of
        the store (``store.write_batch``); per call, in order, its invocation id or the error its
        :meth:`submit` would raise (with ``invocation_id`` set). Idempotent per Envelope id."""
        from dreamlake.lakeshore.store.api import SubmitResult

        out: list[str | PlaneError] = []
        reqs: list[SubmitRequest] = []
        where: list[int] = []
        for envelope, queue, run_config, parent in calls:
            try:
                reqs.append(self._request(envelope.id, envelope.to_bytes(), queue, run_config, parent))
            except PlaneError as exc:
                exc.invocation_id = envelope.id
                out.append(exc)
                continue
            where.append(len(out))
            out.append(envelope.id)  # until the store answers
        for i, req, result in zip(where, reqs, self.store.write_batch(reqs) if reqs else [], strict=True):
            if isinstance(result, SubmitResult):
                out[i] = result.invocation_id
            else:
                assert isinstance(result, PlaneError)
                result.invocation_id = req.invocation_id
                out[i] = result
        return out

    def status(self, invocation_id: str) -> dict[str, Any]:
        out = self._get(invocation_id).status()
        out["attempts"] = self.store.attempts(invocation_id)  # each attempt's outcome, as over HTTP
        return out

    def await_result(self, invocation_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + max(0.0, timeout)
        channel = [f"inv:{invocation_id}"]
        while True:
            mark = self.notifier.mark()
            inv = self._get(invocation_id)
            if inv.state in TERMINAL_STATES:
                return {"state": inv.state, "result_blob": inv.result_blob or b"", "error": inv.error}
            if time.monotonic() >= deadline:
                return {"state": "pending"}
            self._wait(channel, deadline, mark)

    def await_batch(self, invocation_ids: Sequence[str], timeout: float) -> dict[str, Any]:
        """The outcomes of many invocations in one read, waiting up to ``timeout`` for any of
        them to end (as ``HttpDispatch.await_batch`` answers)."""
        from dreamlake.lakeshore.store.api import visible

        wanted = list(dict.fromkeys(ids.validate(i, "invocation id") for i in invocation_ids))
        deadline = time.monotonic() + max(0.0, timeout)
        channels = [f"inv:{i}" for i in wanted]
        while True:
            mark = self.notifier.mark()
            found = {
                inv.invocation_id: inv for inv in self.store.outcomes(wanted) if visible(self.namespace, inv)
            }
            out: dict[str, Any] = {"results": {}, "states": {}, "unknown": []}
            for i in wanted:
                inv = found.get(i)
                if inv is None:
                    out["unknown"].append(i)
                elif inv.state in TERMINAL_STATES:
                    out["results"][i] = {
                        "state": inv.state,
                        "result_blob": inv.result_blob or b"",
                        "error": inv.error,
                    }
                else:
                    out["states"][i] = inv.state
            if out["results"] or not out["states"] or time.monotonic() >= deadline:
                return out
            self._wait(channels, deadline, mark)

    def cancel(self, invocation_id: str, descendants: bool = True) -> str:
        self._get(invocation_id)
        inv = ids.validate(invocation_id, "invocation id")
        state = self.store.cancel(inv)
        if state is None:
            raise NotFound(f"unknown invocation {invocation_id}: check the id returned by submit()", 404)
        if descendants:
            for child, _parent, child_state in self.store.descendants(inv):
                if child_state not in TERMINAL_STATES:
                    self.store.cancel(child)
        return state

    def frames(
        self, owner: str, since: int = -1, timeout: float = 30.0, *, topic: bool = False
    ) -> Iterator[Frame]:
        from dreamlake.lakeshore import wire

        if not topic:
            self._get(owner)  # NotFound before the first pull's wait, not after `timeout`
        owner_id = TOPIC_PREFIX + owner if topic else owner
        channel = [owner_id if topic else f"inv:{owner}"]
        deadline = time.monotonic() + timeout
        while True:
            mark = self.notifier.mark()
            rows = self.store.read_frames(owner_id, since)
            for row in rows:
                frame = wire.decode_frame(row.data)
                retried = frame.kind == wire.FRAME_ERROR and not topic
                if retried and not error_ends_stream(lambda: self.status(owner), frame, timeout):
                    since = row.seq  # a retried attempt's failure: its restart follows
                    continue
                yield frame
                since = row.seq
                if row.final:
                    return
            if rows:
                deadline = time.monotonic() + timeout
                continue
            if not topic and self._get(owner).state in TERMINAL_STATES:
                # frames are journaled before the ack: one more read sees any that raced the check
                late = self.store.read_frames(owner_id, since)
                if late:
                    continue  # frames raced the check: read them as above
                return
            if time.monotonic() >= deadline:
                what = f"topic {owner}" if topic else f"invocation {owner}"
                raise TimeoutError(
                    f"no frame from {what} after seq {since} for {timeout} s; resume with since={since} "
                    "and a longer timeout"
                )
            self._wait(channel, deadline, mark)

    def topic_post(self, name: str, body: bytes, final: bool = False) -> int:
        return self.store.topic_post(name, body, final)

    def send(self, invocation_id: str, index: int, kind: str, body: Any = None) -> bool:
        from dreamlake.lakeshore import twoway

        inv = self._get(invocation_id).invocation_id
        try:
            data = twoway.encode_send(index, kind, body)
        except ValueError as exc:
            raise BadRequest(str(exc), 400) from None
        result = self.store.send_append(inv, index, data, kind == "close")
        if not result.ok:
            raise _refusal(result.reason or f"send {index} into {inv} refused", result.status)
        return result.duplicate

    # -- worker side --------------------------------------------------------------------------------

    def claim(self, worker_id: str, queues: list[str], timeout: float) -> Claim | None:
        if worker_id not in self._workers:
            self.store.register_worker(worker_id, {"runner": "in-process", "queues": list(queues)})
            self._workers.add(worker_id)
        deadline = time.monotonic() + max(0.0, timeout)
        channels = [f"queue:{q}" for q in queues]
        while True:
            mark = self.notifier.mark()
            self._expire()
            got = self.store.claim(worker_id, list(queues), 1, self.lease_s, namespace=self.namespace)
            if got:
                inv = got[0]
                return Claim(inv.invocation_id, inv.args_blob, dict(inv.run_config), inv.attempt)
            if time.monotonic() >= deadline:
                return None
            self._wait(channels, deadline, mark)

    def sends(
        self, invocation_id: str, attempt: int, *, worker_id: str, since: int, timeout: float
    ) -> list[Frame]:
        from dreamlake.lakeshore import wire

        owner = SEND_PREFIX + invocation_id
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            mark = self.notifier.mark()
            rows = self.store.read_frames(owner, since, 64)
            if rows or time.monotonic() >= deadline:
                return [wire.decode_frame(row.data) for row in rows]
            self._wait([owner], deadline, mark)

    def append_frame(
        self, invocation_id: str, seq: int, data: bytes, final: bool, attempt: int, *, worker_id: str
    ) -> None:
        """As the control plane's result-chunk route: the frame's kind, not ``final``, decides
        whether it closes the stream (END and ERROR do). The first frame of a stream is written at
        once, later ones in batches by the frame writer; a refusal that comes later is raised by
        the next ``append_frame`` of the stream (and its ack is refused)."""
        from dreamlake.lakeshore import wire

        try:
            frame = wire.decode_frame(data)
        except ValueError as exc:
            raise BadRequest(f"frame {seq} of {invocation_id} is not one encoded frame: {exc}", 400) from None
        if frame.seq != seq:
            raise BadRequest(f"frame {seq} of {invocation_id} carries its own seq {frame.seq}", 400)
        self._frames.append(invocation_id, attempt, seq, bytes(data), frame.final, worker_id=worker_id)

    def _write_frames(
        self, invocation_id: str, attempt: int, worker_id: str, frames: Sequence[tuple[int, bytes, bool]]
    ) -> None:
        """One batch of the frame writer: one transaction (``store.append_frames``)."""
        results = self.store.append_frames(invocation_id, attempt, frames, worker_id=worker_id)
        refused = next((r for r in results if not r.ok), None)
        if refused is not None:
            raise _refusal(
                f"frames from {refused.seq} of {invocation_id} refused: {refused.reason}", refused.status
            )

    def ack(
        self,
        invocation_id: str,
        state: str,
        *,
        attempt: int,
        worker_id: str,
        result_blob: bytes | None = None,
        error: dict[str, Any] | None = None,
        later: bool = False,  # acks do not ride polls here (acks_ride_polls is False): ignored
    ) -> bool:
        try:
            self._frames.flush(invocation_id)  # the ack follows its frames
        except PlaneError as exc:
            log.warning("ack of %s refused: its frames were: %s", invocation_id, exc)
            return False
        res = self.store.ack(
            invocation_id, state, attempt=attempt, worker_id=worker_id, result_blob=result_blob, error=error
        )
        if not res.ok:
            log.warning("ack of %s refused: %s", invocation_id, res.reason)
        return res.ok

    def heartbeat(self, worker_id: str, running: list[tuple[str, int]]) -> list[str]:
        self._command_marks[worker_id] = self.notifier.mark()
        commands, _lost = self.store.heartbeat(worker_id, running, self.lease_s, running_exec=[])
        return [c.body.get("invocation_id", "") for c in commands if c.kind == "cancel"]

    def wait_commands(self, worker_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a command (a cancel) queued for ``worker_id`` since its last
        heartbeat; True when one may be waiting. Sees changes made in this process at once."""
        since = self._command_marks.get(worker_id)
        return self.notifier.wait([f"worker:{worker_id}"], max(0.0, timeout), since=since)

    def close(self) -> None:
        self._frames.close()
        self.store.close()

    def __enter__(self) -> Dispatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Dispatch store={self.store.kind}>"
