"""Dashboard sessions held by the server, and per-namespace quotas (issue 31).

``ui_sessions``: the dashboard's cookie carries an opaque session id; the row (its sha256, never
the id itself) names the API token it signed in with and when it expires, so the cookie is not the
token and signing out ends the session everywhere. ``namespace_quotas``: the limits an operator
set with ``lakeshore namespace quota`` (NULL: no limit).

Revision ID: 0011_sessions_quotas
Revises: 0010_preemptions
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_sessions_quotas"
down_revision = "0017_worker_free_gpus"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ui_sessions",
        sa.Column("session_sha256", sa.String(64), primary_key=True),
        sa.Column("token_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
    )
    op.create_index("ix_ui_sessions_expires", "ui_sessions", ["expires_at"])
    op.create_table(
        "namespace_quotas",
        sa.Column("namespace", sa.String(255), primary_key=True),
        sa.Column("max_queued", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("namespace_quotas")
    op.drop_index("ix_ui_sessions_expires", table_name="ui_sessions")
    op.drop_table("ui_sessions")
