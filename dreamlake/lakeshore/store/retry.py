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
    }
)
# the task's process died without reporting, or what it reported was damaged (nymph found its
# result.msgpack or error.json truncated or garbled: issue 32): retried by default
CRASHES = frozenset({"ProcessExited", "DamagedOutput"})
DEFAULT_BACKOFF_S = 1.0
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
