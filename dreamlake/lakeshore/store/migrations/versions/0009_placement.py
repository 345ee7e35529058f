"""Placement (issue 29): invocations.shape, per-(queue, shape) claim indexes, shapes and limits.

A call's shape names what placement matches of it (GPUs, selector, concurrency key; '' for none:
every row written before this revision). The claim indexes gain the shape after the queue, so a
claim reads the head of each shape its poller may take; a partial index of running rows lets the
claim count against a fleet-wide limit.

Revision ID: 0009_placement
Revises: 0008_shipdata
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_placement"
down_revision = "0008_shipdata"
branch_labels = None
depends_on = None

_DUE = "state = 'queued' AND not_before IS NULL"


def _queued_indexes(with_shape: bool) -> None:
    shape: list[str | sa.TextClause] = ["shape"] if with_shape else []
    order: list[str | sa.TextClause] = [sa.text("priority DESC"), "submitted_at", "invocation_id"]
    due = sa.text(_DUE)
    for name, lead in (("ix_invocations_queued", []), ("ix_invocations_queued_ns", ["namespace"])):
        cols: list[str | sa.TextClause] = [*lead, "queue", *shape, *order]
        op.create_index(name, "invocations", cols, sqlite_where=due, postgresql_where=due)


def upgrade() -> None:
    op.add_column("invocations", sa.Column("shape", sa.String(16), nullable=False, server_default=""))
    op.drop_index("ix_invocations_queued", table_name="invocations")
    op.drop_index("ix_invocations_queued_ns", table_name="invocations")
    _queued_indexes(with_shape=True)
    running = "state = 'running'"
    op.create_index(
        "ix_invocations_running",
        "invocations",
        ["queue", "shape"],
        sqlite_where=sa.text(running),
        postgresql_where=sa.text(running),
    )
    op.create_table(
        "shapes",
        sa.Column("queue", sa.String(255), primary_key=True),
        sa.Column("shape", sa.String(16), primary_key=True),
        sa.Column("needs", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_table(
        "limits",
        sa.Column("name", sa.String(300), primary_key=True),
        sa.Column("max_running", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("limits")
    op.drop_table("shapes")
    op.drop_index("ix_invocations_running", table_name="invocations")
    op.drop_index("ix_invocations_queued_ns", table_name="invocations")
    op.drop_index("ix_invocations_queued", table_name="invocations")
    _queued_indexes(with_shape=False)
    with op.batch_alter_table("invocations") as batch:
        batch.drop_column("shape")
