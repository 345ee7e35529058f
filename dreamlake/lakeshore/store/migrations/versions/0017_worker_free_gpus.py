"""workers.free_gpus: the GPUs a worker offered free in its latest poll (issue 29).

``lakeshore workers`` and the dashboard show it beside the worker's capacity. Written by a poll
pass only when it differs from what that replica last wrote for the worker (an idle fleet writes
nothing more). Nullable: a worker that has not polled since this revision shows none.

Revision ID: 0017_worker_free_gpus
Revises: 0010_preemptions
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_worker_free_gpus"
down_revision = "0010_preemptions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("free_gpus", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("free_gpus")
