"""server_keys: secrets every replica of the control plane shares.

One row today, ``task-token``: the HMAC key that signs the credential nymph hands each invocation
(``LAKESHORE_TOKEN`` inside a task, docs/protocol.md "Task tokens"). Created on first use by the
store (``server_key``), so there is nothing to fill in here.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "server_keys",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("secret", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("server_keys")
