"""The store's tables, as SQLAlchemy Core metadata shared by SQLite and PostgreSQL.

This is the shape the code queries; ``migrations/versions`` creates it. A test compares the two
(Alembic autogenerate finds no difference), so change both together, in a new migration.

Times are ``DOUBLE`` seconds since the epoch; blobs are ``LargeBinary`` (BLOB / BYTEA); structured
fields are JSON text (``JSON``, not ``JSONB``: stored as given).
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

ID = sa.String(64)
NAME = sa.String(255)
TIME: sa.Double[float] = sa.Double()

queues = sa.Table(
    "queues",
    metadata,
    sa.Column("name", NAME, primary_key=True),
    sa.Column("created_at", TIME, nullable=False),
)

functions = sa.Table(
    "functions",
    metadata,
    sa.Column("function_key", ID, primary_key=True),  # sha256 hex of the canonical function JSON
    sa.Column("function", sa.JSON, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
)

invocations = sa.Table(
    "invocations",
    metadata,
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
    sa.Column("content_hash", ID, nullable=False),  # what makes a re-submit of this id identical
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("parent_invocation_id", ID, nullable=True),
    sa.Column("root_invocation_id", ID, nullable=True),
    sa.Column("idempotency_key", sa.String(1024), nullable=True),
    sa.Column("worker_id", ID, nullable=True),
    sa.Column("submitted_at", TIME, nullable=False),
    sa.Column("started_at", TIME, nullable=True),
    sa.Column("finished_at", TIME, nullable=True),
    sa.Column("lease_expires_at", TIME, nullable=True),
    sa.Column("result_blob", sa.LargeBinary, nullable=True),
    sa.Column("error", sa.JSON, nullable=True),
    sa.Column("cancel_requested", sa.Boolean, nullable=False),
    # 0006: a retried invocation waits queued until then (NULL: due); see ix_invocations_queued.
    sa.Column("not_before", TIME, nullable=True),
    # 0006: the attempt whose frames the journal takes and the position of its seq 0 (NULL: 1, 0)
    sa.Column("frames_attempt", sa.Integer, nullable=True),
    sa.Column("frames_base", sa.BigInteger, nullable=True),
    # 0008: payload refs (seed 003) instead of inline bytes: {bucket, key, size, sha256}; with
    # args_ref the args_blob is empty, with result_ref the result_blob is None
    sa.Column("args_ref", sa.JSON, nullable=True),
    sa.Column("result_ref", sa.JSON, nullable=True),
    # 0009: the call's placement shape (store/placement.py): '' needs nothing, else a hash of its
    # needs (GPUs, selector, concurrency key) named in ``shapes``
    sa.Column("shape", sa.String(16), nullable=False, server_default=""),
    # 0010: attempts that ended ``preempted`` (the host stopped): they spend no max_attempts, so
    # the attempts spent are ``attempt - preemptions``; run_config.max_preemptions bounds them
    sa.Column("preemptions", sa.Integer, nullable=False, server_default="0"),
    # 0019: attempts handed back before they started (a ``preempted`` ack with ``error.started``
    # false): they spend neither max_attempts nor max_preemptions (store/retry.py, MAX_HANDBACKS)
    sa.Column("handbacks", sa.Integer, nullable=False, server_default="0"),
    # 0010: the checkpoint the next attempt starts from ({bucket, key, size, sha256}, a tar of the
    # task's dls.checkpoint_dir() in the payload store), set by the attempt that held the lease
    sa.Column("checkpoint_ref", sa.JSON, nullable=True),
    # 0020: every row, not only the running ones: listings by state read it (migration 0020)
    sa.Index("ix_invocations_lease", "state", "lease_expires_at"),
    # 0004: a key is unique within its namespace and queue; 0020: every row, not only the keyed
    # ones: the reads of one namespace search it by its first column (migration 0020)
    sa.Index("ux_invocations_queue_key", "namespace", "queue", "idempotency_key", unique=True),
)
# 0020: only the rows with a root (a submit with no parent skips it); ``root_invocation_id = x``
# implies the predicate, so the lineage reads use it as they used the full index.
_HAS_ROOT = invocations.c.root_invocation_id.isnot(None)
sa.Index(
    "ix_invocations_root",
    invocations.c.root_invocation_id,
    sqlite_where=_HAS_ROOT,
    postgresql_where=_HAS_ROOT,
)
# 0003: the claim order of one queue, over queued rows only (see claims.claim_statement);
# 0006: only those due (a retry waiting for its backoff is not in it: claims stay a range read);
# 0009: per (queue, shape): a claim reads the head of each shape its poller may take.
_DUE = sa.and_(invocations.c.state == "queued", invocations.c.not_before.is_(None))
sa.Index(
    "ix_invocations_queued",
    invocations.c.queue,
    invocations.c.shape,
    invocations.c.priority.desc(),
    invocations.c.submitted_at,
    invocations.c.invocation_id,
    sqlite_where=_DUE,
    postgresql_where=_DUE,
)
# 0004: the same within one namespace, for claims of daemons bound to a namespace.
sa.Index(
    "ix_invocations_queued_ns",
    invocations.c.namespace,
    invocations.c.queue,
    invocations.c.shape,
    invocations.c.priority.desc(),
    invocations.c.submitted_at,
    invocations.c.invocation_id,
    sqlite_where=_DUE,
    postgresql_where=_DUE,
)

# 0006: retries waiting for their time, and finished invocations by age (the retention sweep).
sa.Index(
    "ix_invocations_delayed",
    invocations.c.not_before,
    sqlite_where=invocations.c.not_before.isnot(None),
    postgresql_where=invocations.c.not_before.isnot(None),
)
sa.Index(
    "ix_invocations_finished",
    invocations.c.finished_at,
    sqlite_where=invocations.c.finished_at.isnot(None),
    postgresql_where=invocations.c.finished_at.isnot(None),
)

# 0009: running invocations by queue and shape: what a fleet-wide limit counts in the claim.
_RUNNING = invocations.c.state == "running"
sa.Index(
    "ix_invocations_running",
    invocations.c.queue,
    invocations.c.shape,
    sqlite_where=_RUNNING,
    postgresql_where=_RUNNING,
)

# 0009: the placement shapes submitted to each queue (store/placement.py): few rows, which the
# claim reads (cached) to know which heads of ix_invocations_queued a poller may take.
shapes = sa.Table(
    "shapes",
    metadata,
    sa.Column("queue", NAME, primary_key=True),
    sa.Column("shape", sa.String(16), primary_key=True),
    sa.Column("needs", sa.JSON, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
)

# 0009: fleet-wide limits on running invocations: ``queue:<name>`` (lakeshore queue limit) and
# ``key:<concurrency_key>`` (@dls.udf max_concurrency). The claim locks the rows it counts against.
limits = sa.Table(
    "limits",
    metadata,
    sa.Column("name", sa.String(300), primary_key=True),
    sa.Column("max_running", sa.Integer, nullable=False),
    sa.Column("updated_at", TIME, nullable=False),
)

# 0006: the outcome of each attempt that did not end its invocation (a retried failure, a lapsed
# lease); the last attempt's is the invocation row's own state and error.
invocation_attempts = sa.Table(
    "invocation_attempts",
    metadata,
    sa.Column("invocation_id", ID, primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("state", sa.String(16), nullable=False),  # failed | timeout | lost | preempted
    sa.Column("worker_id", ID, nullable=True),
    sa.Column("started_at", TIME, nullable=True),
    sa.Column("finished_at", TIME, nullable=False),
    sa.Column("error", sa.JSON, nullable=True),
    sa.Column("retry_at", TIME, nullable=True),  # when the next attempt became claimable
)

frames = sa.Table(
    "frames",
    metadata,
    sa.Column("owner_id", NAME, primary_key=True),  # an invocation id, or "topic:<name>"
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("final", sa.Boolean, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
)

topics = sa.Table(
    "topics",
    metadata,
    sa.Column("name", NAME, primary_key=True),
    sa.Column("next_seq", sa.BigInteger, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
    # 0018: the namespace of the producer whose post made the topic (None: made before 0018)
    sa.Column("namespace", NAME, nullable=True),
    sa.Index("ix_topics_namespace", "namespace"),
)

workers = sa.Table(
    "workers",
    metadata,
    sa.Column("worker_id", ID, primary_key=True),
    sa.Column("info", sa.JSON, nullable=False),
    sa.Column("registered_at", TIME, nullable=False),
    sa.Column("last_seen", TIME, nullable=False),
    # 0004: the token this worker id is bound to (its first register binds it); None: unbound.
    sa.Column("token_id", ID, nullable=True),
    # 0016: when it deregistered (a clean stop); None: it has not. A stopped worker is not live.
    sa.Column("stopped_at", TIME, nullable=True),
    # 0017: the GPUs it offered free in its latest poll (placement); None: it has not polled since.
    sa.Column("free_gpus", sa.Integer, nullable=True),
)

tokens = sa.Table(
    "tokens",
    metadata,
    sa.Column("token_id", ID, primary_key=True),
    sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("namespace", NAME, nullable=True),
    sa.Column("name", NAME, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
    # 0004: may this (producer) token submit run_config.script invocations?
    sa.Column("may_script", sa.Boolean, nullable=False, server_default=sa.false()),
)

server_keys = sa.Table(  # secrets the control plane's replicas share (the task-token HMAC key)
    "server_keys",
    metadata,
    sa.Column("name", NAME, primary_key=True),
    sa.Column("secret", sa.LargeBinary, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
)

ui_sessions = sa.Table(  # 0011: the dashboard's sessions (the cookie holds an id, this its sha256)
    "ui_sessions",
    metadata,
    sa.Column("session_sha256", sa.String(64), primary_key=True),
    sa.Column("token_id", ID, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
    sa.Column("expires_at", TIME, nullable=False),
    sa.Index("ix_ui_sessions_expires", "expires_at"),
)

namespace_quotas = sa.Table(  # 0011: per-namespace limits (``lakeshore namespace quota``); NULL: none
    "namespace_quotas",
    metadata,
    sa.Column("namespace", NAME, primary_key=True),
    sa.Column("max_queued", sa.BigInteger, nullable=True),
    sa.Column("updated_at", TIME, nullable=False),
    sa.Column("max_topics", sa.BigInteger, nullable=True),  # 0018
    sa.Column("max_payload_bytes", sa.BigInteger, nullable=True),  # 0018
)

payload_usage = sa.Table(  # 0018: one row per presigned upload, for the payload-bytes quota
    "payload_usage",
    metadata,
    sa.Column("key", sa.String(1024), primary_key=True),
    sa.Column("namespace", NAME, nullable=False),
    sa.Column("size", sa.BigInteger, nullable=False),  # the size the presigned PUT is bound to
    sa.Column("created_at", TIME, nullable=False),
    sa.Index("ix_payload_usage_ns", "namespace", "created_at"),
)

secrets = sa.Table(  # 0012: a namespace's secrets, sealed by the control plane (server/secrets.py)
    "secrets",
    metadata,
    sa.Column("namespace", NAME, primary_key=True),
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("sealed", sa.LargeBinary, nullable=False),  # AES-GCM under a key kept outside this table
    sa.Column("updated_at", TIME, nullable=False),
)

namespaces = sa.Table(
    "namespaces",
    metadata,
    sa.Column("name", NAME, primary_key=True),
    sa.Column("nymph_version", sa.String(64), nullable=True),
    sa.Column("updated_at", TIME, nullable=False),
)

exec_jobs = sa.Table(
    "exec_jobs",
    metadata,
    sa.Column("exec_id", ID, primary_key=True),
    sa.Column("namespace", NAME, nullable=False),
    sa.Column("command", sa.Text, nullable=False),
    sa.Column("payload_inline", sa.LargeBinary, nullable=True),
    sa.Column("payload_ref", sa.JSON, nullable=True),
    sa.Column("queue", NAME, nullable=False),
    sa.Column("worker_id", ID, nullable=True),  # the worker it is meant for; None: any
    sa.Column("timeout_s", TIME, nullable=True),
    sa.Column("state", sa.String(16), nullable=False),  # queued | running | done
    sa.Column("claimed_by", ID, nullable=True),  # the worker of the latest claim (kept on a requeue)
    sa.Column("created_at", TIME, nullable=False),
    sa.Column("claimed_at", TIME, nullable=True),
    sa.Column("finished_at", TIME, nullable=True),
    sa.Column("result", sa.LargeBinary, nullable=True),  # msgpack of the published result dict
    # 0002: leases, as on invocations. attempt 0 before the first claim; the claim increments it.
    sa.Column("attempt", sa.Integer, nullable=False, server_default="0"),
    sa.Column("max_attempts", sa.Integer, nullable=False, server_default="3"),
    sa.Column("lease_expires_at", TIME, nullable=True),
    sa.Index("ix_exec_jobs_claim", "state", "queue", "created_at"),
    sa.Index("ix_exec_jobs_lease", "state", "lease_expires_at"),
)

commands = sa.Table(
    "commands",
    metadata,
    sa.Column("command_id", ID, primary_key=True),
    sa.Column("worker_id", ID, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("body", sa.JSON, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
    sa.Index("ix_commands_worker", "worker_id", "created_at"),
)
