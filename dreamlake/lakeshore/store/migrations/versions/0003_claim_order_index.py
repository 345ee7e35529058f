"""The claim order as an index: ix_invocations_queued replaces ix_invocations_claim.

``ix_invocations_claim`` (state, queue, priority, submitted_at) could not serve the claim's
``ORDER BY priority DESC, submitted_at, invocation_id``: every claim sorted all queued rows of its
queues, so its cost grew with the backlog. ``ix_invocations_queued`` is (queue, priority DESC,
submitted_at, invocation_id) over queued rows only (a partial index on both dialects): one queue's
rows in claim order, so a claim reads its first rows and stops (see claims.claim_statement).

The index is built inside the migration's transaction (no ``CONCURRENTLY``): on PostgreSQL it
blocks writes to ``invocations`` while it builds, seconds for millions of queued rows.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

QUEUED = sa.text("state = 'queued'")


def upgrade() -> None:
    op.create_index(
        "ix_invocations_queued",
        "invocations",
        ["queue", sa.text("priority DESC"), "submitted_at", "invocation_id"],
        sqlite_where=QUEUED,
        postgresql_where=QUEUED,
    )
    op.drop_index("ix_invocations_claim", table_name="invocations")


def downgrade() -> None:
    op.create_index("ix_invocations_claim", "invocations", ["state", "queue", "priority", "submitted_at"])
    op.drop_index("ix_invocations_queued", table_name="invocations")
