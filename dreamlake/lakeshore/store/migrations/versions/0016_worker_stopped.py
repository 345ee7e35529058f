"""workers.stopped_at: a nymph that stops cleanly deregisters at once (issue 35).

``POST /v1/daemon/deregister`` sets it; a worker with ``stopped_at`` is not live (``lakeshore
workers`` says ``stopped``, the queues count it no more), whatever its ``last_seen``. The next
register of that worker id clears it. Nullable: every worker written before this revision keeps
the live window as its only rule.

Revision ID: 0016_worker_stopped
Revises: 0009_placement
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_worker_stopped"
down_revision = "0009_placement"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("stopped_at", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("stopped_at")
