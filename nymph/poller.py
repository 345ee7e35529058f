"""The poll loop: claim work while a slot is free and the agent may claim.

One thread long-polls ``/v1/daemon/poll``, asking for at most as many commands as there are free
slots, with jitter between empty polls (so a fleet does not poll in lockstep) and exponential
backoff with jitter on transient errors (:func:`retrying`: the one retry policy of the agent's
calls). Before each poll it waits until ``ready()`` (the runner works, the previous life is
reconciled); it stops when ``claiming_stopped()`` (shutdown, a pinned version) or the token is
rejected (``on_auth``). Each answer's commands go to ``dispatch``, and the answer itself to
``on_answer`` (version pinning).
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
from nymph import observability as obs
from nymph.client import AuthRejected, ClientError, ControlPlaneClient
from nymph.config import NymphConfig
from nymph.slots import Slots

log = logging.getLogger(__name__)

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
        on_auth: Callable[[AuthRejected], None],
        pet: Callable[[], None],
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
        self.last_ok = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.loop, name="nymph-poll", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def loop(self) -> None:
        while not self._claiming_stopped():
            if not self._ready():
                break
            free = self._slots.free()
            if free <= 0:
                self._slots.wait_free(1.0)
                continue
            if not self._poll_once(free):
                return
        log.info("poll loop stopped: no new claims")

    def _poll_once(self, free: int) -> bool:
        """One long poll and its commands; False when polling must end (token rejected)."""
        timeout_s = self._config.poll_timeout_s
        body = {
            "worker_id": self._worker_id(),
            "queues": list(self._config.queues),
            "max": free,
            "timeout_s": timeout_s,
            "version": __version__,
        }
        try:
            answer = retrying(self._stopping)(self._client.poll, body, timeout_s=timeout_s)
        except AuthRejected as exc:
            obs.POLLS.labels(outcome="auth").inc()
            self._on_auth(exc)
            return False
        except ClientError as exc:
            obs.POLLS.labels(outcome="error").inc()
            if not self._stopping.is_set():
                log.error("poll refused: %s", exc)
                self._stopping.wait(REFUSED_PAUSE_S)
            return True
        self.last_ok = True
        commands = answer.get("commands") or []
        obs.POLLS.labels(outcome="claimed" if commands else "empty").inc()
        self._pet()
        for command in commands:
            self._dispatch(command)
        self._on_answer(answer)
        if not commands:
            # jitter between empty long polls, so a fleet does not poll in lockstep
            self._stopping.wait(random.uniform(0.0, 0.05))
        return True
