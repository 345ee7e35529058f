"""One supervised job lifecycle, shared by invocations (:mod:`nymph.job`) and exec jobs
(:mod:`nymph.execjob`).

::

    claimed --prepare()--> prepared --runner.start--> started --handle saved--> running --> settled
       |                      |                                                   |
       |  JobRefused          |  stopped before the start                        |  exit status, or
       +----------------------+---------------------------------------------------+  a stop (ladder)

A :class:`SupervisedJob` runs its steps in a thread of its own (:meth:`~SupervisedJob.start_thread`:
an idle one of :data:`JOB_THREADS`, which outlive their jobs, or a new one when none is idle).
While its task runs it holds no thread when it can: a *parkable* job (invocations) whose runner has
an exit fd (:class:`nymph.runner.Watching`: the process runner) is parked in the one supervisor loop
(:mod:`nymph.supervisor`) once started, its thread ends, and the loop hands it back to a pool thread
when the task ended, a stop was requested or its timeout passed; the rest of its lifecycle runs
there, under the same guard. Other runners' jobs wait in their thread (``wait_or_stop``). What
happens at each step is the subclass's (:meth:`~SupervisedJob.prepare` builds the task,
:meth:`~SupervisedJob.supervise` turns the run into an outcome, or :meth:`~SupervisedJob.begin`
and :meth:`~SupervisedJob.end` around a parked wait; :meth:`~SupervisedJob.settle` reports it);
everything around the steps is here, once:

- **stop requests**: :meth:`~SupervisedJob.cancel` (``killed``), :meth:`~SupervisedJob.preempt`
  (``preempted``: nymph stops, its grace expired), :meth:`~SupervisedJob.lose`
  (``lost``: another attempt owns the job, nothing is reported) and the job's timeout (``timeout``,
  counted from the claim) become one :class:`Stop`; a request sets a :class:`threading.Event` that
  wakes every wait of the job, and a running task is stopped with the runner's ladder;
- **retry while the runner is unavailable** (:meth:`~SupervisedJob.when_available`): ``start``,
  ``recover`` and ``wait`` are tried again with backoff and jitter while the runner raises
  :class:`~nymph.runner.RunnerUnavailable`; the job stays claimed (the heartbeat renews its lease)
  and the agent is told (``JobContext.on_unavailable``), so it stops claiming until
  ``runner.check()`` passes again;
- **the one exception guard** (:meth:`~SupervisedJob.guarded`): an unexpected exception anywhere
  in a job's lifecycle is logged and the job settles ``failed`` with ``{type: "DaemonError",
  message: "nymph failed: <type>: <message>"}``; no exception escapes a job's thread, and the
  runner's resources are freed whatever failed. A full disk (``OSError`` ``ENOSPC`` / ``EDQUOT``,
  e.g. ``nymph failed: OSError: [Errno 28] No space left on device``) is an outcome, not a bug:
  one log line without a traceback, and the agent is told (``JobContext.on_disk_full``), so it
  stops claiming until there is room (:class:`nymph.health.DiskHealth`);
- **release**: the GPUs, the agent's table entry (``on_done``) and the slot, in that order.

A job settles at most once: the phase is ``settled`` before the outcome is reported, so a failure
while reporting is logged, never reported twice.
"""

from __future__ import annotations

import abc
import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from dreamlake.lakeshore import backoff
from nymph import observability as obs
from nymph import taskuser
from nymph.config import NymphConfig
from nymph.errors import JobRefused, is_disk_full
from nymph.outbox import Outbox
from nymph.runner import (
    ExitStatus,
    Handle,
    Runner,
    RunnerError,
    RunnerUnavailable,
    Task,
    Watching,
    Withdrawing,
)
from nymph.slots import Slots

if TYPE_CHECKING:
    from nymph.client import ControlPlaneClient
    from nymph.supervisor import Parked, Supervisor

log = logging.getLogger(__name__)

