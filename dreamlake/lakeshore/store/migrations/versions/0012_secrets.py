"""secrets: a namespace's secrets (``lakeshore secret set``), sealed by the control plane.

One row per (namespace, name): ``sealed`` is the value encrypted with AES-GCM under the server key
``secrets`` (``server_key``, kept outside this table), with the namespace and the name as its
associated data, so a row moved to another name or namespace does not open. The plain value is
never stored (docs/security.md "Secrets").

Revision ID: 0012_secrets
Revises: 0009_placement
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_secrets"
down_revision = "0016_worker_stopped"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("namespace", sa.String(255), primary_key=True),
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("sealed", sa.LargeBinary, nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("secrets")
