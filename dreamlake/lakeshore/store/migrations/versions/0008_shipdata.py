"""invocations.args_ref / result_ref: arguments and results by reference (seed 003, issue 13).

An invocation whose Envelope is over ``INLINE_THRESHOLD_BYTES`` is submitted with ``args_ref``
(``{bucket, key, size, sha256}`` of the Envelope in the payload store) and an empty ``args_blob``;
a result over it is acked with ``result_ref`` and no ``result_blob``. Both nullable: every row
written before this revision keeps its inline bytes.

Revision ID: 0008_shipdata
Revises: 0006_fplane
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_shipdata"
down_revision = "0006_fplane"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("invocations", sa.Column("args_ref", sa.JSON, nullable=True))
    op.add_column("invocations", sa.Column("result_ref", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("invocations") as batch:
        batch.drop_column("result_ref")
        batch.drop_column("args_ref")
