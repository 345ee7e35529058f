"""invocations.preemptions and checkpoint_ref: attempts that ended ``preempted``, and the
checkpoint the next attempt starts from (issue 30).

A preempted attempt (its host stopped: nymph's shutdown or drain grace expired) requeues the call
at once without spending one of its ``max_attempts``: the attempts spent are ``attempt -
preemptions``, and ``run_config.max_preemptions`` (default 10) bounds the count. Rows written
before this revision were never preempted (0). ``checkpoint_ref`` ({bucket, key, size, sha256})
is the tar of the task's ``dls.checkpoint_dir()`` an attempt left in the payload store, set only by
the worker holding that attempt's lease; NULL: no checkpoint.

Revision ID: 0010_preemptions
Revises: 0012_secrets
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_preemptions"
down_revision = "0012_secrets"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("invocations", sa.Column("preemptions", sa.Integer, nullable=False, server_default="0"))
    op.add_column("invocations", sa.Column("checkpoint_ref", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("invocations") as batch:
        batch.drop_column("checkpoint_ref")
        batch.drop_column("preemptions")