WAIT_STEP_S = 0.2  # one runner.wait step: how soon a stop request reaches a running task
STOP_WAIT_S = 5.0  # after the ladder, how long to wait for the task's exit
# a started task that ends within this is concluded on the thread that started it, not parked: a
# short call saves the supervisor's hand-over (an epoll registration, a wake-up, a pool thread)
PARK_AFTER_S = 0.05
RETRY_MAX_S = 10.0  # the longest pause between two tries of an unavailable runner
SHUTDOWN_MESSAGE = "daemon shutdown grace expired"

T = TypeVar("T")
OutcomeT = TypeVar("OutcomeT")  # what a job settles with: a workdir Outcome, an exec result


def backoff_s(tries: int, cap: float = RETRY_MAX_S) -> float:
    """Exponential backoff with full jitter: the pause before try ``tries + 1`` (0.5 s, 1 s, 2 s ...)."""
    return backoff.backoff_s(tries, base=0.5, cap=cap, doublings=10)


def parse_timeout(value: Any, what: str) -> tuple[float | None, str | None]:
    """``(seconds, None)``; ``(None, None)`` for no timeout; ``(None, why)`` for a bad value."""
    if value in (None, "", 0):
        return None, None
    try:
        return float(value), None
    except (TypeError, ValueError):
        return None, f"{what} {value!r} is not a number of seconds"


def _ignore_unavailable(exc: RunnerUnavailable) -> None:
    pass


_WATCHING: dict[type, bool] = {}  # runner class -> whether it is Watching (a Protocol check is slow)


def _watching(runner: Runner) -> bool:
    kind = type(runner)
    known = _WATCHING.get(kind)
    if known is None:
        known = _WATCHING[kind] = isinstance(runner, Watching)
    return known


def _forget(job: SupervisedJob[Any]) -> None:
    pass


def _ignore_disk_full(exc: BaseException) -> None:
    pass


@dataclass
class JobContext:
    """What every job shares with the agent."""

    config: NymphConfig
    runner: Runner
    outbox: Outbox
    slots: Slots
    worker_id: str
    on_done: Callable[[SupervisedJob[Any]], None] = field(default=_forget)
    # the runner said it cannot work (engine down): the agent stops claiming until check() passes
    on_unavailable: Callable[[RunnerUnavailable], None] = field(default=_ignore_unavailable)
    client: ControlPlaneClient | None = None  # exec jobs fetch their payload through it
    # results and frames over this many bytes go to the payload store (the register answer's
    # inline_threshold_bytes; None: the control plane has no payload store, everything inline)
    inline_threshold: int | None = None
    # a job met a full disk (ENOSPC, EDQUOT): the agent stops claiming until there is room
    on_disk_full: Callable[[BaseException], None] = field(default=_ignore_disk_full)
    # the one loop running tasks wait in (nymph.supervisor); None: each job waits in its own thread
    supervisor: Supervisor | None = None


class Phase(enum.Enum):
    CLAIMED = "claimed"
    PREPARED = "prepared"
    STARTED = "started"
    RUNNING = "running"
    SETTLED = "settled"


@dataclass(frozen=True)
class Stop:
    """Why a job stops before its task ends: ``killed`` (cancel), ``timeout``, ``preempted`` (nymph
    stops: its shutdown or drain grace expired), ``lost``."""

    reason: str
    message: str
    grace_s: float
    detail: str = ""  # a preemption's cause (the ack's error.reason): SIGTERM, drain


_PARKED = object()  # what a lifecycle body returns when it parked the job (its thread ends, not the job)


