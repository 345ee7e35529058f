"""Dispatch planes: where ``.submit()`` sends a call and where workers claim it.

Two planes implement one :class:`Plane` protocol (a :class:`Producer` and a :class:`Worker`):

* :class:`Dispatch` (``dispatch/local.py``) -- in process, over the store (SQLite file or
  ``":memory:"``). Trusted: ``run_worker`` allows pickled functions on it by default.
* :class:`HttpDispatch` (``dispatch/http.py``) -- a client of the control plane's HTTP routes.
  Not trusted: pickled functions are refused unless the worker opts in.

The SDK (``SyncQueue``, ``Topic``, ``run_worker``) speaks only this protocol. Both classes are
imported lazily so that importing this package pulls in neither SQLAlchemy nor httpx; a runtime
that lacks them (a task's bring-your-own image) gets a ``ModuleNotFoundError`` naming the fix on
first use. This package and ``dispatch/http.py`` are part of the entry bundle (Python >= 3.9).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # not the two planes: they import this module (a type checker reads them there)
    from dreamlake.lakeshore.client import PlaneClient
    from dreamlake.lakeshore.envelope import Envelope
    from dreamlake.lakeshore.errors import PlaneError
    from dreamlake.lakeshore.wire import Frame

__all__ = ["NATIVE_FUNCTION", "Claim", "Dispatch", "HttpDispatch", "Plane", "Producer", "Worker"]

NATIVE_FUNCTION: dict[str, str] = {
    "module": "_native_wire",
    "qualname": "_native_wire.envelope",
    "version": "v1",
}
"""The Submit body's ``function`` record of an SDK call: the function travels inside the Envelope."""


@dataclass
class Claim:
    """One invocation a worker claimed: what it needs to run it and to report on it."""

    invocation_id: str
    args_blob: bytes  # the Envelope, verbatim
    run_config: dict[str, Any] = field(default_factory=dict)
    attempt: int = 1


