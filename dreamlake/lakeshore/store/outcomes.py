"""``Store.outcomes(ids)``: the outcomes of many invocations in one narrow read.

A sweep's reader (``POST /v1/producer/await-batch``, the local plane's ``await_batch``) asks for
the outcomes of up to a thousand calls at a time, again and again while they run. It needs each
one's state and, once terminal, its result or error (and the namespace, for the caller's
visibility): this read selects those columns only, so it decodes none of the row's other JSON
(function, run_config, code_context) and builds no full ``Invocation``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from . import schema as t
from .api import Outcome
from .base import StoreBase

_inv = t.invocations
_OUTCOMES = sa.select(
    _inv.c.invocation_id,
    _inv.c.namespace,
    _inv.c.state,
    _inv.c.result_blob,
    _inv.c.result_ref,
    _inv.c.error,
).where(_inv.c.invocation_id.in_(sa.bindparam("ids", expanding=True)))


class OutcomeStore(StoreBase):
    def outcomes(self, invocation_ids: Sequence[str]) -> list[Outcome]:
        """The outcomes of the invocations of ``invocation_ids`` that exist (any order)."""
        if not invocation_ids:
            return []
        with self.db.tx(write=False) as conn:
            rows = conn.execute(_OUTCOMES, {"ids": list(invocation_ids)}).fetchall()
        return [
            Outcome(inv, ns, state, bytes(blob) if blob is not None else None, ref, error)
            for inv, ns, state, blob, ref, error in rows
        ]