class JobThreads:
    """Daemon threads for job bodies, one body at a time each: a body goes to an idle thread when
    there is one, else to a new thread; a thread idle for ``idle_s`` ends. A busy nymph so starts
    no thread per job (a thread's start and end cost about twice a hand-over to one that waits),
    and a body never waits for a thread (each may block for its task's whole run)."""

    def __init__(self, idle_s: float = 30.0) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a body that no run() has counted on yet
        self._bodies: queue.SimpleQueue[tuple[Callable[[], None], str]] = queue.SimpleQueue()
        self._names = itertools.count(1)

    def run(self, body: Callable[[], None], name: str) -> None:
        with self._lock:
            handed = self._idle > 0
            if handed:
                self._idle -= 1
        if handed:
            self._bodies.put((body, name))
        else:
            threading.Thread(target=self._serve, args=(body, name), name=name, daemon=True).start()

    def _serve(self, body: Callable[[], None], name: str) -> None:
        me = threading.current_thread()
        while True:
            me.name = name
            try:
                body()
            except BaseException:  # a body guards itself (SupervisedJob.guarded); this thread goes on
                log.exception("job thread: %s raised", name)
            me.name = f"nymph-job-idle-{next(self._names)}"
            with self._lock:
                self._idle += 1
            while True:
                try:
                    body, name = self._bodies.get(timeout=self.idle_s)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # no run() counts on a waiting thread: one of them ends
                            self._idle -= 1
                            return
                    # every waiting thread was counted on: a body is on its way


JOB_THREADS = JobThreads()


