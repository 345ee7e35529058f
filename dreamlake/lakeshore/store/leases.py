"""Leases of running invocations: renewed by a heartbeat (``_renew_in``), lapsed ones ended or
requeued (``_expire_in``), retries whose backoff is over made claimable (``_release_in``). Each runs
inside the heartbeat and ``expire_leases`` transactions of sql.py. :class:`LeaseStore` is composed
into ``InvocationStore`` (invocations.py).

A running invocation whose lease lapses after a cancel was requested becomes ``cancelled`` instead
of being requeued (a choice the seed leaves open).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from .base import StoreBase
from .invocation_rows import _inv

if TYPE_CHECKING:
    from .invocation_rows import _Statements

LEASE_EXPIRED = {
    "type": "LeaseExpired",
    "message": "the worker stopped renewing the lease on the last allowed attempt (run_config.max_attempts)",
}
LOST = "lost"  # an attempt whose lease lapsed (invocation_attempts.state)
LEASE_LOST = {"type": "LeaseExpired", "message": "the worker stopped renewing the lease; requeued"}


class LeaseStore(StoreBase):
    """Invocation leases: renewal, expiry, the end of a retry's backoff."""

    if TYPE_CHECKING:  # InvocationStore's (bound in its ``__init__``)
        _inv_st: _Statements

    def _renew_in(
        self, conn: Connection, worker_id: str, running: Sequence[tuple[str, int]], lease: float
    ) -> dict[str, bool]:
        """Renew the worker's leases of ``running`` ``(invocation_id, attempt)`` pairs; the ids it
        still holds (the others were lost: superseded, expired or cancelled), each with whether a
        cancel was requested for it."""
        if not running:
            return {}
        params = {"pairs": sorted(running), "worker": worker_id, "lease": lease}
        return {r.invocation_id: bool(r.cancel_requested) for r in conn.execute(self._inv_st.renew, params)}

    def _expire_in(
        self, conn: Connection, now: float
    ) -> tuple[list[Row[Any]], list[Row[Any]], list[Row[Any]]]:
        """End the running invocations whose lease lapsed: cancelled when a cancel was requested,
        else requeued while attempts remain, else failed with ``LEASE_EXPIRED``. Returns the
        ``(invocation_id,)`` rows cancelled, the ``(invocation_id, queue, namespace, shape)`` rows requeued and the
        ``(invocation_id,)`` rows failed."""
        lapsed = (_inv.c.state == "running", _inv.c.lease_expires_at < now)
        gone = {"worker_id": None, "lease_expires_at": None}
        cancelled = conn.execute(
            sa.update(_inv)
            .where(*lapsed, _inv.c.cancel_requested == sa.true())
            .values(state="cancelled", finished_at=now, **gone)
            .returning(_inv.c.invocation_id)
        ).fetchall()
        # attempts spent: preempted ones and those handed back before they started are not
        spent = _inv.c.attempt - _inv.c.preemptions - _inv.c.handbacks
        retries = (*lapsed, spent < _inv.c.max_attempts)
        lost = conn.execute(
            sa.select(_inv.c.invocation_id, _inv.c.attempt, _inv.c.worker_id, _inv.c.started_at).where(
                *retries
            )
        ).fetchall()
        requeued = conn.execute(
            sa.update(_inv)
            .where(*retries)
            .values(state="queued", started_at=None, not_before=None, **gone)
            .returning(_inv.c.invocation_id, _inv.c.queue, _inv.c.namespace, _inv.c.shape)
        ).fetchall()
        back = {r.invocation_id for r in requeued}
        history = [
            {
                "invocation_id": r.invocation_id,
                "attempt": r.attempt,
                "state": LOST,
                "worker_id": r.worker_id,
                "started_at": r.started_at,
                "finished_at": now,
                "error": LEASE_LOST,
                "retry_at": now,
            }
            for r in lost
            if r.invocation_id in back
        ]
        if history:
            conn.execute(self._inv_st.insert_attempt, history)
        failed = conn.execute(
            sa.update(_inv)
            .where(*lapsed)
            .values(state="failed", finished_at=now, error=LEASE_EXPIRED, lease_expires_at=None)
            .returning(_inv.c.invocation_id)
        ).fetchall()
        return list(cancelled), list(requeued), list(failed)

    def _release_in(self, conn: Connection, now: float) -> list[Row[Any]]:
        """Make the retries whose backoff is over claimable (``not_before`` cleared, read off
        ``ix_invocations_delayed``); their ``(invocation_id, queue, namespace)`` rows."""
        return list(
            conn.execute(
                sa.update(_inv)
                .where(_inv.c.not_before.isnot(None), _inv.c.not_before <= now, _inv.c.state == "queued")
                .values(not_before=None)
                .returning(_inv.c.invocation_id, _inv.c.queue, _inv.c.namespace, _inv.c.shape)
            ).fetchall()
        )
