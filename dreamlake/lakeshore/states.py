"""Invocation states: the vocabulary the control plane and its clients share.

The store (server side) records these states and the clients (``dispatch``, nymph) read them, so
they live here, importing nothing, rather than in either side. ``store.api`` re-exports them.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["ACK_STATES", "PREEMPTED", "STATES", "TERMINAL_STATES", "State"]

State = Literal["queued", "running", "succeeded", "failed", "killed", "timeout", "cancelled"]

STATES: tuple[str, ...] = get_args(State)
"""Every state, in lifecycle order (listings and filters show them so)."""

TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "killed", "timeout", "cancelled"})
"""States an invocation never leaves."""

PREEMPTED = "preempted"
"""The outcome of an attempt whose host stopped under it (nymph's shutdown or drain grace expired).
Never a row's state: the store requeues the call at once (attempt + 1) without spending one of its
``max_attempts``, and keeps ``preempted`` in the attempts history (store/invocations.py)."""

ACK_STATES: frozenset[str] = frozenset({"succeeded", "failed", "killed", "timeout", PREEMPTED})
"""The outcomes a worker may report (``cancelled`` is the producer's, never a worker's)."""
