"""The lakeshore exception hierarchy.

::

    LakeshoreError
     +-- InvalidId                   an id that is not a ULID (never becomes a path or a key)
     +-- WireError
     |    +-- DecodeError            garbage, truncated or oversized bytes (carries .data)
     +-- EnvelopeError
     |    +-- VersionError           Envelope.v newer than this reader
     |    +-- TransportError         a callable that cannot travel as asked
     |    +-- GateError              a worker-side gate refused the function
     |         +-- PickleRefused     pickled function on a plane that does not allow it
     |         +-- RuntimeMismatch   python / cloudpickle differ beyond the policy
     |         +-- StaleSource       src_hash differs from the worker's source
     +-- DispatchError               a remote failure seen by the producer (.type, .message, .traceback)
     +-- StreamRestarted             a new attempt restarted an invocation's stream (.attempt, .seq)
     +-- SendTimeout                 (also a TimeoutError) raised in a two-way body at a yield no
     |                               send answered in time (twoway.py)
     +-- PlaneError                  the dispatch plane failed or refused a request (.status)
          +-- Unavailable            unreachable, timed out, 5xx, 429: worth retrying (.retry_after)
          +-- Refused                will not succeed as sent: never retried
               +-- AuthError         the token was refused
               |    +-- Unauthorized 401: unknown, expired or revoked token
               |    +-- Forbidden    403: the token lacks the kind or the scope
               +-- QuotaExceeded     429 naming a namespace quota (.quota, .limit, .retry_after):
               |                     not retried; lakeshore namespace quota raises it
               +-- NotFound          404: unknown invocation / job / topic
               +-- Conflict          409: a superseded attempt, an invocation no longer running
               +-- BadRequest        another 4xx (400, 413, 422, ...): malformed on one side
                    +-- PayloadCorrupt  a referenced blob whose sha256 is not the ref's (422)

    Interrupted (BaseException)     raised in a task's function by the entry on the first SIGTERM:
                                    the call is being stopped (.reason: cancelled | timeout |
                                    preempted | shutdown); finally blocks and with blocks run

``TypeError`` is raised (not wrapped) for an unpackable value, as the seed says. A part of the SDK
whose dependency the runtime lacks (a bring-your-own image has only what the entry bundle carries)
raises ``ModuleNotFoundError`` from :func:`missing_module`, naming the feature, the module and the fix. The control-plane
client (``dreamlake.lakeshore.client``) maps every HTTP failure onto the ``PlaneError`` branch, and
retries :class:`Unavailable` alone.
"""

from __future__ import annotations

TYPE_CHECKING = False  # no typing at runtime: the entry imports this module
if TYPE_CHECKING:
    from typing import Any


class Interrupted(BaseException):
    """The task is being stopped: raised by the entry in the function's thread on the first
    SIGTERM (the runner's ladder: interrupt, grace, kill), so ``try/finally`` and ``with`` blocks
    run; a generator gets it at its current ``yield``. ``reason``: ``cancelled`` (the producer
    cancelled), ``timeout`` (``timeout_s`` passed), ``preempted`` (the host stops: nymph's shutdown
    or drain), ``shutdown`` (a SIGTERM nymph did not explain). A BaseException, like
    KeyboardInterrupt, so ``except Exception`` does not swallow it; after the grace the task is
    killed whatever it does."""

    REASONS = ("cancelled", "timeout", "preempted", "shutdown")

    def __init__(self, reason: str = "shutdown") -> None:
        self.reason = reason if reason in self.REASONS else "shutdown"
        super().__init__(f"the call is being stopped ({self.reason})")


class LakeshoreError(Exception):
    """Base of every error lakeshore raises on purpose."""


class InvalidId(LakeshoreError, ValueError):
    """An id that is not a canonical ULID."""


class WireError(LakeshoreError):
    """The value codec failed."""


class DecodeError(WireError, ValueError):
    """Bytes that do not decode: garbage, truncation, or limits exceeded. ``data`` holds a prefix."""

    def __init__(self, message: str, data: bytes | None = None) -> None:
        super().__init__(message)
        self.data = data[:64] if data is not None else None


class EnvelopeError(LakeshoreError):
    """A malformed Envelope or function transport record."""


class VersionError(EnvelopeError):
    """The Envelope was written by a newer wire version than this reader understands."""


class TransportError(EnvelopeError):
    """The callable cannot be shipped with the requested transport."""


class GateError(EnvelopeError):
    """A worker-side gate refused to run the function."""


class PickleRefused(GateError):
    """A pickled function reached a worker that does not allow pickled functions."""


class RuntimeMismatch(GateError):
    """The pickling runtime differs from this worker's beyond the runtime policy."""


class StaleSource(GateError):
    """The worker's source of a ref function hashes differently from the submitter's."""


class DispatchError(LakeshoreError):
    """A remote invocation failed; carries the producer-side view of the remote error."""

    def __init__(self, type: str, message: str, traceback: str | None = None) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message
        self.traceback = traceback

    @classmethod
    def from_info(cls, info: dict[str, Any] | None) -> DispatchError:
        info = info or {}
        return cls(str(info.get("type") or "Error"), str(info.get("message") or ""), info.get("traceback"))