class Producer(Protocol):
    """What the SDK's producer side (``.submit()``, ``SyncQueue``, the handles) needs of a plane.

    Every method a caller uses is declared here. The ones with a body are defaults a plane may
    override (both of the SDK's planes do where they can do better): a plane of your own that
    subclasses :class:`Plane` gets them; one that does not must define them all."""

    trusted: bool  # True: the pickle trust domain of this plane allows pickled functions
    runs_async: bool = False  # True: its workers run an ``async def`` body (else an async udf is refused)

    def submit(
        self,
        envelope: Envelope,
        queue: str,
        run_config: dict[str, Any],
        parent: str | None = None,
    ) -> str:
        """Queue an invocation (its id is the Envelope's); returns its id, or the id
        of the existing invocation when ``run_config["key"]`` matched one on the same queue."""
        ...

    def submit_batch(
        self, calls: Sequence[tuple[Envelope, str, dict[str, Any], str | None]]
    ) -> list[str | PlaneError]:
        """Submit many calls, ``(envelope, queue, run_config, parent)`` each; per call, in order,
        its id or the error its :meth:`submit` raised (``invocation_id`` set). Default: one
        :meth:`submit` each."""
        from dreamlake.lakeshore.errors import PlaneError

        results: list[str | PlaneError] = []
        for envelope, queue, run_config, parent in calls:
            try:
                results.append(self.submit(envelope, queue, run_config, parent))
            except PlaneError as exc:
                exc.invocation_id = envelope.id
                results.append(exc)
        return results

    def submit_and_wait(
        self,
        envelope: Envelope,
        queue: str,
        run_config: dict[str, Any],
        parent: str | None,
        timeout: float,
    ) -> tuple[str, dict[str, Any] | None]:
        """Submit, and the await answer after up to ``timeout`` s when the plane does both in one
        request (``HttpDispatch``); default: :meth:`submit`, and None (not awaited yet)."""
        return self.submit(envelope, queue, run_config, parent), None

    def status(self, invocation_id: str) -> dict[str, Any]:
        """``{invocation_id, state, queue, priority, attempt, ..., error}``; NotFound if unknown."""
        ...

    def await_result(self, invocation_id: str, timeout: float) -> dict[str, Any]:
        """``{state, result_blob, error}`` once terminal, or ``{"state": "pending"}`` after timeout."""
        ...

    def await_batch(self, invocation_ids: Sequence[str], timeout: float) -> dict[str, Any]:
        """The outcomes of many invocations at once, waiting on any (``dls.wait``,
        ``dls.as_completed``, ``Calls.results()``): ``{results: {id: outcome}, states, unknown}``.
        Default: one :meth:`await_result` of the first id."""
        from dreamlake.lakeshore.errors import NotFound
        from dreamlake.lakeshore.states import TERMINAL_STATES

        first = invocation_ids[0]
        try:
            got = self.await_result(first, timeout)
        except NotFound:
            return {"results": {}, "states": {}, "unknown": [first]}
        if got.get("state") in TERMINAL_STATES:
            return {"results": {first: got}, "states": {}, "unknown": []}
        return {"results": {}, "states": {}, "unknown": []}

    def cancel(self, invocation_id: str, descendants: bool = True) -> str:
        """Cancel; returns the state after the call. With ``descendants`` (the default) every
        descendant not yet finished is cancelled too: the tasks it submitted, and theirs."""
        ...

    def frames(
        self, owner: str, since: int = -1, timeout: float = 30.0, *, topic: bool = False
    ) -> Iterator[Frame]:
        """Decoded frames of an invocation (or a topic) with ``seq > since``: replay, then follow.

        Ends after a final frame, or (invocations) on a terminal state with no further frames.
        ``timeout`` is patience for silence, reset by every frame: TimeoutError when it runs out."""
        ...

    def topic_post(self, name: str, body: bytes, final: bool = False) -> int:
        """Append ``body`` (``wire.pack(value)``) to a topic as VALUE (END when final); its seq."""
        ...

    def send(self, invocation_id: str, index: int, kind: str, body: Any = None) -> bool:
        """Answer yield ``index`` of a running two-way generator (twoway.py): ``kind`` ``value``
        (``body``: ``wire.pack(value)``), ``throw`` (``body``: ``{type, message}``) or ``close``.
        True when that index was answered with the same already; Conflict (409) when it is out of
        order, past the window, answered otherwise, or the call is not two-way or has ended."""
        ...

    def warn_if_pickles_refused(self, queue: str, what: str) -> None:
        """Before a pickled call of ``what`` goes to ``queue``: warn when the queue's workers are
        known to refuse pickled functions (``HttpDispatch`` asks the control plane). Default: no-op."""
        return None

    def payload_client(self) -> PlaneClient | None:
        """The control-plane client whose payload store takes what is over the inline threshold (a
        code archive: codeship.py); None (the default) when the plane has none."""
        return None

    def close(self) -> None: ...


