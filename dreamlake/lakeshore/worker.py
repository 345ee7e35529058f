"""``run_worker``: claim invocations of one queue and run them in this process.

The in-process counterpart of nymph, for the local plane, tests and simple deployments. Each job
goes through the same gates as the sandbox entry (``envelope.resolve_fn``): a pickled function runs
only when ``allow_pickled`` is true, which ``None`` resolves by the plane's trust domain (True on
the local SQLite plane, False on any HTTP plane). A refused pickle is acked ``failed`` with the
``PickleRefused`` type.

A generator job appends a VALUE frame per yield while it runs, then END with the return value (or
ERROR with ``{type, message, traceback}``), and then acks. One heartbeat thread, for the worker's
life, renews the leases it holds (a long job's, and those claimed ahead of it) and collects cancels, the same way on both planes: heartbeat answers carry them
(``Plane.heartbeat``): the control plane asks again on every beat that reports a cancelled
invocation running, so a cancel an HTTP poll delivered while the worker was idle reaches it there. A cancel stops a generator job at its next yield
(ERROR frame ``{type: "Cancelled"}``); a plain call cannot be interrupted in process, so when a
cancel arrived while it ran its result is discarded. Either way the outcome is acked ``killed``
with ``{type: "Cancelled", message: "cancelled by producer"}``. On the local plane the heartbeat
thread also wakes as soon as a cancel is queued for the worker (``Dispatch.wait_commands``), so
a cancel lands within milliseconds rather than at the next beat.

The warm path (HTTP plane): the worker's requests share one keep-alive connection; each poll claims
up to ``prefetch`` invocations and carries the acks of the jobs run since the previous poll (each
ack group-committed with that poll's first pass, and its waiting producer answered at that commit), so a short call costs
the worker one request. An ack still waiting for the next poll when the worker stops is sent on
its own.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from functools import partial
from types import FunctionType
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.daemon.entry_outputs import error_info  # the error shape the entry acks too
from dreamlake.lakeshore.daemon.entry_streams import settled
from dreamlake.lakeshore.envelope import Envelope, resolve_fn
from dreamlake.lakeshore.errors import EnvelopeError, PlaneError
from dreamlake.lakeshore.protocol.beats import Beats
from dreamlake.lakeshore.scopes import begin_invocation, end_invocation

if TYPE_CHECKING:
    from dreamlake.lakeshore.dispatch import Claim, Plane
    from dreamlake.lakeshore.queue import SyncQueue
    from dreamlake.lakeshore.wire import Frame

__all__ = ["run_worker"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
CANCELLED = {"type": "Cancelled", "message": "cancelled by producer"}
_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


def _is_generator(fn: Any) -> bool:
    """``inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)``; for a plain function
    (what a ref resolves to) read off its code's flags, as inspect does, without inspect's unwrapping."""
    if type(fn) is FunctionType:
        return bool(fn.__code__.co_flags & _GENERATOR_FLAGS)
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


class _Cancelled(Exception):
    """Raised into the job loop when a cancel for the running invocation arrived."""


class _Superseded(Exception):
    """The plane refused a frame (409): this attempt's lease lapsed and another one owns the job."""


class _Heartbeat:
    """Renews the leases the worker holds and notices cancels, on one daemon thread for the
    worker's life (a short call pays no thread of its own), on the daemons' one cadence
    (:class:`~dreamlake.lakeshore.protocol.beats.Beats`; woken at once by a queued command on a
    plane that can say so). ``hold`` adds claims (the one running and those claimed ahead of
    it), ``release`` drops one once acked."""

    def __init__(self, plane: Plane, worker_id: str, every_s: float) -> None:
        self._held: dict[str, Claim] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._plane, self._worker_id = plane, worker_id
        wake = None
        if plane.wakes_on_commands:
            wake = partial(plane.wait_commands, worker_id)
        self._beats = Beats(f"heartbeat-{worker_id}", every_s, self._beat, wake=wake).start()

    def hold(self, *claims: Claim) -> None:
        with self._lock:
            for claim in claims:
                self._held[claim.invocation_id] = claim

    def release(self, invocation_id: str) -> None:
        with self._lock:
            self._held.pop(invocation_id, None)
            self._cancelled.discard(invocation_id)

    def cancelled(self, invocation_id: str) -> bool:
        return invocation_id in self._cancelled  # one read of a set: atomic, no lock needed

    def _beat(self) -> None:
        with self._lock:
            running = [(c.invocation_id, c.attempt) for c in self._held.values()]
        if not running:
            return
        try:
            cancels = self._plane.heartbeat(self._worker_id, running)
        except Exception as exc:  # a missed beat is retried on the next one
            log.warning("heartbeat for %s failed: %s", ", ".join(i for i, _ in running), exc)
            return
        with self._lock:
            for inv in cancels:
                if inv in self._held and inv not in self._cancelled:  # asked on every beat
                    log.info("cancel received for %s", inv)
                    self._cancelled.add(inv)

    def stop(self) -> None:
        self._beats.stop(timeout_s=5)