class StreamRestarted(LakeshoreError):
    """A new attempt of the invocation restarted its stream: the values before this came from an
    earlier attempt (whose process died, or whose failure is retried), and the values after it
    are the new attempt's, from its first. Raised by ``next()`` on ``SyncQueue.stream``; catch it
    and keep iterating the same stream (or resume elsewhere with ``since=seq``)."""

    def __init__(self, invocation_id: str, attempt: int, seq: int) -> None:
        super().__init__(
            f"invocation {invocation_id}: attempt {attempt} restarted the stream at seq {seq}; "
            "the values so far came from an earlier attempt, the next ones are attempt "
            f"{attempt}'s from its first (keep iterating, or resume with since={seq})"
        )
        self.invocation_id = invocation_id
        self.attempt = attempt
        self.seq = seq


class SendTimeout(LakeshoreError, TimeoutError):
    """Raised inside a remote two-way generator body at a ``yield`` that no consumer's ``send()``
    (or ``next()``) answered within ``@dls.udf(send_timeout_s=...)`` (default 600 s). Catch it in
    the body to yield again or finish; uncaught it fails the call."""


class PlaneError(LakeshoreError):
    """The dispatch plane (local store or control plane) failed or refused a request.

    ``invocation_id`` is set on the failure of a submit: the id the call was submitted under, whose
    status the caller can ask for (a submit that stayed unanswered may still have been stored).
    ``invocation_ids`` is set on the failure of a map (``UDF.map``): every id it sent, in input
    order, ``None`` where that call was refused."""

    invocation_id: str | None = None
    # the failure of a map (``UDF.map``): the id of every call it sent, in input order, None where
    # that call was refused (the others were submitted)
    invocation_ids: list[str | None] | None = None

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Unavailable(PlaneError):
    """Worth retrying: the plane was unreachable, timed out, failed internally (5xx) or asked the
    caller to slow down (429). ``retry_after`` is the server's ``Retry-After`` in seconds, if any.
    ``unreachable``: no answer came (the connection failed); ``unsent``: not even a connection (it
    was refused, the name did not resolve), so nothing was sent; ``maybe_received``, on what a
    retried request raised at last: whether any of its tries may have reached the plane."""

    unreachable = False
    unsent = False
    maybe_received = True

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after


class Refused(PlaneError):
    """The plane refused the request as sent; repeating it unchanged cannot succeed."""


class AuthError(Refused):
    """The control plane refused the token (401) or the scope (403)."""


class Unauthorized(AuthError):
    """401: the token is unknown, expired or revoked."""


class Forbidden(AuthError):
    """403: the token is valid but lacks the kind or the scope the route needs."""


class QuotaExceeded(Refused):
    """429 naming a quota: the caller's namespace is at one of the limits an operator set with
    ``lakeshore namespace quota`` (``quota``: ``max_queued``, ``max_topics`` or
    ``max_payload_bytes``; ``limit``: its value). The message says which and what to do. Not
    retried by the client: a queued-invocations quota frees up as calls run (``retry_after``, the
    server's ``Retry-After`` in seconds, says when to ask again); the others need the operator or
    the payload retention."""

    def __init__(
        self,
        message: str,
        status: int | None = 429,
        retry_after: float | None = None,
        *,
        quota: str | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after
        self.quota = quota
        self.limit = limit


class NotFound(Refused):
    """An unknown invocation, job or topic."""


class Conflict(Refused):
    """409: the attempt was superseded, or the invocation is no longer running."""


class BadRequest(Refused):
    """Another 4xx: the request is malformed (or too large) for the plane."""


class PayloadCorrupt(BadRequest):
    """Bytes behind a payload ref (``argsRef``, ``resultRef``, a frame's ref) that do not hash to the
    ref's sha256. The message is seed 003's: ``payload corrupt: sha256 mismatch (expected E, got G)``."""

    def __init__(self, expected: str, got: str, message: str | None = None) -> None:
        super().__init__(message or f"payload corrupt: sha256 mismatch (expected {expected}, got {got})", 422)
        self.expected = expected
        self.got = got


def missing_module(feature: str, exc: ModuleNotFoundError, needs: str, pip: str) -> ModuleNotFoundError:
    """A ModuleNotFoundError for ``exc`` that names ``feature``, what it ``needs`` and the fix.

    Inside a task (``LAKESHORE_INVOCATION_ID`` set) it says that the image lacks it: the entry bundle
    carries the SDK's import-time surface with msgpack and cloudpickle, nothing more.
    """
    from dreamlake.lakeshore import envvars

    missing = exc.name or "?"
    if envvars.is_set("LAKESHORE_INVOCATION_ID"):
        other = "" if pip == "dreamlake-lakeshore" else ", or install dreamlake-lakeshore there"
        message = (
            f"{feature} needs {needs} in the image; this task's runtime has no module {missing!r} "
            "(the entry bundle carries only the SDK's task surface, msgpack and cloudpickle): "
            f"install it in the task's image (pip install {pip}){other}"
        )
    else:
        message = f"{feature} needs {needs}, and there is no module {missing!r}: pip install {pip}"
    return ModuleNotFoundError(message, name=missing)
