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
    recheck_s: float = 1.0  # re-check of waits that other replicas' changes may not wake
    poll_recheck_s: float = 30.0  # safety re-check of a long poll while wake-ups reach it reliably
    max_polls: int = 5000  # concurrent long polls; past it a poll is answered 503 + Retry-After
    poll_retry_after_s: int = 5  # Retry-After of that 503 (sent jittered, up to twice this)
    expire_every_s: float = 1.0
    store_threads: int | None = None  # None: 1 for SQLite, 8 otherwise
    # Connections (server.serve): a request's headers must arrive within header_timeout_s, a body
    # may pause at most body_timeout_s; connections past max_connections are closed on accept.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 2048
    max_header_bytes: int = 64 * 1024
    task_token_ttl_s: float = 86400.0  # the longest a task token lives (it dies with its ack first)

    @classmethod
    def from_env(cls, **overrides: object) -> ServerConfig:
        """Defaults, then the ``LAKESHORE_*`` variables of :data:`ENV`, then ``overrides``.
        A value that is not a positive number raises ValueError naming the variable."""
        values: dict[str, object] = {}
        for name, (key, kind) in ENV.items():
            raw = os.environ.get(name)
            if raw:
                try:
                    value = kind(raw)
                except ValueError:
                    value = 0
                if not value > 0:
                    raise ValueError(f"{name} must be a positive {kind.__name__}, got {raw!r}")
                values[key] = value
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


#: The environment variables ``ServerConfig.from_env`` reads: name -> (field, type).
ENV: dict[str, tuple[str, type[int] | type[float]]] = {
    "LAKESHORE_MAX_BODY_BYTES": ("max_body_bytes", int),
    "LAKESHORE_LEASE_S": ("lease_s", float),
    "LAKESHORE_HEADER_TIMEOUT_S": ("header_timeout_s", float),
    "LAKESHORE_BODY_TIMEOUT_S": ("body_timeout_s", float),
    "LAKESHORE_MAX_CONNECTIONS": ("max_connections", int),
}
