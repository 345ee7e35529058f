"""The agent's one table of jobs: invocations and exec jobs together, and the commands about them.

:class:`Jobs` holds every job running here, keyed by ``(kind, id)`` (``("invocation", id)`` or
``("exec", id)``), from its launch until its thread releases it. It turns commands into jobs:

- ``run``: a :class:`~nymph.job.Job` in a slot; a newer attempt of an invocation running here
  makes the older copy lose (killed, not acked) and starts once it is gone; an older or equal
  attempt is a duplicate and ignored;
- ``exec``: an :class:`~nymph.execjob.ExecJob` in a slot; a newer claim of one running here is
  adopted by it, a duplicate ignored;
- ``cancel``: the invocation's job stops with the ladder and acks ``killed``. A cancel for an
  invocation not (yet) running here is remembered for a while (``EARLY_CANCELS``, at most
  ``EARLY_CANCEL_S``): the heartbeat thread can be handed one before the poll thread has entered
  the job of the run command it was just handed, which then starts stopped.

A command that is malformed is logged and skipped, never fatal and never holding a slot. Heartbeat
answers name ``lost`` ids (:meth:`Jobs.lose`): a job loses only if the beat reported its attempt,
so an attempt claimed after that beat runs on. ``running`` and ``running_exec`` of a heartbeat are
:meth:`Jobs.entries` of each kind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import InvalidId
from nymph import observability as obs
from nymph.execjob import ExecJob
from nymph.job import Job
from nymph.lifecycle import JobContext, SupervisedJob
from nymph.slots import Slots, gpus_requested

log = logging.getLogger(__name__)

AnyJob = SupervisedJob[Any]

EARLY_CANCELS = 1024  # cancels remembered for invocations not running here (the oldest go first)
EARLY_CANCEL_S = 300.0  # how long one is remembered


class Jobs:
    """Every job running here (thread-safe); ``context()`` gives a new job what it shares."""

    def __init__(self, slots: Slots, context: Callable[[], JobContext]) -> None:
        self._slots = slots
        self._context = context
        self._table: dict[tuple[str, str], AnyJob] = {}
        self._changed = threading.Condition()
        self._early: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (reason, when)

    # --- the table -------------------------------------------------------------------------------

    def get(self, kind: str, job_id: str) -> AnyJob | None:
        with self._changed:
            return self._table.get((kind, job_id))

    def snapshot(self) -> list[AnyJob]:
        with self._changed:
            return list(self._table.values())

    def ids(self) -> set[str]:
        """The ids of every job running here (for the labelled-task sweep)."""
        with self._changed:
            return {job_id for _, job_id in self._table}

    def entries(self, kind: str) -> list[dict[str, Any]]:
        """The heartbeat entries (``{<kind>_id, attempt}``) of the jobs of ``kind`` with a lease."""
        entries = [job.running_entry for job in self.snapshot() if job.kind == kind]
        return [e for e in entries if e is not None]

    def busy(self) -> bool:
        with self._changed:
            return bool(self._table)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no job runs (True) or ``timeout_s`` passed (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._table, timeout_s)

    def launch(self, job: AnyJob, target: Callable[[], None] | None = None, *, take: bool = True) -> None:
        """Enter ``job`` in the table and start its thread (``target``, :meth:`run` by default)."""
        if take and not self._slots.take():
            self._slots.force_take()
        with self._changed:
            self._table[job.key] = job
            obs.RUNNING.set(len(self._table))
            # a cancel that came before the job was entered (see cancel): it starts stopped
            early = self._early.pop(job.job_id, None) if job.kind == Job.kind else None
        if early is not None and time.monotonic() - early[1] < EARLY_CANCEL_S:
            log.info("%s %s: cancelled before it started: %s", job.kind, job.job_id, early[0])
            job.cancel(early[0])
        job.start_thread(target)

    def done(self, job: AnyJob) -> None:
        """``on_done`` of every job: forget it (unless a newer copy took its place)."""
        with self._changed:
            if self._table.get(job.key) is job:
                del self._table[job.key]
            obs.RUNNING.set(len(self._table))
            self._changed.notify_all()

    # --- commands --------------------------------------------------------------------------------

    def dispatch(self, command: Any) -> None:
        """Handle one command; a malformed one is logged and skipped, never fatal to the caller."""
        try:
            self._dispatch_one(command)
        except Exception:
            cid = command.get("id") if isinstance(command, dict) else None
            log.exception("command %s could not be handled; ignored: %.300r", cid, command)

    def _dispatch_one(self, command: dict[str, Any]) -> None:
        kind = command.get("kind")
        body = command.get("body") or {}
        if not isinstance(body, dict):
            log.error("command %s of kind %r: its body is not a map; ignored", command.get("id"), kind)
            return
        if kind == "run":
            self.start_run(body)
        elif kind == "exec":
            self.start_exec(body)
        elif kind == "cancel":
            self.cancel(
                str(body.get("invocation_id", "")), str(body.get("reason") or "cancelled by producer")
            )
        else:
            log.warning(
                "command %s of kind %r is not supported by this nymph; ignored", command.get("id"), kind
            )

    def start_run(self, body: dict[str, Any]) -> None:
        try:
            invocation_id = ids.validate(body.get("invocation_id"), "invocation_id")
        except InvalidId as exc:
            log.error("run command refused before it touched the disk: %s", exc)
            return
        with obs.log_context(invocation_id=invocation_id):
            try:
                attempt = int(body.get("attempt") or 1)
            except (TypeError, ValueError):
                log.error(
                    "invocation %s: run command refused: attempt %r is not a number",
                    invocation_id,
                    body.get("attempt"),
                )
                return
            earlier = self.get(Job.kind, invocation_id)
            if earlier is not None and (earlier.attempt or 0) >= attempt:
                log.warning(
                    "invocation %s: already running here; duplicate run command ignored", invocation_id
                )
                return
            if earlier is not None:
                # a newer attempt of what runs here: the old copy lost its lease; stop it (no ack)
                # and start the new one once it is gone, so the two never share the workdir
                log.warning(
                    "invocation %s: attempt %d supersedes attempt %d running here",
                    invocation_id,
                    attempt,
                    earlier.attempt,
                )
                earlier.lose()
            after = earlier if isinstance(earlier, Job) else None
            job = Job(self._context(), invocation_id, attempt, body, after=after)
            # its devices now, before the next poll offers them again (nymph/slots.py)
            rc = body.get("run_config")
            gpus = self._slots.take_gpus(gpus_requested(rc if isinstance(rc, dict) else {}))
            if gpus:
                job._gpus = gpus
            self.launch(job)

    def start_exec(self, body: dict[str, Any]) -> None:
        job = ExecJob(self._context(), body)
        with obs.log_context(exec_id=job.exec_id):
            with self._changed:
                running = self._table.get(job.key) if job.exec_id else None
                if running is None:
                    self._table[job.key] = job  # reserved before the slot, so a duplicate sees it
            if isinstance(running, ExecJob):
                # a newer claim of a job still running here: run on, under that attempt
                if not running.adopt(body.get("attempt")):
                    log.warning("exec %s: already running here; duplicate exec command ignored", job.exec_id)
                return
            self.launch(job)

    def cancel(self, invocation_id: str, reason: str) -> None:
        """Stop the invocation's job. One not running here (or only as a copy that lost to a newer
        attempt) is remembered, in the same lock that enters a job in the table (:meth:`launch`),
        so a run command for it handled meanwhile starts stopped."""
        try:
            invocation_id = ids.validate(invocation_id, "invocation_id")
        except InvalidId as exc:
            log.error("cancel command ignored: %s", exc)
            return
        with obs.log_context(invocation_id=invocation_id):
            with self._changed:
                job = self._table.get((Job.kind, invocation_id))
                if job is None or job.lost:
                    self._early.pop(invocation_id, None)
                    self._early[invocation_id] = (reason, time.monotonic())
                    while len(self._early) > EARLY_CANCELS:
                        self._early.popitem(last=False)
            if job is None:
                # also every beat's for an ack still in the outbox: not worth a line each time
                log.debug(
                    "invocation %s: cancel for an invocation not running here; remembered for a "
                    "run command still on its way",
                    invocation_id,
                )
                return
            if job.stop_request is None:  # the heartbeat asks again until the ack lands
                log.info("invocation %s: cancel requested: %s", invocation_id, reason)
            job.cancel(reason)

    def lose(self, lost: list[Any], reported: list[dict[str, Any]]) -> None:
        """A heartbeat answered ``lost``: stop those jobs whose reported attempt another owns now."""
        attempts: dict[tuple[str, str], int] = {}
        for entry in reported:
            for kind, field in ((Job.kind, Job.id_field), (ExecJob.kind, ExecJob.id_field)):
                if field in entry:
                    attempts[(kind, str(entry[field]))] = int(entry["attempt"])
        for lost_id in lost:
            for kind in (Job.kind, ExecJob.kind):
                key = (kind, str(lost_id))
                job = self.get(*key)
                # the beat reported this attempt; a newer attempt claimed since then is not lost
                if job is not None and (job.attempt or 0) <= attempts.get(key, 0):
                    with obs.log_context(**{job.id_field: job.job_id}):
                        log.warning("%s %s: lease lost to another claim; stopping it", kind, lost_id)
                    job.lose()

    def stop_all(self, message: str, grace_s: float, detail: str = "") -> int:
        """Preempt every job (shutdown, drain): the ladder with ``grace_s``, each settles
        ``preempted`` (``detail``: why nymph stops); the number of jobs."""
        jobs = self.snapshot()
        for job in jobs:
            job.preempt(message, grace_s, detail)
        return len(jobs)
