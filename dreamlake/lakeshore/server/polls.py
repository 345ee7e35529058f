"""The daemons' long polls, woken one per unit of new work: no thundering herd.

Each waiting ``POST /v1/daemon/poll`` holds a :class:`Ticket` of the :class:`PollHub`. While it
waits, the ticket is in the FIFO of every (queue, namespace) it serves, for invocations and (when
it takes exec jobs) for exec jobs, with namespace ``None`` for a daemon token bound to none, which
takes every namespace's work; and under its worker id. The hub listens to the store notifier
(``store/notify.py``) and routes each notification itself:

- ``run-queue:<ns>:<q>`` (an invocation) and ``exec-queue:<ns>:<q>`` (an exec job) wake the
  longest-waiting poll that may claim that work: the older head of the ``(q, ns)`` and
  ``(q, None)`` FIFOs, so daemons bound to different namespaces can share a queue name;
- ``worker:<id>`` wakes the polls of that worker (a cancel, or an exec job aimed at it).

A woken poll leaves every FIFO at once (a poll of several queues is woken once) and runs one store
pass; one that finds nothing waits again, at the back. What keeps a wake-up from being lost:

- A wake with no waiter is kept, with its notifier position, and taken by the first poll that
  starts waiting with an older ``since`` (its pass may have missed that work). A poll that starts
  waiting after a fruitless pass drops the kept wakes its pass saw: it ran after them and found
  nothing it could claim, so that work is gone.
- The store notifies once per unit of work. A woken poll spends its wake by claiming work of
  that kind, or by a pass with room to spare; a pass filled with other work (a poll of several
  queues, an unbound poll taking another namespace's exec job) hands it on (:meth:`Ticket.settle`).
- A woken poll that ends without a pass (the daemon hung up, the pass failed) hands it on too.
- A wake no local poll can take goes to the relay (``server/relay.py``), for other replicas.

**Hand-off.** A submit does not wait for its wake to reach a poll and that poll's pass to reach
the writer: when the group commit takes a batch with submits, each new invocation's head waiting
poll (as :meth:`PollHub._first` picks it) leaves the hub with the wake in hand, and its pass
(:attr:`Ticket.prepare`) joins the submits' own transaction, right after them
(:meth:`PollHub.hand_off`). The poll wakes with ``handed`` and the pass's answer. The store sends
that submit no ``run-queue`` notification: its wake is the handed poll's, settled by its pass like
any other. One transaction and one writer round trip less between a submit and its claim.

**Placement.** A call that needs something (GPUs, labels: store/placement.py) is announced on
``run-queue:<ns>:<q>:<shape>``; the hub wakes the longest-waiting poll of the queue whose
offer fits that shape (:attr:`PollHub.needs_of` names the shape's needs), so a wake is not spent
by a pass that could not have claimed the call.

Every wait also ends after a safety re-check (``poll_recheck_s``, jittered); while wake-ups from
other replicas may be missed (PostgreSQL LISTEN not connected) the re-check is ``recheck_s``.
Everything here runs on the event loop; only :meth:`PollHub._listener` runs in store threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.store.api import DEFAULT_NAMESPACE, PollRequest, SubmitRequest
from dreamlake.lakeshore.store.notify import Notifier, exec_queue_channel, run_queue_channel
from dreamlake.lakeshore.store.placement import NO_OFFER, PLAIN, Needs, Offer, needs_of

log = logging.getLogger(__name__)

RUN, EXEC = "run", "exec"
KEPT_PER_QUEUE = 4096  # wakes kept for a queue with no waiter; older ones fall off
KEPT_FOR_S = 120.0  # a kept wake is for a poll in the middle of its pass: none takes this long
MAX_HANDOFFS = 64  # passes joined to one group commit's submits at most (each is a claim statement)
_RUN_QUEUE, _EXEC_QUEUE, _WORKER = "run-queue:", "exec-queue:", "worker:"
_ROUTED = (_RUN_QUEUE, _EXEC_QUEUE, _WORKER)  # ``queue:<q>`` keeps the notifier's wake-all

# Why a wait ended (and why the poll's next store pass runs): the ``reason`` label of the
# ``lakeshore_poll_passes`` counter, with "first" for the pass a poll opens with.
WOKEN, WORKER, RECHECK, TIMEOUT = "woken", "worker", "recheck", "timeout"
SHUTDOWN = "shutdown"  # the server is stopping (:meth:`PollHub.drain`): answer empty now
HANDED = "handed"  # the poll's pass ran in a submit's transaction: its answer is ``Ticket.handed``
HANGUP = "hangup"  # the daemon closed its connection: nobody will read an answer

_K = TypeVar("_K")
_F = TypeVar("_F", bound="dict[int, Ticket]")


@dataclass(frozen=True)
class Wake:
    """One unit of new work of ``namespace`` on ``queue``: an invocation (``RUN``) or an exec job."""

    kind: str
    queue: str
    namespace: str
    shape: str = PLAIN  # an invocation's placement shape

    @property
    def channel(self) -> str:
        if self.kind == RUN:
            return run_queue_channel(self.namespace, self.queue, self.shape)
        return exec_queue_channel(self.namespace, self.queue)


def parse_wake(channel: str) -> Wake | None:
    """The work a ``run-queue:`` or ``exec-queue:`` channel announces; None for other channels."""
    for prefix, kind in ((_RUN_QUEUE, RUN), (_EXEC_QUEUE, EXEC)):
        if channel.startswith(prefix):
            namespace, sep, queue = channel[len(prefix) :].partition(":")
            queue, _, shape = queue.partition(":")
            if sep and namespace and queue:
                return Wake(kind, queue, namespace, shape if kind == RUN else PLAIN)
            return None
    return None


class Relay(Protocol):
    """Carries wake-ups to other replicas (``server/relay.py``)."""

    @property
    def listening(self) -> bool: ...

    def publish(self, channel: str) -> None: ...


class PollsFull(Exception):
    """The hub serves its limit of concurrent long polls (admission control: 503 + Retry-After)."""


class Ticket:
    """One long poll's place in the hub, for the lifetime of its request."""

    def __init__(
        self,
        hub: PollHub,
        worker_id: str,
        queues: list[str],
        *,
        takes_exec: bool,
        namespace: str | None,
        offer: Offer = NO_OFFER,
    ) -> None:
        self.hub = hub
        self.offer = offer
        self.worker_id = worker_id
        self.queues = tuple(dict.fromkeys(queues))
        self.takes_exec = takes_exec
        self.namespace = namespace
        self.id = 0  # registration order while waiting (lower: waited longer); 0 when not waiting
        self.woken: list[Wake] = []  # wakes handed to this poll and not yet settled by a pass
        # what its next pass writes, for a hand-off: called on the loop with nothing, it returns
        # (the write, anything the poll needs back); None: this poll is never handed work
        self.prepare: Callable[[], tuple[PollRequest, Any]] | None = None
        # a hand-off's (the second of prepare's pair, the write's answer), taken by the poll
        self.handed: tuple[Any, Any] | None = None
        # its pass is in the store now (a hand-off): its wakes wait for that pass's commit, even
        # if the daemon hangs up meanwhile (handed on earlier, a pass elsewhere could run before
        # the submit is committed, find nothing and spend the wake)
        self.handing = False
        self._future: asyncio.Future[str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0

    async def wait(self, timeout: float, since: int, hangup: asyncio.Future[Any] | None = None) -> str:
        """Wait for work after a fruitless pass that started at notifier position ``since``.

        Returns why it ended: ``woken`` (work for this poll), ``worker`` (a command for its worker),
        ``recheck`` (the safety re-check), ``timeout`` (``timeout`` seconds passed), ``shutdown``
        (the server is stopping) or ``hangup`` (``hangup``, the watch on the daemon's connection,
        is done: the poll leaves the hub at once instead of holding its place, and the wakes
        handed to it, until its deadline)."""
        return await self.hub._wait(self, timeout, since, hangup)

    def settle(self, claimed: list[Wake], limit: int) -> None:
        """After a store pass that claimed ``claimed`` (one entry per invocation or exec job) of at
        most ``limit``: spend each wake this poll holds, or hand it on.

        A wake is spent by a claim of its own kind (queue and namespace), or by a pass with room
        to spare (nothing of its kind was left to claim). A full pass of other work hands it on: a
        poll of several queues, or an unbound one taking another namespace's work, may have
        claimed the work whose wake went to another poll, and left this one's. So does a pass with
        room whose offer cannot take the wake's shape (a shape this replica did not know when the
        wake was routed): its work is still there, for a poll that fits."""
        wakes, self.woken = self.woken, []
        if not wakes:
            return
        units = list(claimed)
        room = len(units) < limit
        unused = []
        for wake in wakes:
            if wake in units:
                units.remove(wake)
            elif not room or not self.hub._fits(self, wake):  # (one it cannot take: not spent)
                unused.append(wake)
        if unused:
            self.hub._pass_on(unused)

    def close(self) -> None:
        """The poll is answering: leave the hub, handing on any wake no pass has used (a poll
        whose handed pass is still in the store hands its wakes on once that commits)."""
        self.hub._unregister(self)
        if self.handing:
            return
        wakes, self.woken = self.woken, []
        if wakes:
            self.hub._pass_on(wakes)


class PollHub:
    """The waiting long polls of one control plane and the routing of wake-ups to them."""

    def __init__(
        self, notifier: Notifier, *, max_polls: int, recheck_s: float, safety_recheck_s: float
    ) -> None:
        self.notifier = notifier
        self.max_polls = max_polls
        self.recheck_s = recheck_s
        self.safety_recheck_s = safety_recheck_s
        self.relay: Relay | None = None
        # the needs of a (queue, shape) (the store's cache); None: unknown, any poll may take it
        self.needs_of: Callable[[str, str], Needs | None] = lambda queue, shape: None
        self.closing = False  # set by drain: every wait ends with SHUTDOWN
        self.shared_store = False  # True when other replicas may write work (PostgreSQL)
        self.active = 0  # admitted polls, waiting or not
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, Ticket] = {}
        # FIFOs of waiting polls by (queue, namespace), namespace None for unbound tokens
        self._run: dict[tuple[str, str | None], OrderedDict[int, Ticket]] = {}
        self._exec: dict[tuple[str, str | None], OrderedDict[int, Ticket]] = {}
        self._workers: dict[str, dict[int, Ticket]] = {}
        self._kept: dict[tuple[str, str], deque[tuple[int, str, str]]] = {}
        self._kept_at: dict[tuple[str, str], float] = {}  # last kept, to forget idle queues
        self._next_sweep = 0.0
        # the newest position of a kept wake dropped unused (full, or forgotten): a poll that
        # skips its pass from an older position might miss that work (server/idle.py)
        self.dropped_upto = 0

    # -- life cycle and admission ---------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None:
            self._loop = loop
            self.notifier.add_listener(self._listener)

    def stop(self) -> None:
        if self._loop is not None:
            self.notifier.remove_listener(self._listener)
            self._loop = None

    def drain(self) -> None:
        """The server is stopping: wake every waiting poll with ``shutdown`` (its route answers
        empty at once), and end every later wait so. The daemons poll again, elsewhere or later."""
        self.closing = True
        for t in list(self._waiting.values()):
            self._wake(t, None, SHUTDOWN)

    @property
    def waiting(self) -> int:
        """Polls waiting now."""
        return len(self._waiting)

    def is_waiting(self, worker_id: str) -> bool:
        """Whether a long poll of ``worker_id`` is waiting here now."""
        return worker_id in self._workers

    @property
    def reliable(self) -> bool:
        """Whether every wake-up reaches this replica: one replica, or the relay is listening."""
        return not self.shared_store or (self.relay is not None and self.relay.listening)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Count one long poll for its whole life; :class:`PollsFull` past ``max_polls``."""
        if self.active >= self.max_polls:
            raise PollsFull(
                f"the control plane is serving its limit of {self.max_polls} concurrent long polls "
                "(lakeshore server --max-polls)"
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    def ticket(
        self,
        worker_id: str,
        queues: list[str],
        *,
        takes_exec: bool,
        namespace: str | None,
        offer: Offer = NO_OFFER,
    ) -> Ticket:
        return Ticket(self, worker_id, queues, takes_exec=takes_exec, namespace=namespace, offer=offer)

    def _fits(self, t: Ticket, wake: Wake, needs: Needs | None = None) -> bool:
        """Whether ``t``'s offer fits ``wake``'s shape, of ``needs`` when the caller knows them
        (an unknown shape: any poll may try)."""
        if wake.shape == PLAIN:
            return True
        if needs is None:
            needs = self.needs_of(wake.queue, wake.shape)
        return needs is None or t.offer.fits(needs)

    # -- routing --------------------------------------------------------------------------------

    def _listener(self, channel: str, seq: int, relayed: bool) -> None:
        """Called by the notifier in the notifying thread: hand routed channels to the loop (a
        turn later; from the loop itself, the group commit on the loop, without waking it)."""
        loop = self._loop
        if loop is not None and channel.startswith(_ROUTED):
            if asyncio._get_running_loop() is loop:
                loop.call_soon(self._route, channel, seq, relayed)
                return
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(self._route, channel, seq, relayed)

    def _route(self, channel: str, seq: int, relayed: bool) -> None:
        if channel.startswith(_WORKER):
            polls = self._workers.get(channel[len(_WORKER) :])
            if polls:
                for t in list(polls.values()):
                    self._wake(t, None, WORKER)
            elif not relayed and self.relay is not None:
                self.relay.publish(channel)
            return
        wake = parse_wake(channel)
        if wake is not None:
            self._dispatch(wake, seq, relayed=relayed)

    def _dispatch(self, wake: Wake, seq: int, *, relayed: bool) -> None:
        """Wake the longest-waiting poll that can claim ``wake``; else keep it and relay it."""
        t = self._first(wake)
        if t is not None:
            self._wake(t, wake, WOKEN)
            return
        key = (wake.kind, wake.queue)
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = deque(maxlen=KEPT_PER_QUEUE)
        if len(kept) == KEPT_PER_QUEUE:  # the oldest falls off
            self.dropped_upto = max(self.dropped_upto, kept[0][0])
        kept.append((seq, wake.namespace, wake.shape))
        self._forget_idle(key)
        if not relayed and self.relay is not None:
            self.relay.publish(wake.channel)

    def _forget_idle(self, key: tuple[str, str]) -> None:
        """Drop the kept wakes of queues nobody took them from for ``KEPT_FOR_S``: queue names
        are the producers' to choose, and kept wakes must not grow with every name ever used."""
        now = time.monotonic()
        self._kept_at[key] = now
        if now < self._next_sweep:
            return
        self._next_sweep = now + KEPT_FOR_S / 4
        for stale in [k for k, at in self._kept_at.items() if now - at > KEPT_FOR_S]:
            del self._kept_at[stale]
            dropped = self._kept.pop(stale, None)
            if dropped:
                self.dropped_upto = max(self.dropped_upto, max(k[0] for k in dropped))

    def _pass_on(self, wakes: list[Wake]) -> None:
        seq = self.notifier.mark()  # a poll starting its pass after now sees that work itself
        for wake in wakes:
            self._dispatch(wake, seq, relayed=False)

    def _first(self, wake: Wake, needs: Needs | None = None) -> Ticket | None:
        """The longest-waiting poll that may claim ``wake`` (of ``needs``, when known): the older
        head of its (queue, namespace) FIFO and of the queue's FIFO of unbound polls."""
        index = self._run if wake.kind == RUN else self._exec
        bound, unbound = index.get((wake.queue, wake.namespace)), index.get((wake.queue, None))
        found = [
            t
            for t in (self._fitting(bound, wake, needs), self._fitting(unbound, wake, needs))
            if t is not None
        ]
        return min(found, key=lambda t: t.id) if found else None

    def _fitting(
        self, fifo: OrderedDict[int, Ticket] | None, wake: Wake, needs: Needs | None = None
    ) -> Ticket | None:
        """The longest-waiting poll of ``fifo`` whose offer fits ``wake``."""
        if not fifo:
            return None
        if wake.shape == PLAIN:
            return next(iter(fifo.values()))
        return next((t for t in fifo.values() if self._fits(t, wake, needs)), None)

    def _wake(self, t: Ticket, wake: Wake | None, reason: str) -> None:
        self._unregister(t)
        if wake is not None:
            t.woken.append(wake)
        if t._future is not None and not t._future.done():
            t._future.set_result(reason)

    def hand_off(self, submits: Sequence[SubmitRequest]) -> list[tuple[PollRequest, Callable[[Any], None]]]:
        """For the submits of a group commit about to be written: take the head waiting poll of
        each new invocation's (queue, namespace) out of the hub, its wake in hand (see the module
        docstring), at most ``MAX_HANDOFFS``. Returns each one's pass, to write right after the
        submits in their transaction (its ``handed`` names its submit: the store sends that one no
        ``run-queue`` notification, the poll holds its wake), and what to call with its answer."""
        out: list[tuple[PollRequest, Callable[[Any], None]]] = []
        if self.closing or not self._run:  # (no run poll waits: none to hand, no needs to weigh)
            return out
        for submit in submits:
            if len(out) >= MAX_HANDOFFS:
                break
            try:
                needs = needs_of(submit.run_config, submit.namespace or DEFAULT_NAMESPACE)
            except PlaneError:  # the submit is refused: nothing to hand
                continue
            wake = Wake(RUN, submit.queue, submit.namespace, needs.key())
            # its needs as submitted: a shape new to the store is not in ``needs_of`` until this
            # transaction names it, and a poll whose offer cannot take it would spend its wake
            t = self._first(wake, needs)
            if t is None or t.prepare is None or t._future is None or t._future.done():
                continue
            try:
                write, back = t.prepare()
            except Exception:  # the poll is left waiting: the submit's wake will reach it
                log.exception("preparing a handed pass for worker %s failed", t.worker_id)
                continue
            write.handed = (submit.invocation_id,)
            self._unregister(t)
            if t._timer is not None:  # no re-check or timeout while the pass is in the store
                t._timer.cancel()
            t.woken.append(wake)
            t.handing = True
            out.append((write, functools.partial(self._deliver, t, back)))
        return out

    def _deliver(self, t: Ticket, back: Any, answer: Any) -> None:
        """A hand-off's pass has its answer (committed): wake its poll with it. A poll that hung
        up meanwhile hands its wakes on now, after the commit; what its pass claimed goes back to
        the queue when its lease lapses."""
        t.handing = False
        t.handed = (back, answer)
        if t._future is not None and not t._future.done():
            t._future.set_result(HANDED)
            return
        wakes, t.woken = t.woken, []
        if wakes:
            self._pass_on(wakes)

    def degrade(self) -> None:
        """Wake-ups from other replicas may be missed from now on: bring every waiting poll's
        re-check forward to ``recheck_s``."""
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        for t in self._waiting.values():
            due = min(t._deadline - now, self._jitter(self.recheck_s))
            if t._timer is not None and t._future is not None:
                t._timer.cancel()
                t._timer = loop.call_later(max(0.0, due), _expire, t._future, RECHECK)

    # -- waiting --------------------------------------------------------------------------------

    @staticmethod
    def _jitter(interval: float) -> float:
        return interval * random.uniform(0.5, 1.0)

    async def _wait(
        self, t: Ticket, timeout: float, since: int, hangup: asyncio.Future[Any] | None = None
    ) -> str:
        if self.closing:
            return SHUTDOWN
        if hangup is not None and hangup.done():
            return HANGUP
        if timeout <= 0:
            return TIMEOUT
        loop = asyncio.get_running_loop()
        self.start(loop)  # an app served without its lifespan still routes wake-ups
        kept = self._take_kept(t, since)
        if kept is not None:
            t.woken.append(kept)
            return WOKEN
        if self.notifier.fired([_WORKER + t.worker_id], since):
            return WORKER
        interval = self._jitter(self.safety_recheck_s if self.reliable else self.recheck_s)
        reason = RECHECK if interval < timeout else TIMEOUT
        future: asyncio.Future[str] = loop.create_future()
        t._future = future
        t._deadline = loop.time() + timeout
        t._timer = loop.call_later(min(interval, timeout), _expire, future, reason)
        hung_up = functools.partial(_hung_up, future)
        if hangup is not None:
            hangup.add_done_callback(hung_up)
        self._register(t)
        try:
            return await future
        finally:
            t._timer.cancel()
            t._timer = t._future = None
            if hangup is not None:
                hangup.remove_done_callback(hung_up)
            self._unregister(t)

    def _take_kept(self, t: Ticket, since: int) -> Wake | None:
        """A kept wake newer than ``since`` that ``t`` can take (removed); kept wakes ``t`` could
        take but that are not newer than ``since`` are dropped (its fruitless pass saw that work)."""
        found: Wake | None = None
        for queue in t.queues:
            for kind in (RUN, EXEC) if t.takes_exec else (RUN,):
                kept = self._kept.get((kind, queue))
                if not kept:
                    continue
                left: deque[tuple[int, str, str]] = deque(maxlen=KEPT_PER_QUEUE)
                for seq, namespace, shape in kept:
                    wake = Wake(kind, queue, namespace, shape)
                    mine = (t.namespace is None or t.namespace == namespace) and self._fits(t, wake)
                    if not mine:
                        left.append((seq, namespace, shape))
                    elif seq > since:
                        if found is None:
                            found = wake
                        else:
                            left.append((seq, namespace, shape))
                if left:
                    self._kept[(kind, queue)] = left
                else:
                    del self._kept[(kind, queue)]
                    self._kept_at.pop((kind, queue), None)
        return found

    def _register(self, t: Ticket) -> None:
        t.id = next(self._ids)
        self._waiting[t.id] = t
        for queue in t.queues:
            self._run.setdefault((queue, t.namespace), OrderedDict())[t.id] = t
            if t.takes_exec:
                self._exec.setdefault((queue, t.namespace), OrderedDict())[t.id] = t
        self._workers.setdefault(t.worker_id, {})[t.id] = t

    def _unregister(self, t: Ticket) -> None:
        if self._waiting.pop(t.id, None) is None:
            return
        for queue in t.queues:
            _discard(self._run, (queue, t.namespace), t.id)
            if t.takes_exec:
                _discard(self._exec, (queue, t.namespace), t.id)
        _discard(self._workers, t.worker_id, t.id)
        t.id = 0


def _discard(index: dict[_K, _F], key: _K, ticket_id: int) -> None:
    fifo = index.get(key)
    if fifo is not None:
        fifo.pop(ticket_id, None)
        if not fifo:
            del index[key]


def _expire(future: asyncio.Future[str], reason: str) -> None:
    if not future.done():
        future.set_result(reason)


def _hung_up(future: asyncio.Future[str], _watch: object) -> None:
    _expire(future, HANGUP)
