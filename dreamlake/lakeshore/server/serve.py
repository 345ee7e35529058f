"""Serving the control plane under uvicorn: one process, or ``--workers N`` on one port, with read
deadlines and a connection cap so idle sockets cannot pile up.

``serve(spec, ...)`` is what ``lakeshore server`` calls once it has resolved its flags into a
:class:`ServeSpec` (store URL, Redis URL, config overrides). With one worker the app is built and
served in this process. With ``workers > 1`` uvicorn binds the port once and forks N worker
processes that accept on it; each builds its own app from the spec, handed down in the
``LAKESHORE_SERVE_SPEC`` environment variable (``app_from_env``, a uvicorn factory), and uvicorn
restarts a worker that dies.

Several processes share nothing but the store (and Redis), so this is the way past one core on
PostgreSQL, with ``--redis`` so live frames reach followers on every process. Over SQLite the
processes serialise on the file's write lock and see each other's submits only at the poll hub's
safety re-check (``poll_recheck_s``), so it is allowed but rarely worth it.

``--workers auto`` (the default) is :func:`auto_workers`: a process per core, up to
``AUTO_WORKERS_MAX``, over PostgreSQL with Redis; one process otherwise (over SQLite a second
process only adds lock waits; without Redis a follower on one process would not hear the frames of
a call another process serves).

The connections' guard (read deadlines, the connection cap, the header bound, coalesced writes)
is ``server/guard.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.server import gctune
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.server.guard import (
    event_loop,
    guard_options,
    http_parser,
    plane_context,
    protocol_class,
    set_process_limits,
    uvicorn_config,
)

log = logging.getLogger(__name__)

SPEC_ENV = "LAKESHORE_SERVE_SPEC"
AUTO_WORKERS_MAX = 4  # past it the processes mostly contend for PostgreSQL's connections and locks


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def auto_workers(store_kind: str, redis_url: str | None, cores: int | None = None) -> int:
    """``--workers auto``: ``min(cores, AUTO_WORKERS_MAX)`` processes over PostgreSQL with Redis,
    one otherwise (see the module docstring; docs/performance.md has what each buys on 2 cores)."""
    if store_kind != "postgresql" or not redis_url:
        return 1
    return max(1, min(cores if cores is not None else usable_cores(), AUTO_WORKERS_MAX))


@dataclass(frozen=True)
class ServeSpec:
    """What a worker process needs to build the app: the store, Redis and config overrides."""

    db: str
    redis_url: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # ServerConfig fields set by flags

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServeSpec:
        raw = envvars.string(SPEC_ENV, env)
        if not raw:
            raise RuntimeError(f"{SPEC_ENV} is not set: start workers with 'lakeshore server --workers N'")
        return cls(**json.loads(raw))


def _gc_observer(app: Any) -> Any:
    """``lakeshore_gc_pause_seconds`` of the app's metrics, as ``gctune.tune`` reports pauses."""
    ctx = plane_context(app)
    if ctx is None:
        return None
    pause = ctx.metrics.gc_pause
    return lambda generation, seconds: pause.labels(generation=str(generation)).observe(seconds)


def _config(spec: ServeSpec) -> ServerConfig:
    return ServerConfig.from_env(**spec.config)


def build_app(spec: ServeSpec, store: Any = None) -> Any:
    """The app over ``store`` (else the store at ``spec.db``, opened here)."""
    from dreamlake.lakeshore.server.app import create_app
    from dreamlake.lakeshore.server.blobdir import BlobDir
    from dreamlake.lakeshore.server.fanout import make_fanout
    from dreamlake.lakeshore.server.payloads import PayloadConfig, PayloadStore
    from dreamlake.lakeshore.store import open_store

    payloads: Any = PayloadStore.from_env()
    config = _config(spec)
    store = store if store is not None else open_store(spec.db)
    if payloads is None:  # no bucket: the blob directory next to a SQLite file (or LAKESHORE_BLOBS_DIR)
        payloads = BlobDir.for_store(store, None, PayloadConfig.from_env())
    return create_app(store, fanout=make_fanout(spec.redis_url), payloads=payloads, config=config)


def app_from_env() -> Any:
    """The uvicorn factory of a worker process (``--workers N``): the app ``LAKESHORE_SERVE_SPEC``
    describes. It also sets the guard's limits in this process, as the parent hands the protocol
    class down by name (a class made by :func:`guarded_protocol` cannot be)."""
    spec = ServeSpec.from_env()
    config = _config(spec)
    set_process_limits(config)
    app = build_app(spec)
    ctx = plane_context(app)
    if ctx is not None:  # sibling processes write work whose wake-ups this one may never hear of
        ctx.polls.shared_store = True  # (over SQLite: polls re-check every recheck_s, none skip)
        ctx.writer.inline_lock = None  # a sibling may hold SQLite's file lock: never wait on the loop
    gctune.tune(_gc_observer(app))
    return app


def serve(
    spec: ServeSpec,
    *,
    host: str,
    port: int,
    workers: int = 1,
    store: Any = None,
    tls: dict[str, Any] | None = None,
) -> None:
    """Serve the control plane on ``host:port`` with ``workers`` processes (see the module
    docstring); ``tls``: uvicorn's ``ssl_certfile`` / ``ssl_keyfile`` (HTTPS; ``tls.server_options``)."""
    import uvicorn

    config = _config(spec)
    loop = event_loop()
    parser = http_parser()
    common: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": "warning",
        "timeout_graceful_shutdown": 5,
        "loop": loop,
        **(tls or {}),
    }
    log.info("serving on %s:%d: %d worker(s), %s loop, guarded %s HTTP", host, port, workers, loop, parser)
    if workers <= 1:
        app = build_app(spec, store)
        gctune.tune(_gc_observer(app))
        uvicorn.Server(uvicorn_config(app, config, parser=parser, **common)).run()
        return
    if store is not None:
        store.close()  # each worker opens its own
    os.environ[SPEC_ENV] = spec.to_env()
    # A connection cap per process: ``max_connections`` each (the port's total is workers times it).
    uvicorn.run(
        f"{__name__}:app_from_env",
        factory=True,
        workers=workers,
        http=protocol_class(parser),
        **guard_options(config),
        **common,
    )
