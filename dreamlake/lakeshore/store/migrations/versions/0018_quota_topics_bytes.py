"""Per-namespace quotas on topics and payload bytes (issue 31), beside 0011's queued invocations.

``namespace_quotas`` gains ``max_topics`` and ``max_payload_bytes`` (NULL: no limit). ``topics``
gains ``namespace``: the namespace of the producer that created the topic (its first post), so a
namespace's topics can be counted; topics made before this revision have none and count for no
namespace. ``payload_usage`` holds one row per presigned upload (its key, namespace and the size
the URL is bound to): the bytes a namespace may have put in the payload store lately.

Revision ID: 0018_quota_topics_bytes
Revises: 0011_sessions_quotas
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018_quota_topics_bytes"
down_revision = "0011_sessions_quotas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("namespace_quotas") as batch:
        batch.add_column(sa.Column("max_topics", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("max_payload_bytes", sa.BigInteger(), nullable=True))
    op.add_column("topics", sa.Column("namespace", sa.String(255), nullable=True))
    op.create_index("ix_topics_namespace", "topics", ["namespace"])
    op.create_table(
        "payload_usage",
        sa.Column("key", sa.String(1024), primary_key=True),
        sa.Column("namespace", sa.String(255), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
    )
    op.create_index("ix_payload_usage_ns", "payload_usage", ["namespace", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_payload_usage_ns", table_name="payload_usage")
    op.drop_table("payload_usage")
    op.drop_index("ix_topics_namespace", table_name="topics")
    with op.batch_alter_table("topics") as batch:
        batch.drop_column("namespace")
    with op.batch_alter_table("namespace_quotas") as batch:
        batch.drop_column("max_payload_bytes")
        batch.drop_column("max_topics")
