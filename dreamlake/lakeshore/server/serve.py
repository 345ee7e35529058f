"""Running the control plane under uvicorn: one process, or ``--workers N`` on one port.

``serve(spec, ...)`` is what ``lakeshore server`` calls once it has resolved its flags into a
:class:`ServeSpec` (store URL, Redis URL, config overrides). With one worker the app is built and
served in this process. With ``workers > 1`` uvicorn binds the port once and forks N worker
processes that accept on it; each builds its own app from the spec, handed down in the
``LAKESHORE_SERVE_SPEC`` environment variable (``app_from_env``, a uvicorn factory), and uvicorn
restarts a worker that dies.

Several processes share nothing but the store (and Redis), so this is the way past one core on
PostgreSQL, with ``--redis`` so live frames reach followers on every process. Over SQLite the
processes serialise on the file's write lock and do not wake each other's long polls (those
re-check the store about once a second), so it is allowed but rarely worth it.

The event loop and HTTP parser are uvicorn's fastest installed: ``uvloop`` and ``httptools``
(the ``server`` extra installs both), else asyncio and h11 (:func:`http_stack`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

SPEC_ENV = "LAKESHORE_SERVE_SPEC"


@dataclass(frozen=True)
class ServeSpec:
    """What a worker process needs to build the app: the store, Redis and config overrides."""

    db: str
    redis_url: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # ServerConfig fields set by flags

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str]) -> ServeSpec:
        raw = env.get(SPEC_ENV)
        if not raw:
            raise RuntimeError(f"{SPEC_ENV} is not set: start workers with 'lakeshore server --workers N'")
        return cls(**json.loads(raw))


def http_stack() -> tuple[str, str]:
    """uvicorn's ``loop`` and ``http`` settings: uvloop and httptools when installed."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http


def build_app(spec: ServeSpec, store: Any = None) -> Any:
    """The app over ``store`` (else the store at ``spec.db``, opened here)."""
    from dreamlake.lakeshore.server.app import create_app
    from dreamlake.lakeshore.server.config import ServerConfig
    from dreamlake.lakeshore.server.fanout import make_fanout
    from dreamlake.lakeshore.server.payloads import PayloadStore
    from dreamlake.lakeshore.store import open_store

    payloads = PayloadStore.from_env(os.environ)
    config = ServerConfig.from_env(**spec.config)
    store = store if store is not None else open_store(spec.db)
    return create_app(store, fanout=make_fanout(spec.redis_url), payloads=payloads, config=config)


def app_from_env() -> Any:
    """The uvicorn factory of a worker process (``--workers N``): the app ``LAKESHORE_SERVE_SPEC`` describes."""
    return build_app(ServeSpec.from_env(os.environ))


def serve(spec: ServeSpec, *, host: str, port: int, workers: int = 1, store: Any = None) -> None:
    """Serve the control plane on ``host:port`` with ``workers`` processes (see the module docstring)."""
    import uvicorn

    loop, http = http_stack()
    common: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": "warning",
        "timeout_graceful_shutdown": 5,
        "loop": loop,
        "http": http,
    }
    log.info("serving on %s:%d: %d worker(s), %s loop, %s HTTP", host, port, workers, loop, http)
    if workers <= 1:
        uvicorn.run(build_app(spec, store), **common)
        return
    if store is not None:
        store.close()  # each worker opens its own
    os.environ[SPEC_ENV] = spec.to_env()
    uvicorn.run(f"{__name__}:app_from_env", factory=True, workers=workers, **common)
