"""ServerConfig: the control plane's knobs as one small value object with named defaults."""

from __future__ import annotations

from dataclasses import dataclass

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.store.api import DEFAULT_LEASE_S

MiB = 1024 * 1024
DEFAULT_RETENTION_S = 7 * 86400.0  # finished invocations, their frames and payloads: a week
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(text: str, what: str = "retention") -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or plain seconds; ``0``/``off``/``never``: 0 (keep for
    ever). ValueError naming ``what`` and the accepted forms otherwise."""
    raw = text.strip().lower()
    if raw in ("off", "never", "forever", "0"):
        return 0.0
    unit = _UNITS.get(raw[-1:]) if raw else None
    number = raw[:-1] if unit is not None else raw
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        value = -1.0
    if not value >= 0 or value != value or value == float("inf"):
        raise ValueError(f"{what} {text!r}: give a duration such as 7d, 12h, 90m, 3600 (seconds) or off")
    return value


def parse_queue_retention(items: tuple[str, ...] | list[str]) -> tuple[tuple[str, float], ...]:
    """``["gpu=30d", "scratch=1h"]`` as ``(("gpu", 2592000.0), ("scratch", 3600.0))``."""
    out: dict[str, float] = {}
    for item in items:
        queue, sep, duration = item.partition("=")
        if not sep or not queue.strip():
            raise ValueError(f"--retention-queue {item!r}: give QUEUE=DURATION, e.g. gpu=30d")
        out[queue.strip()] = parse_duration(duration, f"--retention-queue {queue.strip()}")
    return tuple(sorted(out.items()))


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
    submit_batch_max: int = 1000  # submits per POST /v1/producer/submit-batch; past it: 413
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
    keep_alive_s: float = 30.0  # above nymph's heartbeat period: a fleet's side connections stay
    max_connections: int = 10240  # a nymph holds two (its long poll and a side one); max_polls 5000
    max_header_bytes: int = 64 * 1024
    task_token_ttl_s: float = 86400.0  # the longest a task token lives (it dies with its ack first)
    # Retention (store/retention.py): finished work older than this is deleted by the sweep, every
    # gc_every_s, gc_batch invocations per transaction; 0 keeps it for ever. A queue named in
    # retention_queues keeps its own (``--retention-queue gpu=30d``).
    retention_s: float = DEFAULT_RETENTION_S
    retention_queues: tuple[tuple[str, float], ...] = ()
    gc_every_s: float = 300.0
    gc_batch: int = 200

    @classmethod
    def from_env(cls, **overrides: object) -> ServerConfig:
        """Defaults, then the ``LAKESHORE_*`` variables of :data:`ENV`, then ``overrides``.
        A value that is not a positive number raises ValueError naming the variable."""
        values: dict[str, object] = {}
        for name, (key, kind) in ENV.items():
            if envvars.is_set(name):
                values[key] = (
                    envvars.integer(name, minimum=1) if kind is int else envvars.number(name, positive=True)
                )
        values.update({k: v for k, v in overrides.items() if v is not None})
        queues = values.get("retention_queues")
        if isinstance(queues, (list, tuple)):  # JSON (a worker's ServeSpec) makes lists of lists
            values["retention_queues"] = tuple((str(q), float(s)) for q, s in queues)
        return cls(**values)  # type: ignore[arg-type]


#: The environment variables ``ServerConfig.from_env`` reads: name -> (field, type).
ENV: dict[str, tuple[str, type[int] | type[float]]] = {
    "LAKESHORE_MAX_BODY_BYTES": ("max_body_bytes", int),
    "LAKESHORE_SUBMIT_BATCH_MAX": ("submit_batch_max", int),
    "LAKESHORE_LEASE_S": ("lease_s", float),
    "LAKESHORE_EXPIRE_EVERY_S": ("expire_every_s", float),
    "LAKESHORE_HEADER_TIMEOUT_S": ("header_timeout_s", float),
    "LAKESHORE_BODY_TIMEOUT_S": ("body_timeout_s", float),
    "LAKESHORE_MAX_CONNECTIONS": ("max_connections", int),
    "LAKESHORE_MAX_HEADER_BYTES": ("max_header_bytes", int),
    "LAKESHORE_KEEP_ALIVE_S": ("keep_alive_s", float),
}
