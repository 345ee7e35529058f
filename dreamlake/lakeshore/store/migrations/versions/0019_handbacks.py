"""invocations.handbacks: attempts handed back before they started.

A worker that claimed a call it never started (a poll in flight as nymph stops, a nymph restarted
between the claim and the start) acks it ``preempted`` with ``error.started`` false; the call is
requeued at once and the attempt spends neither ``max_attempts`` nor ``max_preemptions``: the
attempts spent are ``attempt - preemptions - handbacks``. Past ``retry.MAX_HANDBACKS`` such an ack
counts as a preemption. Rows written before this revision were never handed back (0).

Revision ID: 0019_handbacks
Revises: 0018_quota_topics_bytes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_handbacks"
down_revision = "0018_quota_topics_bytes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("invocations", sa.Column("handbacks", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("invocations") as batch:
        batch.drop_column("handbacks")