class SupervisedJob(abc.ABC, Generic[OutcomeT]):
    """The lifecycle of one claimed job; subclasses say what each step does."""

    kind: ClassVar[str]  # "invocation" or "exec": log lines, thread names, the agent's table
    id_field: ClassVar[str]  # the id's name in heartbeat entries and in JSON log lines
    timeout_field: ClassVar[str]  # where the timeout came from, for the timeout message
    # whether a running task may wait in the supervisor loop (begin / end split supervise)
    parkable: ClassVar[bool] = False

    def __init__(self, ctx: JobContext, job_id: str, attempt: int | None, timeout: Any) -> None:
        self.ctx = ctx
        self.job_id = job_id
        self.attempt = attempt  # None: nothing to renew (an exec job from before exec leases)
        self.timeout_s, self.bad_timeout = parse_timeout(timeout, self.timeout_field)
        self.started_at = time.time()  # the claim; a recovered job keeps its first life's
        self.phase = Phase.CLAIMED
        self.workdir: Path | None = None
        self.handle: Handle | None = None
        self.stop_request: Stop | None = None
        self.lost = False
        self._gpus: list[str] = []
        self._stop_event = threading.Event()
        self._destroyed = False
        self._launched = False  # start_thread() was called
        self._parked: Parked | None = None  # waiting in the supervisor loop, no thread of its own
        self._finished = threading.Event()  # released: the whole lifecycle is over

    # --- control from other threads --------------------------------------------------------------

    @property
    def key(self) -> tuple[str, str]:
        """The job's key in the agent's table: invocation and exec ids are separate spaces."""
        return (self.kind, self.job_id)

    @property
    def running_entry(self) -> dict[str, Any] | None:
        """This job's entry of a heartbeat (its lease is renewed); None without an attempt."""
        if self.attempt is None or not self.job_id:
            return None
        return {self.id_field: self.job_id, "attempt": self.attempt}

    def cancel(self, message: str = "cancelled", grace_s: float | None = None) -> None:
        """Stop the job (the ladder, with ``grace_s``); it settles as stopped with ``message``."""
        grace = self.ctx.config.stop_grace_s if grace_s is None else grace_s
        self._request(Stop("killed", message, grace))

    def preempt(self, message: str, grace_s: float, detail: str = "") -> None:
        """nymph stops under the job: the ladder with ``grace_s``; it settles ``preempted``."""
        self._request(Stop("preempted", message, grace_s, detail))

    def before_stop(self, stop: Stop) -> None:
        """Just before the ladder stops the task (a job tells its task why)."""

    def lose(self) -> None:
        """Another attempt owns the job: stop it at once and report nothing."""
        self.lost = True
        self._request(Stop("lost", "lease lost to another attempt", 0.0))

    def _request(self, stop: Stop) -> None:
        if self.stop_request is None or stop.reason == "lost":
            self.stop_request = stop
        self._stop_event.set()
        parked, supervisor = self._parked, self.ctx.supervisor
        if parked is not None and supervisor is not None:  # hand it back: its wait runs the ladder
            supervisor.poke(parked)

    def start_thread(self, target: Callable[[], None] | None = None) -> None:
        """Run ``target`` (:meth:`run` by default) in a thread of the job's own (:data:`JOB_THREADS`)."""
        self._launched = True
        JOB_THREADS.run(target or self.run, f"nymph-{self.kind}-{self.job_id}")

    def join(self, timeout: float | None = None) -> None:
        """Wait until the job's lifecycle is over (released), parked time included."""
        if self._launched:
            self._finished.wait(timeout)

    # --- the steps, the subclass's ---------------------------------------------------------------

    @abc.abstractmethod
    def prepare(self) -> Task | None:
        """claimed -> prepared: check, write the workdir, build the task. Raise JobRefused to
        refuse (nothing spawned); None when a stop arrived meanwhile."""

    @abc.abstractmethod
    def supervise(self, handle: Handle) -> OutcomeT:
        """running: follow the task to its end (:meth:`wait_or_stop`) and return its outcome."""

    @abc.abstractmethod
    def settle(self, outcome: OutcomeT) -> None:
        """Report the outcome (unless lost) and clean up; called once."""

    @abc.abstractmethod
    def failure(self, type_: str, message: str) -> OutcomeT:
        """The outcome of a job that failed before or without its task's verdict."""

    @abc.abstractmethod
    def stopped(self, stop: Stop) -> OutcomeT:
        """The outcome of a job stopped by ``stop``."""

    def start_refused(self, exc: RunnerError) -> OutcomeT:
        """The outcome when the runner refuses to start the task."""
        return self.failure(type(exc).__name__, str(exc))

    # a parkable job splits supervise() in two: begin() before the wait, end() waits and concludes

    def begin(self, handle: Handle) -> None:
        """running, before the wait (a parkable job: open what follows the task, e.g. its stream)."""

    def end(self, handle: Handle) -> OutcomeT:
        """running: wait for the task (:meth:`wait_or_stop`) and return its outcome (after begin)."""
        raise NotImplementedError

    def abandon(self) -> None:
        """begin() happened but end() never will (parking failed): close what begin() opened."""

    # --- the lifecycle ---------------------------------------------------------------------------

    def run(self) -> None:
        """Thread body for a freshly claimed job."""
        self.guarded(self._run_new)

    def guarded(self, body: Callable[[], object]) -> None:
        """Run one lifecycle ``body`` under the job's log context and the one exception guard.

        A body that parked the job (returns ``_PARKED``) leaves the release to the body the
        supervisor hands the job back to, which runs under this guard again."""
        with obs.log_context(**{self.id_field: self.job_id}):
            parked = False
            try:
                parked = body() is _PARKED
            except Exception as exc:  # never leave a claimed job unsettled, never crash its thread
                message = f"nymph failed: {type(exc).__name__}: {exc}"
                if is_disk_full(exc):  # an outcome of a full disk, not a bug: one line, no traceback
                    log.error("%s %s: %s", self.kind, self.job_id, message)
                    self.ctx.on_disk_full(exc)
                else:
                    log.exception("%s %s: nymph failed while running it", self.kind, self.job_id)
                self._settle_once(self.failure("DaemonError", message))
            finally:
                if not parked:
                    self._release()

    def _run_new(self) -> object:
        stop = self.due_stop()
        if stop is not None:  # cancelled before it began (nymph had the cancel before the run command)
            self._settle_once(self.stopped(stop))
            return None
        try:
            task = self.prepare()
        except JobRefused as exc:
            log.warning("%s %s: refused: %s: %s", self.kind, self.job_id, exc.type, exc.message)
            self._settle_once(self.failure(exc.type, exc.message))
            return None
        self.phase = Phase.PREPARED
        stop = self.due_stop()
        if task is None or stop is not None:
            self._settle_once(self.stopped(stop or Stop("killed", "cancelled", 0.0)))
            return None
        try:
            handle = self.when_available("starting", lambda: self.ctx.runner.start(task), timed=True)
        except RunnerError as exc:
            log.warning("%s %s: runner %s refused it: %s", self.kind, self.job_id, self.ctx.runner.name, exc)
            self._settle_once(self.start_refused(exc))
            return None
        if handle is None:  # stopped (cancel, shutdown, lost lease, timeout) while the runner was down
            # settled first: a withdrawal may wait out the runner's timeout before it is deferred
            self._settle_once(self.stopped(self.due_stop() or Stop("killed", "cancelled", 0.0)))
            self._withdraw(task)
            return None
        self.handle = handle
        self.phase = Phase.STARTED
        fd = self._exit_fd(handle)
        if fd is not None:
            return self._park(handle, fd)
        self.conclude(lambda: self._started(handle))
        return None

    def _withdraw(self, task: Task) -> None:
        """Stopped while the start was tried again (once the job settled), or a restarted nymph
        releases an attempt no start of which was answered: such a start may have started the task
        after all, and nobody would supervise it. A runner that can (``Capabilities.withdraw``)
        withdraws it, now or once it answers again (:class:`~nymph.runner.Withdrawing`)."""
        runner = self.ctx.runner
        if not runner.capabilities.withdraw:
            return
        try:
            cast(Withdrawing, runner).withdraw(task)
        except RunnerUnavailable as exc:  # the runner withdraws it once it answers again
            log.warning(
                "%s %s: runner %s unavailable; withdrawn later: %s", self.kind, self.job_id, runner.name, exc
            )
            self.ctx.on_unavailable(exc)
        except RunnerError as exc:
            log.warning("%s %s: withdrawing an unanswered start failed: %s", self.kind, self.job_id, exc)

    def _running(self, handle: Handle) -> None:
        if self.workdir is not None:
            handle.save(self.workdir)
        log.info(
            "%s %s: started (attempt %s, runner %s)",
            self.kind,
            self.job_id,
            self.attempt,
            self.ctx.runner.name,
        )
        self.phase = Phase.RUNNING

    def _started(self, handle: Handle) -> OutcomeT:
        self._running(handle)
        return self.supervise(handle)

    # --- parked in the supervisor loop -----------------------------------------------------------

    def _exit_fd(self, handle: Handle) -> int | None:
        """The runner's fd that says the task ended, when this job may wait in the supervisor."""
        runner = self.ctx.runner
        if not self.parkable or self.ctx.supervisor is None or not runner.capabilities.exit_fd:
            return None
        if not _watching(runner):
            return None
        try:
            return cast(Watching, runner).exit_fd(handle)
        except RunnerError as exc:
            log.warning("%s %s: no exit fd, waiting in a thread: %s", self.kind, self.job_id, exc)
            return None

    def _park(self, handle: Handle, fd: int) -> object:
        """running, with no thread: the supervisor hands the job back (:meth:`_unpark`) once the
        task ended, a stop was requested or the timeout passed; whatever fails before the job is
        parked frees the task, as :meth:`conclude` does."""
        supervisor = self.ctx.supervisor
        assert supervisor is not None
        try:
            self._running(handle)
            self.begin(handle)
            ended = self._ended_soon(handle)
            if not ended:
                try:
                    self._parked = supervisor.park(
                        f"{self.kind}-{self.job_id}", fd, self.deadline, lambda: self.guarded(self._unpark)
                    )
                except BaseException:
                    self.abandon()
                    raise
        except BaseException:
            self.destroy()  # no process, container or pod outlives its job
            raise
        if ended:  # a short task: its outcome on this thread, as the supervisor would hand it back
            self.conclude(lambda: self.end(handle))
            return None
        parked = self._parked
        if self.stop_request is not None and parked is not None:  # requested while parking
            supervisor.poke(parked)
        return _PARKED

    def _ended_soon(self, handle: Handle) -> bool:
        """Whether the task ended within :data:`PARK_AFTER_S` (no stop requested meanwhile)."""
        if self.stop_request is not None:
            return False
        try:
            ended = self.ctx.runner.wait(handle, PARK_AFTER_S) is not None
        except Exception as exc:  # the parked wait meets it again, in end(), which closes the stream
            log.debug("%s %s: a first wait failed (%s); parked", self.kind, self.job_id, exc)
            return False
        return ended and self.stop_request is None

    def _unpark(self) -> None:
        """Handed back by the supervisor (on its pool): the wait returns at once, then conclude."""
        self._parked = None
        handle = self.handle
        assert handle is not None
        self.conclude(lambda: self.end(handle))

    def conclude(self, produce: Callable[[], OutcomeT]) -> None:
        """Produce the outcome (which may still read the task), free the task whatever happened, settle."""
        try:
            outcome = produce()
        finally:  # no process, container or pod outlives its job
            self.destroy()
        self._settle_once(outcome)

    def _settle_once(self, outcome: OutcomeT) -> None:
        if self.phase is Phase.SETTLED:
            return
        self.phase = Phase.SETTLED
        try:
            self.settle(outcome)
        except Exception:
            log.exception("%s %s: reporting its outcome failed", self.kind, self.job_id)

    def _release(self) -> None:
        try:
            self.ctx.slots.release_gpus(self._gpus)
            self._gpus = []
            taskuser.task_users(self.ctx.config).release(self)  # its pool user, for the next task
            # forget the job before freeing its slot: a poll woken by the slot may claim its next attempt
            self.ctx.on_done(self)
        except Exception:
            log.exception("%s %s: releasing it failed", self.kind, self.job_id)
        finally:
            self.ctx.slots.put()
            self._finished.set()

    # --- waits and stops -------------------------------------------------------------------------

    @property
    def deadline(self) -> float | None:
        return self.started_at + self.timeout_s if self.timeout_s else None

    def due_stop(self) -> Stop | None:
        """The stop to act on now: a request, else the timeout once past; None to carry on."""
        if self.stop_request is not None:
            return self.stop_request
        deadline = self.deadline
        if deadline is not None and time.time() >= deadline:
            message = f"timed out after {self.timeout_s:g}s ({self.timeout_field})"
            return Stop("timeout", message, self.ctx.config.stop_grace_s)
        return None

    def when_available(self, doing: str, op: Callable[[], T], *, timed: bool = False) -> T | None:
        """``op()``, tried again with backoff and jitter while the runner is unavailable.

        The job stays claimed meanwhile and the agent is told each time. None when a stop request
        arrived meanwhile (or, when ``timed``, the timeout passed). Other errors propagate.
        """
        tries = 0
        while True:
            try:
                return op()
            except RunnerUnavailable as exc:
                delay = backoff_s(tries)
                tries += 1
                log.warning(
                    "%s %s: runner %s unavailable while %s (try %d), kept claimed, retrying in %.1fs: %s",
                    self.kind, self.job_id, self.ctx.runner.name, doing, tries, delay, exc,
                )  # fmt: skip
                self.ctx.on_unavailable(exc)
                deadline = self.deadline if timed else None
                if deadline is not None:
                    delay = min(delay, max(0.0, deadline - time.time()))
                self._stop_event.wait(delay)
                if self.stop_request is not None or (timed and self.due_stop() is not None):
                    return None

    def wait_or_stop(self, handle: Handle) -> ExitStatus | Stop:
        """Wait for the task, stepwise; when a stop is due, the ladder (``runner.stop``) and the stop."""
        runner = self.ctx.runner
        while True:
            stop = self.due_stop()
            if stop is not None:
                log.info(
                    "%s %s: stopping (%s), grace %.1fs", self.kind, self.job_id, stop.reason, stop.grace_s
                )
                try:
                    self.before_stop(stop)
                    runner.stop(handle, stop.grace_s)
                    runner.wait(handle, STOP_WAIT_S)
                except RunnerUnavailable as exc:  # the labelled task is collected by a later start
                    log.warning("%s %s: could not stop the task: %s", self.kind, self.job_id, exc)
                    self.ctx.on_unavailable(exc)
                return stop
            status = self.when_available("waiting", lambda: runner.wait(handle, WAIT_STEP_S), timed=True)
            if status is not None:
                return status

    def destroy(self) -> None:
        """``runner.destroy`` once (it is idempotent, but one call is enough)."""
        if self.handle is None or self._destroyed:
            return
        self._destroyed = True
        try:
            self.ctx.runner.destroy(self.handle)
        except RunnerError as exc:
            log.warning("%s %s: destroy failed: %s", self.kind, self.job_id, exc)
