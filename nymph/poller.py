"""The poll loop: claim work while a slot is free and the agent may claim.

One thread long-polls ``/v1/daemon/poll``, asking for at most as many commands as there are free
slots, with jitter between empty polls (so a fleet does not poll in lockstep) and exponential
backoff with jitter on transient errors (:func:`retrying`: the one retry policy of the agent's
calls). Before each poll it waits until ``ready()`` (the runner works, the previous life is
reconciled); it stops when ``claiming_stopped()`` (shutdown, a pinned version) or the token is
rejected (``on_auth``). Each answer's commands go to ``dispatch``, and the answer itself to
``on_answer`` (version pinning).

A poll carries the acks the outbox has ready (``take_acks``; see :mod:`nymph.outbox`): they are
written with the claim that refills the slots, so a busy node spends one request per invocation.
Such a poll does not wait (``timeout_s`` 0: its acks are answered at once, and the next poll
waits) and is tried once; its answer's ``acked``, or its failure, goes back to ``acks_answered``
(a failed one hands them to the outbox's sender, and the usual poll follows).
:meth:`Poller.poll_soon` says when another poll is about to start, so the outbox holds an ack put
meanwhile for it: while every slot is busy (the next release starts a poll at once), and while a
poll is in flight after one that claimed work (the queue has a backlog, so it comes back at once).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Any

import tenacity

from dreamlake.lakeshore import __version__
from dreamlake.lakeshore.client import retrying as plane_retrying
from dreamlake.lakeshore.errors import AuthError, PlaneError
from dreamlake.lakeshore.protocol.limits import ServerLimits
from nymph import observability as obs
from nymph.client import ControlPlaneClient
from nymph.config import NymphConfig
from nymph.slots import Slots

log = logging.getLogger(__name__)

GPUS_BUSY_POLL_S = 2.0  # the longest poll while some GPUs are busy: freed ones are offered soon
REFUSED_PAUSE_S = 5.0  # after a poll the control plane refused (not retryable, not auth)


def retrying(stop: threading.Event) -> tenacity.Retrying:
    """Retry retryable control-plane errors until ``stop`` is set: the shared policy (backoff,
    jitter, and at least the server's ``Retry-After``, e.g. a 503 from poll admission control)."""

    def pause(seconds: float) -> None:
        stop.wait(seconds)

    return plane_retrying(
        stop=tenacity.stop_when_event_set(stop),
        initial_s=0.2,
        max_s=15.0,
        jitter_s=1.0,
        sleep=pause,
        # the client's PlaneLink said "control plane went away" once; each try is only a debug line
        before_sleep=lambda rs: log.debug(
            "control plane unavailable (try %d), retrying: %s",
            rs.attempt_number,
            rs.outcome.exception() if rs.outcome else None,
        ),
    )


class Poller:
    """The poll loop in a thread of its own (:meth:`start`)."""

    def __init__(
        self,
        client: ControlPlaneClient,
        config: NymphConfig,
        slots: Slots,
        *,
        worker_id: Callable[[], str],
        stopping: threading.Event,
        claiming_stopped: Callable[[], bool],
        ready: Callable[[], bool],
        dispatch: Callable[[Any], None],
        on_answer: Callable[[dict[str, Any]], None],
        on_auth: Callable[[AuthError], None],
        pet: Callable[[], None],
        take_acks: Callable[[str, int], list[Any]] | None = None,
        acks_answered: Callable[[list[Any], list[Any] | None], None] | None = None,
        labels: dict[str, str] | None = None,
        task_offer: dict[str, Any] | None = None,
    ) -> None:
        self._client = client
        self._config = config
        self._slots = slots
        self._worker_id = worker_id
        self._stopping = stopping
        self._claiming_stopped = claiming_stopped
        self._ready = ready
        self._dispatch = dispatch
        self._on_answer = on_answer
        self._on_auth = on_auth
        self._pet = pet
        self._take_acks = take_acks
        self._acks_answered = acks_answered
        self._labels = dict(labels or {})
        self._task_offer = dict(task_offer or {})  # memory / CPUs one task may have (the runner's)
        # what the control plane allows (acks one poll carries): its register answer's, set by the agent
        self.limits = ServerLimits()
        self.last_ok = False
        self.waiting_for_slot = False  # every slot busy: the next release starts a poll at once
        self._in_flight = False  # a poll request is out
        self._claimed = False  # the last poll's answer had commands
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.loop, name="nymph-poll", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def poll_soon(self) -> bool:
        """Whether a poll (which will carry the acks ready then) is about to start."""
        return self.waiting_for_slot or (self._in_flight and self._claimed)

    def loop(self) -> None:
        while not self._claiming_stopped():
            if not self._ready():
                break
            free = self._slots.free()
            if free <= 0:
                self.waiting_for_slot = True
                try:
                    self._slots.wait_free(1.0)
                finally:
                    self.waiting_for_slot = False
                continue
            if not self._poll_once(free):
                return
        log.info("poll loop stopped: no new claims")

    def _poll_once(self, free: int) -> bool:
        """One long poll and its commands; False when polling must end (token rejected)."""
        timeout_s = self._config.poll_timeout_s
        gpus = self._slots.free_gpus()
        if gpus < self._slots.gpu_total:
            # the offer is what is free now: a poll waiting while GPUs are busy would not offer
            # the ones that free up meanwhile, so it comes back soon (docs/protocol.md "Placement")
            timeout_s = min(timeout_s, GPUS_BUSY_POLL_S)
        worker_id = self._worker_id()
        body: dict[str, Any] = {
            "worker_id": worker_id,
            "queues": list(self._config.queues),
            "max": free,
            "timeout_s": timeout_s,
            "version": __version__,
            "offer": {"gpus": gpus, "labels": self._labels, **self._task_offer},
        }
        if not self._config.allow_exec:  # exec jobs are an opt-in (--allow-exec): never claimed here
            body["kinds"] = ["run"]
        try:
            answer = self._request(body, timeout_s)
        except AuthError as exc:
            obs.POLLS.labels(outcome="auth").inc()
            self._on_auth(exc)
            return False
        except PlaneError as exc:
            obs.POLLS.labels(outcome="error").inc()
            if not self._stopping.is_set():
                log.error("poll refused: %s", exc)
                self._stopping.wait(REFUSED_PAUSE_S)
            return True
        carried = bool(answer.get("acked"))
        self.last_ok = True
        commands = answer.get("commands") or []
        self._claimed = bool(commands)
        obs.POLLS.labels(outcome="claimed" if commands else "empty").inc()
        self._pet()
        for command in commands:
            self._dispatch(command)
        self._on_answer(answer)
        if not commands and not carried:
            # jitter between empty long polls, so a fleet does not poll in lockstep
            self._stopping.wait(random.uniform(0.0, 0.05))
        return True

    def _request(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The poll's answer: carrying the ready acks (:meth:`_poll_with_acks`), else the usual
        poll with retries; :meth:`poll_soon` sees it in flight meanwhile."""
        self._in_flight = True
        answer: dict[str, Any] | None = None
        try:
            answer = self._poll_with_acks(body, timeout_s)
            if answer is None:  # no acks to carry, or their poll failed
                answer = retrying(self._stopping)(self._client.poll, body, timeout_s=timeout_s)
            return answer
        finally:
            self._in_flight = False
            if answer is None:
                self._claimed = False

    def _poll_with_acks(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """One poll carrying the acks the outbox has ready, answered at once (``timeout_s`` 0):
        its answer, or None when there were none or it failed. Tried once: a failure hands the
        acks back to the outbox's sender (their route has its own retries; a refused poll must not
        hold them) and the caller polls as usual."""
        if self._take_acks is None:
            return None
        acks = self._take_acks(str(body["worker_id"]), self.limits.acks_per_poll)
        if not acks:
            return None
        carrying = {**body, "acks": [msg.body for msg in acks], "timeout_s": 0.0}
        try:
            answer = self._client.poll(carrying, timeout_s=timeout_s)
        except BaseException as exc:
            self._answered(acks, None)
            if not isinstance(exc, PlaneError):
                raise
            log.debug("a poll carrying %d ack(s) failed; they go on their own: %s", len(acks), exc)
            return None
        acked = answer.get("acked")
        self._answered(acks, acked if isinstance(acked, list) else None)
        return answer

    def _answered(self, acks: list[Any], answers: list[Any] | None) -> None:
        if self._acks_answered is None:
            return
        try:
            self._acks_answered(acks, answers)
        except Exception:  # the poll loop must not die of it: the acks are still on disk
            log.exception("poll: settling the %d ack(s) it carried failed", len(acks))
