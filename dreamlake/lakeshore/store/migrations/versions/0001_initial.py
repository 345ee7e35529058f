"""The initial schema: queues, functions, invocations, frames, topics, workers, tokens,
namespaces, exec_jobs, commands.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.String(64)
NAME = sa.String(255)


def _time(name: str, nullable: bool = False) -> sa.Column[float]:
    return sa.Column(name, sa.Double(), nullable=nullable)


def upgrade() -> None:
    op.create_table("queues", sa.Column("name", NAME, primary_key=True), _time("created_at"))
    op.create_table(
        "functions",
        sa.Column("function_key", ID, primary_key=True),
        sa.Column("function", sa.JSON, nullable=False),
        _time("created_at"),
    )
    op.create_table(
        "invocations",
        sa.Column("invocation_id", ID, primary_key=True),
        sa.Column("queue", NAME, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("priority", sa.BigInteger, nullable=False),
        sa.Column("function_key", ID, nullable=False),
        sa.Column("function", sa.JSON, nullable=False),
        sa.Column("args_blob", sa.LargeBinary, nullable=False),
        sa.Column("run_config", sa.JSON, nullable=False),
        sa.Column("code_context", sa.JSON, nullable=False),
        sa.Column("namespace", NAME, nullable=False),
        sa.Column("content_hash", ID, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("parent_invocation_id", ID, nullable=True),
        sa.Column("root_invocation_id", ID, nullable=True),
        sa.Column("idempotency_key", sa.String(1024), nullable=True),
        sa.Column("worker_id", ID, nullable=True),
        _time("submitted_at"),
        _time("started_at", True),
        _time("finished_at", True),
        _time("lease_expires_at", True),
        sa.Column("result_blob", sa.LargeBinary, nullable=True),
        sa.Column("error", sa.JSON, nullable=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
    )
    op.create_index("ix_invocations_claim", "invocations", ["state", "queue", "priority", "submitted_at"])
    op.create_index("ix_invocations_lease", "invocations", ["state", "lease_expires_at"])
    op.create_index("ix_invocations_root", "invocations", ["root_invocation_id"])
    op.create_index("ux_invocations_queue_key", "invocations", ["queue", "idempotency_key"], unique=True)
    op.create_table(
        "frames",
        sa.Column("owner_id", NAME, primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("final", sa.Boolean, nullable=False),
        _time("created_at"),
    )
    op.create_table(
        "topics",
        sa.Column("name", NAME, primary_key=True),
        sa.Column("next_seq", sa.BigInteger, nullable=False),
        _time("created_at"),
    )
    op.create_table(
        "workers",
        sa.Column("worker_id", ID, primary_key=True),
        sa.Column("info", sa.JSON, nullable=False),
        _time("registered_at"),
        _time("last_seen"),
    )
    op.create_table(
        "tokens",
        sa.Column("token_id", ID, primary_key=True),
        sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("namespace", NAME, nullable=True),
        sa.Column("name", NAME, nullable=False),
        _time("created_at"),
    )
    op.create_table(
        "namespaces",
        sa.Column("name", NAME, primary_key=True),
        sa.Column("nymph_version", sa.String(64), nullable=True),
        _time("updated_at"),
    )
    op.create_table(
        "exec_jobs",
        sa.Column("exec_id", ID, primary_key=True),
        sa.Column("namespace", NAME, nullable=False),
        sa.Column("command", sa.Text, nullable=False),
        sa.Column("payload_inline", sa.LargeBinary, nullable=True),
        sa.Column("payload_ref", sa.JSON, nullable=True),
        sa.Column("queue", NAME, nullable=False),
        sa.Column("worker_id", ID, nullable=True),
        _time("timeout_s", True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("claimed_by", ID, nullable=True),
        _time("created_at"),
        _time("claimed_at", True),
        _time("finished_at", True),
        sa.Column("result", sa.LargeBinary, nullable=True),
    )
    op.create_index("ix_exec_jobs_claim", "exec_jobs", ["state", "queue", "created_at"])
    op.create_table(
        "commands",
        sa.Column("command_id", ID, primary_key=True),
        sa.Column("worker_id", ID, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
        _time("created_at"),
    )
    op.create_index("ix_commands_worker", "commands", ["worker_id", "created_at"])


def downgrade() -> None:
    for table in (
        "commands",
        "exec_jobs",
        "namespaces",
        "tokens",
        "workers",
        "topics",
        "frames",
        "invocations",
        "functions",
        "queues",
    ):
        op.drop_table(table)