class _Job:
    """One claimed invocation: decode, gate, call, journal, ack."""

    def __init__(
        self, plane: Plane, worker_id: str, claim: Claim, allow_pickled: bool, policy: str, later: bool
    ) -> None:
        self.plane, self.worker_id, self.claim = plane, worker_id, claim
        self.allow_pickled, self.policy = allow_pickled, policy
        # the ack rides on the next poll (``HttpDispatch.claim_batch``); a plane without it takes none
        self._later: dict[str, Any] = {"later": True} if later else {}
        self.seq = 0

    def ack(self, state: str, result_blob: bytes | None = None, error: dict[str, Any] | None = None) -> None:
        claim = self.claim
        ok = self.plane.ack(
            claim.invocation_id,
            state,
            attempt=claim.attempt,
            worker_id=self.worker_id,
            result_blob=result_blob,
            error=error,
            **self._later,
        )
        if not ok:
            log.warning("ack %s of %s was refused (superseded or cancelled)", state, self.claim.invocation_id)

    def frame(self, kind: int, body: Any, final: bool = False) -> None:
        self._append(wire.encode_frame(kind, self.seq, body, {"ts": time.time()}), final)

    def _append(self, data: bytes, final: bool) -> None:
        try:
            self.plane.append_frame(
                self.claim.invocation_id, self.seq, data, final, self.claim.attempt, worker_id=self.worker_id
            )
        except PlaneError as exc:
            if exc.status == 409:
                raise _Superseded(str(exc)) from exc
            raise
        self.seq += 1

    def run(self, heartbeat: _Heartbeat) -> str:
        inv = self.claim.invocation_id
        try:
            envelope = Envelope.from_bytes(self.claim.args_blob)
            fn = resolve_fn(envelope.fn, allow_pickled=self.allow_pickled, runtime_policy=self.policy)
            fn = getattr(fn, "__lakeshore_fn__", fn)
            args, kwargs = envelope.unpack_args()
        except (EnvelopeError, ValueError, TypeError) as exc:
            log.warning("refusing %s: %s: %s", inv, type(exc).__name__, exc)
            self.ack("failed", error=error_info(exc))
            return "failed"
        token = begin_invocation(envelope)  # scopes.invocation_context, without its object
        try:
            return self._call(fn, args, kwargs, heartbeat)
        except _Superseded as exc:
            # Nothing more of this attempt is wanted (its ack would be refused too); the
            # worker goes on with the next job instead of dying on the refusal.
            log.warning("invocation %s: attempt %s superseded: %s", inv, self.claim.attempt, exc)
            return "superseded"
        finally:
            end_invocation(token)

    def _call(self, fn: Any, args: Any, kwargs: Any, heartbeat: _Heartbeat) -> str:
        inv = self.claim.invocation_id
        is_gen = _is_generator(fn)
        try:
            if not is_gen:
                blob = wire.pack(settled(fn(*args, **kwargs)))  # an async def: run to completion
                if heartbeat.cancelled(inv):
                    raise _Cancelled()  # the producer no longer wants this result
            elif self.claim.run_config.get("two_way"):
                blob = self._drain_two_way(fn(*args, **kwargs), heartbeat)
            else:
                blob = self._drain(settled(fn(*args, **kwargs)), heartbeat)
        except _Cancelled:
            log.info("invocation %s cancelled", inv)
            if is_gen:
                self.frame(wire.FRAME_ERROR, dict(CANCELLED), final=True)
            self.ack("killed", error=dict(CANCELLED))
            return "killed"
        except _Superseded:
            raise
        except Exception as exc:
            log.info("invocation %s raised %s: %s", inv, type(exc).__name__, exc)
            info = error_info(exc)
            if is_gen:
                self.frame(wire.FRAME_ERROR, info, final=True)
            self.ack("failed", error=info)
            return "failed"
        self.ack("succeeded", result_blob=blob)
        return "succeeded"

    def _drain(self, gen: Any, heartbeat: _Heartbeat) -> bytes:
        """Journal each yield as a VALUE frame, then END with the packed return value."""
        try:
            inv = self.claim.invocation_id
            while True:
                if heartbeat.cancelled(inv):
                    gen.close()
                    raise _Cancelled()
                value = next(gen)
                self.frame(wire.FRAME_VALUE, wire.pack(value))
        except StopIteration as stop:
            blob = wire.pack(stop.value)
        self.frame(wire.FRAME_END, blob, final=True)
        return blob

    def _drain_two_way(self, gen: Any, heartbeat: _Heartbeat) -> bytes:
        """:meth:`_drain` for a two-way body: each VALUE frame names its index (``meta.send``) and
        the body waits at that yield for the send answering it, read from the plane (twoway.py)."""
        from dreamlake.lakeshore import twoway

        inv = self.claim.invocation_id
        timeout_s = twoway.timeout_of(self.claim.run_config)
        answers: dict[int, Frame] = {}

        def emit(value: Any, index: int) -> None:
            data = wire.encode_frame(
                wire.FRAME_VALUE, self.seq, wire.pack(value), {"ts": time.time(), "send": index}
            )
            self._append(data, False)

        def receive(index: int) -> Frame | None:
            deadline = time.monotonic() + timeout_s
            while index not in answers:
                if heartbeat.cancelled(inv):
                    gen.close()
                    raise _Cancelled()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                since = max(answers, default=index - 1)
                got = self.plane.sends(
                    inv, self.claim.attempt, worker_id=self.worker_id, since=since, timeout=min(left, 1.0)
                )
                answers.update((frame.seq, frame) for frame in got)
            return answers.pop(index)

        blob = wire.pack(twoway.drive(gen, emit, receive, timeout_s))
        self.frame(wire.FRAME_END, blob, final=True)
        return blob


