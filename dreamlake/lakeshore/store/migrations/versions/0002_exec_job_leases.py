"""Exec job leases: exec_jobs.attempt, max_attempts and lease_expires_at.

An exec job is claimed like an invocation: the claim bumps ``attempt`` and sets
``lease_expires_at``; the claimer's heartbeat renews it; ``expire_leases`` requeues a job whose
lease lapsed (``attempt < max_attempts``) or finishes it with exit code -1.

Rows that exist at upgrade time: a claimed job (running or done) is on attempt 1; a running one
gets a lease of a minute from now, so a live daemon renews it on its next heartbeat and the
job of a daemon that died before the upgrade (until now ``running`` for ever) is requeued.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

UPGRADE_LEASE_S = 60.0


def upgrade() -> None:
    op.add_column("exec_jobs", sa.Column("attempt", sa.Integer, nullable=False, server_default="0"))
    op.add_column("exec_jobs", sa.Column("max_attempts", sa.Integer, nullable=False, server_default="3"))
    op.add_column("exec_jobs", sa.Column("lease_expires_at", sa.Double(), nullable=True))
    op.create_index("ix_exec_jobs_lease", "exec_jobs", ["state", "lease_expires_at"])
    op.execute(sa.text("UPDATE exec_jobs SET attempt = 1 WHERE claimed_by IS NOT NULL"))
    op.execute(
        sa.text("UPDATE exec_jobs SET lease_expires_at = :lease WHERE state = 'running'").bindparams(
            lease=time.time() + UPGRADE_LEASE_S
        )
    )


def downgrade() -> None:
    op.drop_index("ix_exec_jobs_lease", table_name="exec_jobs")
    with op.batch_alter_table("exec_jobs") as batch:
        batch.drop_column("lease_expires_at")
        batch.drop_column("max_attempts")
        batch.drop_column("attempt")
