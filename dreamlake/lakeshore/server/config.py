"""ServerConfig: the control plane's knobs as one small value object with named defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dreamlake.lakeshore.store.api import DEFAULT_LEASE_S

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """Limits and timings of the control plane. ``from_env`` reads ``LAKESHORE_*`` once, in the CLI."""

    lease_s: float = DEFAULT_LEASE_S
    heartbeat_s: float = 10.0
    max_body_bytes: int = 110 * MiB
    poll_default_s: float = 30.0
    poll_max_s: float = 120.0
    await_default_s: float = 60.0
    await_max_s: float = 300.0
    stream_default_s: float = 30.0
    stream_max_s: float = 3600.0
    exec_wait_max_s: float = 300.0
    poll_max_commands: int = 64
    recheck_s: float = 1.0  # safety re-check of long polls (other replicas do not wake this one)
    expire_every_s: float = 1.0
    store_threads: int | None = None  # None: 1 for SQLite, 8 otherwise
    task_token_ttl_s: float = 86400.0  # the longest a task token lives (it dies with its ack first)

    @classmethod
    def from_env(cls, **overrides: object) -> ServerConfig:
        """Defaults, then ``LAKESHORE_MAX_BODY_BYTES`` / ``LAKESHORE_LEASE_S``, then ``overrides``."""
        values: dict[str, object] = {}
        body = os.environ.get("LAKESHORE_MAX_BODY_BYTES")
        if body:
            values["max_body_bytes"] = int(body)
        lease = os.environ.get("LAKESHORE_LEASE_S")
        if lease:
            values["lease_s"] = float(lease)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
