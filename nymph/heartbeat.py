"""The heartbeat: renews the leases of running invocations and carries commands back.

Every ``interval_s`` (with a little jitter) it posts ``{worker_id, running, running_exec,
free_slots}`` to ``/v1/daemon/heartbeat``: ``running`` the invocations ``{invocation_id,
attempt}`` whose leases nymph holds (the agent lists an invocation until its ack is confirmed:
while it runs, while its frames are delivered, and while its ack waits in the outbox),
``running_exec`` the exec jobs ``{exec_id, attempt}`` whose leases it renews. The
answer carries cancel commands (so a cancel reaches a job even when every slot is busy and nymph
is not polling), ``lost`` ids (another attempt owns them: kill, do not ack or publish) and, when
the namespace pins one, ``target_nymph_version``. ``on_answer`` gets the answer and the entries
reported (those of ``running``, then those of ``running_exec``), since ``lost`` is about those. Failures are logged and the
next beat tries again; the poll loop decides when the agent must stop. The loop around the beat
(cadence, jitter, stop) is the daemons' one: ``protocol/beats.py``, which ``lakeshore worker``
uses too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.protocol.beats import Beats
from nymph.client import ControlPlaneClient, is_retryable

log = logging.getLogger(__name__)

JITTER = 0.1  # each wait in [0.9, 1.0] x interval_s: a fleet started at once spreads out


class Heartbeat:
    """nymph's beat (see the module docstring) on the daemons' one cadence
    (:class:`~dreamlake.lakeshore.protocol.beats.Beats`)."""

    def __init__(
        self,
        client: ControlPlaneClient,
        worker_id: str,
        interval_s: float,
        *,
        running: Callable[[], list[dict[str, Any]]],
        free_slots: Callable[[], int],
        running_exec: Callable[[], list[dict[str, Any]]] | None = None,
        on_answer: Callable[[dict[str, Any], list[dict[str, Any]]], None],
        on_error: Callable[[PlaneError], None] = lambda exc: None,
    ) -> None:
        self._client = client
        self._worker_id = worker_id
        self.interval_s = interval_s
        self._running = running
        self._running_exec = running_exec
        self._free_slots = free_slots
        self._on_answer = on_answer
        self._on_error = on_error
        self._beats = Beats("nymph-heartbeat", interval_s, self.beat, jitter=JITTER)

    def start(self) -> None:
        self._beats.start()

    def stop(self) -> None:
        self._beats.stop(timeout_s=20.0)

    def beat(self) -> None:
        """One heartbeat, now."""
        running = self._running()
        body: dict[str, Any] = {"worker_id": self._worker_id, "running": running}
        execs: list[dict[str, Any]] = []
        if self._running_exec is not None:
            execs = self._running_exec()
            body["running_exec"] = execs
        body["free_slots"] = self._free_slots()
        try:
            answer = self._client.heartbeat(body)
        except PlaneError as exc:
            # an outage is the client's one "control plane went away" line, not one per beat
            log.log(logging.DEBUG if is_retryable(exc) else logging.WARNING, "heartbeat failed: %s", exc)
            self._on_error(exc)
            return
        # with what was reported: an answer is about those attempts
        self._on_answer(answer, running + execs)