class Worker(Protocol):
    """What a worker (``run_worker``, ``lakeshore worker``) needs of a plane."""

    trusted: bool
    acks_ride_polls: bool = False  # True: ``ack(later=True)`` queues an ack for the next claim_batch
    wakes_on_commands: bool = False  # True: :meth:`wait_commands` works (the local plane)

    def claim(self, worker_id: str, queues: list[str], timeout: float) -> Claim | None:
        """Claim the best queued invocation of ``queues``, waiting up to ``timeout`` for one."""
        ...

    def claim_batch(self, worker_id: str, queues: list[str], timeout: float, limit: int) -> list[Claim]:
        """Claim up to ``limit`` invocations in one wait (over HTTP one poll, which also carries the
        acks queued with ``later``). Default: one :meth:`claim`."""
        one = self.claim(worker_id, queues, timeout)
        return [] if one is None else [one]

    def sends(
        self, invocation_id: str, attempt: int, *, worker_id: str, since: int, timeout: float
    ) -> list[Frame]:
        """The sends into a two-way invocation ``worker_id`` holds under ``attempt`` with index >
        ``since``, waiting up to ``timeout`` for the first (an empty list after it)."""
        ...

    def append_frame(
        self, invocation_id: str, seq: int, data: bytes, final: bool, attempt: int, *, worker_id: str
    ) -> None:
        """Journal one encoded frame of a running invocation that ``worker_id`` holds under
        ``attempt``, in seq order (a repeat of a seq is a no-op; a gap is refused, 409). The frame's
        kind decides whether it closes the stream (END and ERROR do); ``final`` should agree.
        Both planes write a stream's first frame at once and later ones in batches, in the
        background (``dispatch/batching.py``): a refusal that comes later (the lease lapsed) is
        raised by a later ``append_frame``, and ``ack`` waits for the invocation's frames (False
        when they were refused)."""
        ...

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
        """Record the outcome; False when the plane refused it (superseded attempt, not running).
        ``later`` (only where ``acks_ride_polls``): queue it for the worker's next claim_batch."""
        ...

    def flush_acks(self, worker_id: str) -> None:
        """Send the acks queued with ``later`` for ``worker_id``. Default: nothing is queued."""
        return None

    def heartbeat(self, worker_id: str, running: list[tuple[str, int]]) -> list[str]:
        """Renew leases of running (invocation_id, attempt); returns ids with a cancel pending,
        including a cancel that an earlier ``claim`` (an HTTP poll) received: none is dropped."""
        ...

    def wait_commands(self, worker_id: str, timeout: float) -> bool:
        """Where ``wakes_on_commands``: block until a command may be queued for the worker since
        its last heartbeat (its heartbeat thread then picks a cancel up at once)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot wait for commands (wakes_on_commands is False): "
            "the worker heartbeats on its interval instead"
        )

    def close(self) -> None: ...


@runtime_checkable
class Plane(Producer, Worker, Protocol):
    """A dispatch plane: both sides. The SDK's two planes (``Dispatch``, ``HttpDispatch``)
    subclass it, so every method here is theirs, overridden or the default."""

    trusted: bool


_LAZY = {
    "Dispatch": "dreamlake.lakeshore.dispatch.local",
    "HttpDispatch": "dreamlake.lakeshore.dispatch.http",
}
# name -> (what it is for, what it needs, what to pip install): the error when a dependency is missing
_NEEDS = {
    "Dispatch": (
        "the in-process Dispatch (a store over SQLite)",
        "SQLAlchemy and the lakeshore store",
        "dreamlake-lakeshore",
    ),
    "HttpDispatch": (
        "submitting from inside a task (and q.result() / q.stream() there)",
        "httpx and tenacity",
        "httpx tenacity",
    ),
}


def frame_attempt(frame: Frame) -> int:
    """The attempt a journaled frame came from: ``meta.attempt``, else 1 (the first attempt to
    write keeps its frames verbatim; see docs/protocol.md, "Retries and stream restarts")."""
    meta = frame.meta if isinstance(frame.meta, dict) else {}
    attempt = meta.get("attempt")
    return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt > 0 else 1


def error_ends_stream(status: Any, frame: Frame, patience_s: float = 30.0) -> bool:
    """Whether an ERROR frame ends its invocation's stream: True once the invocation is terminal;
    False when another attempt follows it (queued for a retry, or a later attempt running), whose
    frames come after a RESTART marker. While the attempt is still running (its ack follows its
    frames) ``status()`` is asked again, for up to ``patience_s``; past that the ERROR ends it."""
    import time

    from dreamlake.lakeshore.states import TERMINAL_STATES

    attempt = frame_attempt(frame)
    deadline = time.monotonic() + patience_s
    pause = 0.02
    while True:
        record = status()
        state = record.get("state")
        if int(record.get("attempt") or 0) > attempt:
            return False  # a later attempt exists (it may even have ended already): its frames follow
        if state in TERMINAL_STATES:
            return True
        if state == "queued":
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(pause)
        pause = min(0.5, pause * 2)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dreamlake.lakeshore.dispatch' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        from dreamlake.lakeshore import envvars
        from dreamlake.lakeshore.errors import missing_module

        feature, needs, pip = _NEEDS[name]
        if name == "HttpDispatch" and not envvars.is_set("LAKESHORE_INVOCATION_ID"):
            feature = "HttpDispatch (the control plane's client)"
        raise missing_module(feature, exc, needs, pip) from exc
    value = getattr(loaded, name)
    globals()[name] = value
    return value
