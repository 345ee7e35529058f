"""Trust boundaries (issue 11): script permission on tokens, workers bound to a token, namespaced
claims and namespaced idempotency keys.

- ``tokens.may_script``: whether a producer token may submit ``run_config.script`` invocations.
  Existing tokens get false: a script now needs a token minted with ``--may-script`` (and a nymph
  started with ``--allow-script``).
- ``workers.token_id``: the token a worker id is bound to. The first daemon call naming the worker
  (its register) binds it; from then on only that token acts as that worker. Existing workers are
  unbound and are bound by their next register.
- ``ix_invocations_queued_ns``: the claim order of one queue within one namespace, over queued rows
  only, for daemons whose token is bound to a namespace (as ``ix_invocations_queued`` is for the
  others).
- ``ux_invocations_queue_key`` becomes unique per (namespace, queue, key): a key used in one
  namespace neither collides with nor reveals one of another.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

QUEUED = sa.text("state = 'queued'")


def upgrade() -> None:
    op.add_column("tokens", sa.Column("may_script", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("workers", sa.Column("token_id", sa.String(64), nullable=True))
    op.create_index(
        "ix_invocations_queued_ns",
        "invocations",
        ["namespace", "queue", sa.text("priority DESC"), "submitted_at", "invocation_id"],
        sqlite_where=QUEUED,
        postgresql_where=QUEUED,
    )
    op.drop_index("ux_invocations_queue_key", table_name="invocations")
    op.create_index(
        "ux_invocations_queue_key", "invocations", ["namespace", "queue", "idempotency_key"], unique=True
    )


def downgrade() -> None:
    op.drop_index("ux_invocations_queue_key", table_name="invocations")
    op.create_index("ux_invocations_queue_key", "invocations", ["queue", "idempotency_key"], unique=True)
    op.drop_index("ix_invocations_queued_ns", table_name="invocations")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("token_id")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("may_script")