def run_worker(
    queue: SyncQueue | str,
    once: bool = False,
    allow_pickled: bool | None = None,
    runtime_policy: str = "minor",
    poll_timeout: float = 30.0,
    *,
    dispatch: Plane | None = None,
    worker_id: str | None = None,
    stop: threading.Event | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    prefetch: int = 1,
) -> str | None:
    """Claim and run invocations of ``queue`` in this process.

    ``once=True`` runs exactly one job, waiting up to ``poll_timeout`` seconds for one to be queued,
    and returns its final state (``None`` when none came). Otherwise it loops, long-polling for
    ``poll_timeout`` at a time, until ``stop`` is set (or KeyboardInterrupt), and returns None.

    The warm path, on a plane that offers it (the HTTP plane's ``claim_batch``): one long-lived
    connection carries the loop, each poll claims up to ``prefetch`` invocations (run one after
    another, their leases renewed meanwhile) and carries the acks of the ones run since the last
    poll, so a short call costs the worker one request. ``prefetch`` > 1 suits many short calls;
    keep 1 for long ones (an invocation claimed ahead waits for the ones before it).
    """
    from dreamlake.lakeshore.queue import SyncQueue

    q = queue if isinstance(queue, SyncQueue) else SyncQueue(queue, dispatch=dispatch)
    plane = dispatch or q.dispatch
    if runtime_policy not in ("strict", "minor", "off"):
        raise ValueError(f"unknown runtime_policy {runtime_policy!r}: use 'strict', 'minor' or 'off'")
    if not poll_timeout > 0:
        raise ValueError(f"poll_timeout must be a positive number of seconds, got {poll_timeout!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    allow = plane.trusted if allow_pickled is None else bool(allow_pickled)
    wid = worker_id or ids.new_ulid()
    later = plane.acks_ride_polls and not once
    log.info("worker %s on queue %s (allow_pickled=%s, policy=%s)", wid, q.name, allow, runtime_policy)
    heartbeat = _Heartbeat(plane, wid, heartbeat_s)
    try:
        while stop is None or not stop.is_set():
            claims = plane.claim_batch(wid, [q.name], poll_timeout, 1 if once else prefetch)
            if not claims:
                if once:
                    return None
                continue
            heartbeat.hold(*claims)
            debug = log.isEnabledFor(logging.DEBUG)  # asked once a poll, not twice a call
            for claim in claims:
                if debug:
                    log.debug("running %s (attempt %s)", claim.invocation_id, claim.attempt)
                try:
                    state = _Job(plane, wid, claim, allow, runtime_policy, later).run(heartbeat)
                finally:
                    heartbeat.release(claim.invocation_id)
                if debug:
                    log.debug("%s %s", claim.invocation_id, state)
                if once:
                    return state
        return None
    finally:
        heartbeat.stop()
        if later:
            try:
                plane.flush_acks(wid)
            except Exception as exc:  # the plane is gone: the leases lapse and the jobs run again
                log.warning("worker %s: the acks queued for the next poll were not sent: %s", wid, exc)
