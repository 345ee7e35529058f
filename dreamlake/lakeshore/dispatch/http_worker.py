"""``HttpDispatch``'s worker plane: ``run_worker`` / ``lakeshore worker`` over the daemon routes.

The worker side of :class:`~dreamlake.lakeshore.dispatch.http.HttpDispatch` (its producer side is
``dispatch/http.py``), and the payload store both sides share. Every request goes through the
plane's one client, a :class:`~dreamlake.lakeshore.protocol.producer.ProducerClient` and a
:class:`~dreamlake.lakeshore.protocol.daemon.DaemonClient` over one connection
(:class:`PlaneRoutes`).

A worker registers on its first claim; the register answer says the control plane's limits
(:class:`~dreamlake.lakeshore.protocol.limits.ServerLimits`): its inline threshold (results and
frame bodies over it go up by reference first) and how many acks one poll may carry. Acks queued
with ``ack(later=True)`` ride the next ``claim_batch``; one the store failed (5xx) rides up to
:data:`ACK_TRIES` polls. Frames go in batches (``result-chunks``, one request per batch) through a
frame writer (:mod:`~dreamlake.lakeshore.dispatch.batching`); an ack waits for its frames.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore.dispatch import Claim
from dreamlake.lakeshore.errors import Conflict, PlaneError
from dreamlake.lakeshore.protocol.daemon import SLACK_S, DaemonClient
from dreamlake.lakeshore.protocol.limits import ServerLimits, by_reference
from dreamlake.lakeshore.protocol.producer import ProducerClient
from dreamlake.lakeshore.version import __version__

if TYPE_CHECKING:
    from dreamlake.lakeshore.dispatch.batching import FrameWriter
    from dreamlake.lakeshore.wire import Frame

__all__ = ["ACK_TRIES", "HttpWorkerPlane", "PlaneRoutes"]

log = logging.getLogger("dreamlake.lakeshore.dispatch.http")

ACK_TRIES = 3  # polls an ack the store failed (5xx) rides before it is given up


class PlaneRoutes(ProducerClient, DaemonClient):
    """Both route sets of the control plane over one connection (``HttpDispatch``'s client)."""


class HttpWorkerPlane:
    """The worker methods of :class:`HttpDispatch`, and the payload store both sides use."""

    url: str
    _client: PlaneRoutes
    _frames: FrameWriter
    inline_threshold: int | None  # the producer side's: payloads over it go by reference
    _limits: ServerLimits | None  # the control plane's, from the register answer (a worker's)

    def _init_worker(self) -> None:
        self._registered: set[str] = set()
        self._later: dict[str, list[dict[str, Any]]] = {}  # worker id -> acks for its next poll
        self._ack_tries: dict[str, int] = {}  # invocation id -> polls its ack rode and the store failed
        self._namespace: str | None = None
        self._limits = None

    @property
    def _worker_threshold(self) -> int | None:
        """The control plane's inline threshold (its register answer); None before it, or
        when it has no payload store."""
        return None if self._limits is None else self._limits.inline_threshold_bytes

    # -- payloads by reference ----------------------------------------------------------------------

    def namespace(self) -> str:
        """The namespace this token acts in (presign routes name it): asked once, ``whoami``."""
        if self._namespace is None:
            self._namespace = str(self._client.whoami().get("namespace") or "default")
        return self._namespace

    def _upload(self, data: bytes | list[bytes], job_id: str, kind: str) -> dict[str, Any] | None:
        """``data`` uploaded through the presign route -> its ref; None when the control plane has
        no payload store (501: it takes everything inline, and is not asked again)."""
        from dreamlake.lakeshore import blobs

        try:
            return blobs.put(
                self._client, self.namespace(), data, job_id=blobs.private_job_id(job_id), kind=kind
            )
        except PlaneError as exc:
            if exc.status == 501:
                log.info("%s has no payload store: payloads stay inline", self.url)
                self.inline_threshold = None
                if self._limits is not None:
                    self._limits = ServerLimits(**{**self._limits.to_dict(), "inline_threshold_bytes": None})
                return None
            raise

    def _download(self, ref: Any, what: str) -> bytes:
        from dreamlake.lakeshore import blobs

        data = blobs.get(self._client, self.namespace(), blobs.check_ref(ref, what))
        return bytes(data or b"")

    def _resolve_frame(self, frame: Frame) -> Frame:
        """A frame whose body is ``{"ref": ...}``, with the referenced bytes as its body."""
        from dreamlake.lakeshore import wire

        body = frame.body
        if frame.kind in (wire.FRAME_VALUE, wire.FRAME_END) and isinstance(body, dict) and "ref" in body:
            return frame._replace(body=self._download(body["ref"], f"frame {frame.seq}"))
        return frame

    # -- worker side --------------------------------------------------------------------------------

    def _register(self, worker_id: str, queues: list[str]) -> None:
        answer = self._client.register(
            {
                "worker_id": worker_id,
                "hostname": socket.gethostname(),
                "version": __version__,
                "runner": "in-process",
                "queues": list(queues),
                "labels": {},
                "slots": 1,
            }
        )
        self._limits = DaemonClient.limits_of(answer)
        self._registered.add(worker_id)

    def claim(self, worker_id: str, queues: list[str], timeout: float) -> Claim | None:
        got = self.claim_batch(worker_id, queues, timeout, 1)
        return got[0] if got else None

    def claim_batch(self, worker_id: str, queues: list[str], timeout: float, limit: int) -> list[Claim]:
        """Up to ``limit`` invocations in one long poll (waiting up to ``timeout`` for the first),
        carrying the acks queued by ``ack(..., later=True)``: one request answers those acks (each
        committed with the poll's first pass) and hands out the next work."""
        if worker_id not in self._registered:
            self._register(worker_id, queues)
        per_poll = (self._limits or ServerLimits()).acks_per_poll
        left = max(0.0, timeout)  # the whole wait, the first time (the same read timeout each poll)
        deadline = time.monotonic() + left
        while True:
            body: dict[str, Any] = {
                "worker_id": worker_id,
                "queues": list(queues),
                "max": max(1, int(limit)),
                "kinds": ["run"],  # this worker cannot run exec jobs: never claim one
                "timeout_s": left,
                "version": __version__,
            }
            acks = self._later.pop(worker_id, [])
            if len(acks) > per_poll:  # the rest go with the next polls
                self._later[worker_id], acks = acks[per_poll:], acks[:per_poll]
            if acks:
                body["acks"] = acks
            try:
                out = self._client.poll(body, timeout_s=left)
            except BaseException:
                if acks:  # not known to have landed: they go again, first (an ack is idempotent)
                    self._later.setdefault(worker_id, [])[:0] = acks
                raise
            if acks:
                self._settle_acks(worker_id, acks, out.get("acked") or [])
            claims = self._claims(worker_id, out.get("commands") or [])
            if claims or time.monotonic() >= deadline:
                return claims
            left = max(0.0, deadline - time.monotonic())

    def _settle_acks(self, worker_id: str, acks: list[dict[str, Any]], answers: Any) -> None:
        """A poll's ``acked`` answers to the acks it carried: one the store failed goes again."""
        again = []
        tried = self._ack_tries
        for sent, answer in zip(acks, answers):  # noqa: B905 (Python 3.9 has no strict)
            if answer.get("ok"):  # landed: all there is to do is forget its failed tries
                if tried:
                    tried.pop(str(sent.get("invocation_id")), None)
                continue
            status, inv = answer.get("status"), str(sent.get("invocation_id"))
            failed = isinstance(status, int) and status >= 500
            tries = tried.pop(inv, 0) + 1  # polls it rode that the store failed
            if failed and tries < ACK_TRIES:
                tried[inv] = tries
                again.append(sent)  # the store failed it: it goes again with the next poll
            elif failed:
                log.error(
                    "ack of %s failed in the store %d times, given up: its lease lapses and "
                    "it runs again (%s)", inv, tries, answer.get("error"),
                )  # fmt: skip
            else:
                log.warning(
                    "ack of %s refused (%s): %s",
                    answer.get("invocation_id"),
                    answer.get("status"),
                    answer.get("error"),
                )
        if again:
            self._later.setdefault(worker_id, [])[:0] = again

    def _claims(self, worker_id: str, commands: Any) -> list[Claim]:
        claims: list[Claim] = []
        for cmd in commands:
            if cmd.get("kind") == "run":
                b = cmd["body"]
                args = b.get("args_blob") or b""
                if b.get("args_ref") is not None:
                    args = self._download(b["args_ref"], f"args_ref of {b['invocation_id']}")
                rc = b.get("run_config")
                # the decoded answer's own map is this claim's alone: no copy of it is needed
                run_config = rc if type(rc) is dict else dict(rc or {})
                claims.append(Claim(b["invocation_id"], args, run_config, int(b.get("attempt") or 1)))
            elif cmd.get("kind") == "cancel":
                # the control plane asks again on every heartbeat that reports it running
                log.debug("worker %s: cancel by poll, left to the heartbeat: %s", worker_id, cmd)
            else:
                log.warning("worker %s ignoring a %s command", worker_id, cmd.get("kind"))
        return claims

    def append_frame(
        self, invocation_id: str, seq: int, data: bytes, final: bool, attempt: int, *, worker_id: str
    ) -> None:
        """Queue the frame for the frame writer: batches go to ``result-chunks`` (one request
        each); a refusal is raised by the next ``append_frame`` of the invocation. A frame body
        over the control plane's threshold is uploaded first and sent as ``{"ref": ...}``."""
        limit = self._worker_threshold
        if by_reference(len(data), limit):
            from dreamlake.lakeshore import wire

            frame = wire.decode_frame(bytes(data))
            if isinstance(frame.body, bytes) and by_reference(len(frame.body), limit):
                ref = self._upload(frame.body, invocation_id, f"frame-{seq}")
                if ref is not None:
                    data = wire.encode_frame(frame.kind, frame.seq, {"ref": ref}, frame.meta)
        self._frames.append(invocation_id, attempt, seq, bytes(data), final, worker_id=worker_id)

    def _write_frames(
        self, invocation_id: str, attempt: int, worker_id: str, frames: Sequence[tuple[int, bytes, bool]]
    ) -> None:
        self._client.result_chunks(
            {
                "invocation_id": invocation_id,
                "attempt": attempt,
                "worker_id": worker_id,
                "frames": [data for _seq, data, _final in frames],
            }
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
        later: bool = False,
    ) -> bool:
        """Record the outcome (after the invocation's frames). ``later``: queue it for the
        worker's next ``claim_batch`` instead of a request of its own (True: queued; a refusal
        is logged when that poll answers); ``flush_acks`` sends what is queued."""
        try:
            self._frames.flush(invocation_id)  # the ack follows its frames
        except PlaneError as exc:
            log.warning("ack of %s refused: its frames were: %s", invocation_id, exc)
            return False
        body: dict[str, Any] = {
            "invocation_id": invocation_id,
            "state": state,
            "result_blob": result_blob if type(result_blob) is bytes else bytes(result_blob or b""),
            "error": error,
            "attempt": attempt,
        }
        if result_blob and by_reference(len(result_blob), self._worker_threshold):
            ref = self._upload(bytes(result_blob), invocation_id, "result")
            if ref is not None:
                body["result_blob"] = b""
                body["result_ref"] = ref
        if later:  # the poll that carries it names the worker
            self._later.setdefault(worker_id, []).append(body)
            return True
        body["worker_id"] = worker_id
        try:
            self._client.ack(body)
        except Conflict as exc:
            log.warning("ack of %s refused: %s", invocation_id, exc)
            return False
        return True

    def wait_commands(self, worker_id: str, timeout: float) -> bool:
        """Not here (``wakes_on_commands`` is False): a cancel comes back in a heartbeat's answer
        or with the next poll, so the worker heartbeats on its interval."""
        raise NotImplementedError(
            "HttpDispatch cannot wait for commands (wakes_on_commands is False): "
            "cancels come back in heartbeat and poll answers"
        )

    def flush_acks(self, worker_id: str) -> None:
        """Send the acks ``ack(..., later=True)`` queued for ``worker_id``, each in its own request."""
        for body in self._later.pop(worker_id, []):
            try:
                self._client.ack({**body, "worker_id": worker_id})
            except Conflict as exc:
                log.warning("ack of %s refused: %s", body["invocation_id"], exc)

    def heartbeat(self, worker_id: str, running: list[tuple[str, int]]) -> list[str]:
        out = self._client.heartbeat(
            {
                "worker_id": worker_id,
                "running": [{"invocation_id": i, "attempt": a} for i, a in running],
                "free_slots": 0,
            }
        )
        return [c["body"]["invocation_id"] for c in out.get("commands") or [] if c.get("kind") == "cancel"]

    def sends(
        self, invocation_id: str, attempt: int, *, worker_id: str, since: int, timeout: float
    ) -> list[Frame]:
        from dreamlake.lakeshore import wire

        body = {
            "invocation_id": invocation_id,
            "attempt": attempt,
            "worker_id": worker_id,
            "since": since,
            "wait_s": max(0.0, timeout),
        }
        out = self._client.sends(body, timeout_s=max(0.0, timeout) + SLACK_S)
        return [wire.decode_frame(bytes(f)) for f in out.get("frames") or []]
