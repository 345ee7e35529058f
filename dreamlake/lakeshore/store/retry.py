"""The retry rule: which outcome of an attempt queues another one, and after how long.

A worker acks ``failed`` or ``timeout``; the store asks :func:`delay` before recording it as the
outcome. Another attempt is queued (``delay`` is not None) when all of these hold:

- attempts remain (``attempt < max_attempts``) and no cancel was requested;
- the outcome is not one that cannot change by running again (:data:`NEVER`: a gate refused the
  function, it could not be imported or decoded, the run config was refused, a cancel);
- it is a death of the task's process (:data:`CRASHES`: ``ProcessExited``, e.g. ``os._exit(17)``,
  an OOM kill; ``DamagedOutput``, an output nymph found truncated or garbled; retried like a
  lapsed lease, the way Ray retries a dead worker) that nymph did not
  mark ``disk_full`` (the task could not write its result on a full disk: resource exhaustion is
  the outcome the caller is told at once, issue 12 item 1), or its error type
  is listed in ``run_config.retry_on`` (``@dls.udf(retry_on=(TimeoutError,))``). A name matches
  the error's ``type`` or, when the worker reports it, a base class in the error's ``mro`` (the
  entry reports the class names of the exception's MRO), so ``retry_on=(OSError,)`` also retries a
  ``ConnectionError``. ``"Timeout"`` in ``retry_on`` retries a ``timeout`` outcome (run_config.
  timeout_s passed), which is never retried otherwise.

A ``preempted`` ack (the host stopped under the attempt: nymph's shutdown or drain grace expired)
is not a failure: the call is requeued at once and the attempt is not counted against
``max_attempts`` (the attempts spent are ``attempt - preemptions``), while ``preemptions <
run_config.max_preemptions`` (default :data:`DEFAULT_MAX_PREEMPTIONS`); past that the call fails
``{type: "Preempted"}`` (:func:`may_requeue_preempted`), so a host that keeps stopping ends no loop.
A ``preempted`` ack whose error says ``started: false`` hands back an attempt that never started
(claimed by a poll in flight as nymph stopped, or nymph restarted between the claim and the start):
requeued at once, spending neither ``max_attempts`` nor ``max_preemptions`` (``handbacks`` + 1;
the attempts spent are ``attempt - preemptions - handbacks``); past :data:`MAX_HANDBACKS` such
hand-backs it counts as a preemption (:func:`is_hand_back`), so a nymph that dies each time it
prepares the call ends no loop either.

The next attempt becomes claimable ``backoff_s * 2**(attempt - 1)`` seconds after the failure
(``run_config.backoff_s``, default :data:`DEFAULT_BACKOFF_S`; at most :data:`MAX_BACKOFF_S`). A
lapsed lease keeps its own rule (store/invocations.py ``_expire_in``): requeued at once while
attempts remain, whatever ``retry_on`` says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dreamlake.lakeshore.errors import PlaneError

RETRY_STATES = frozenset({"failed", "timeout"})  # the acks that may queue another attempt
TIMEOUT_TYPE = "Timeout"  # the error type nymph reports for a timeout outcome
#: Outcomes no retry can change: the function cannot run here as sent.
NEVER = frozenset(
    {
        "PickleRefused",
        "RuntimeMismatch",
        "StaleSource",
        "GateError",
        "TransportError",
        "EnvelopeError",
        "VersionError",
        "DecodeError",
        "ImportError",
        "ModuleNotFoundError",
        "InvalidRunConfig",
        "Cancelled",
        "EnvBuildFailed",  # a pip environment uv could not resolve or build (nymph.envcache)
        "PipRefused",
        "MountRefused",
        "SecretRefused",
    }
)
# the task's process died without reporting, or what it reported was damaged (nymph found its
# result.msgpack or error.json truncated or garbled: issue 32): retried by default
CRASHES = frozenset({"ProcessExited", "DamagedOutput"})
DEFAULT_BACKOFF_S = 1.0
DEFAULT_MAX_PREEMPTIONS = 10
MAX_PREEMPTIONS_CAP = 1000
PREEMPTED_TYPE = "Preempted"  # the error type of a preempted attempt (and of a call out of preemptions)
MAX_HANDBACKS = 10  # hand-backs of attempts that never started that spend nothing; then preemptions
MAX_BACKOFF_S = 3600.0
MAX_RETRY_ON = 32  # names in run_config.retry_on at most


def check(run_config: Mapping[str, Any]) -> None:
    """Refuse (400) a ``retry_on`` that is not a short list of exception names, or a ``backoff_s``
    that is not a number of seconds in 0..MAX_BACKOFF_S."""
    names = run_config.get("retry_on")
    if names is not None and (
        not isinstance(names, list)
        or len(names) > MAX_RETRY_ON
        or not all(isinstance(n, str) and 0 < len(n) <= 200 for n in names)
    ):
        raise PlaneError(
            f"run_config.retry_on must be a list of at most {MAX_RETRY_ON} exception type names "
            f"such as ['TimeoutError', 'ConnectionError'], got {str(names)[:80]}",
            status=400,
        )
    preempt = run_config.get("max_preemptions")
    if preempt is not None and (
        isinstance(preempt, bool) or not isinstance(preempt, int) or not 0 <= preempt <= MAX_PREEMPTIONS_CAP
    ):
        raise PlaneError(
            f"run_config.max_preemptions must be a whole number from 0 to {MAX_PREEMPTIONS_CAP} "
            f"(default {DEFAULT_MAX_PREEMPTIONS}), got {str(preempt)[:40]}",
            status=400,
        )
    backoff = run_config.get("backoff_s")
    if backoff is not None and (
        isinstance(backoff, bool)
        or not isinstance(backoff, (int, float))
        or not math.isfinite(backoff)
        or not 0 <= backoff <= MAX_BACKOFF_S
    ):
        raise PlaneError(
            f"run_config.backoff_s must be a number of seconds from 0 to {MAX_BACKOFF_S:.0f}, got {backoff!r}",
            status=400,
        )


def names_of(error: Mapping[str, Any] | None) -> set[str]:
    """The type names an error answers to: its ``type`` and its reported ``mro``."""
    if not error:
        return set()
    out = {str(error.get("type") or "")}
    mro = error.get("mro")
    if isinstance(mro, list):
        out.update(str(n) for n in mro)
    out.discard("")
    return out


def delay(
    run_config: Mapping[str, Any],
    state: str,
    error: Mapping[str, Any] | None,
    attempt: int,
    max_attempts: int,
    *,
    cancel_requested: bool = False,
) -> float | None:
    """Seconds until the next attempt of an invocation whose ``attempt`` ended in ``state`` with
    ``error``; None when the outcome is final (see the module docstring)."""
    if state not in RETRY_STATES or attempt >= max_attempts or cancel_requested:
        return None
    names = names_of(error)
    if state == "failed" and names & NEVER and not names & CRASHES:
        return None
    wanted = run_config.get("retry_on")
    wanted_set = {str(n) for n in wanted} if isinstance(wanted, list) else set()
    if state == "timeout":
        if TIMEOUT_TYPE not in wanted_set:
            return None
    elif not (names & wanted_set or (names & CRASHES and not (error or {}).get("disk_full"))):
        return None
    base = run_config.get("backoff_s")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base < 0:
        base = DEFAULT_BACKOFF_S
    return float(min(MAX_BACKOFF_S, base * 2 ** max(0, attempt - 1)))


def max_preemptions(run_config: Mapping[str, Any]) -> int:
    """``run_config.max_preemptions``, or :data:`DEFAULT_MAX_PREEMPTIONS` when absent or unusable."""
    value = run_config.get("max_preemptions")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return DEFAULT_MAX_PREEMPTIONS
    return min(value, MAX_PREEMPTIONS_CAP)


def may_requeue_preempted(run_config: Mapping[str, Any], preemptions: int, *, cancel_requested: bool) -> bool:
    """Whether a preempted attempt queues the next one (``preemptions`` before this one)."""
    return not cancel_requested and preemptions < max_preemptions(run_config)


def is_hand_back(error: Mapping[str, Any] | None, handbacks: int) -> bool:
    """Whether a ``preempted`` ack with ``error`` hands back an attempt that never started, for free
    (``handbacks`` before this one): ``error.started`` is false and :data:`MAX_HANDBACKS` not reached."""
    return isinstance(error, Mapping) and error.get("started") is False and handbacks < MAX_HANDBACKS
