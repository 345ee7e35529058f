"""Retries with backoff, each attempt's outcome, and retention (issue 12).

- ``invocations.not_before``: a retried invocation waits in ``queued`` until then. The claim
  indexes cover only queued rows that are due (``not_before IS NULL``), so a claim still reads
  them in claim order with no sort, whatever waits for its retry; ``expire_leases`` clears
  ``not_before`` once the time came (found by ``ix_invocations_delayed``).
- ``invocation_attempts``: the outcome of every attempt that did not end the invocation (a retried
  failure, a lapsed lease); the last attempt's outcome is the invocation row itself.
- ``ix_invocations_finished``: finished invocations by ``finished_at``, for the retention sweep.
- ``invocations.frames_attempt`` / ``frames_base``: the attempt whose frames the journal takes now
  and the journal position of its seq 0 (NULL: attempt 1, position 0). A later attempt that writes
  to a journal holding an earlier attempt's frames restarts it after a RESTART marker.

Revision ID: 0006_fplane
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_fplane"
down_revision = "0005"
branch_labels = None
depends_on = None

QUEUED = sa.text("state = 'queued'")
DUE = sa.text("state = 'queued' AND not_before IS NULL")
DELAYED = sa.text("not_before IS NOT NULL")
FINISHED = sa.text("finished_at IS NOT NULL")
_ORDER: list[str | sa.TextClause] = ["queue", sa.text("priority DESC"), "submitted_at", "invocation_id"]


def _claim_indexes(where: sa.TextClause) -> None:
    op.create_index(
        "ix_invocations_queued", "invocations", _ORDER, sqlite_where=where, postgresql_where=where
    )
    op.create_index(
        "ix_invocations_queued_ns",
        "invocations",
        ["namespace", *_ORDER],
        sqlite_where=where,
        postgresql_where=where,
    )


def upgrade() -> None:
    op.add_column("invocations", sa.Column("not_before", sa.Double(), nullable=True))
    op.add_column("invocations", sa.Column("frames_attempt", sa.Integer, nullable=True))
    op.add_column("invocations", sa.Column("frames_base", sa.BigInteger, nullable=True))
    op.drop_index("ix_invocations_queued", table_name="invocations")
    op.drop_index("ix_invocations_queued_ns", table_name="invocations")
    _claim_indexes(DUE)
    op.create_index(
        "ix_invocations_delayed",
        "invocations",
        ["not_before"],
        sqlite_where=DELAYED,
        postgresql_where=DELAYED,
    )
    op.create_index(
        "ix_invocations_finished",
        "invocations",
        ["finished_at"],
        sqlite_where=FINISHED,
        postgresql_where=FINISHED,
    )
    op.create_table(
        "invocation_attempts",
        sa.Column("invocation_id", sa.String(64), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("worker_id", sa.String(64), nullable=True),
        sa.Column("started_at", sa.Double(), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.Column("error", sa.JSON, nullable=True),
        sa.Column("retry_at", sa.Double(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("invocation_attempts")
    op.drop_index("ix_invocations_finished", table_name="invocations")
    op.drop_index("ix_invocations_delayed", table_name="invocations")
    op.drop_index("ix_invocations_queued_ns", table_name="invocations")
    op.drop_index("ix_invocations_queued", table_name="invocations")
    _claim_indexes(QUEUED)
    op.drop_column("invocations", "frames_base")
    op.drop_column("invocations", "frames_attempt")
    op.drop_column("invocations", "not_before")
