"""nymph's logs, metrics and health endpoint.

- :func:`configure_logging` sets up the root logger once, from the CLI: human text or JSON lines
  (``ts``, ``level``, ``logger``, ``msg``, and ``invocation_id`` / ``exec_id`` when the line is
  about one).
- :func:`log_context` says which job the lines logged inside it are about: every job runs its
  lifecycle inside one (:mod:`nymph.lifecycle`), so every line its thread logs, from nymph, the
  pump, the outbox or the runner, carries the job's id; the agent wraps what it logs about a job
  from other threads (a cancel, a lost lease) the same way. :class:`JobContextFilter`, installed
  on the handler by :func:`configure_logging`, copies the ids onto each record.
- :class:`InvocationAdapter` attaches an invocation id to the lines of one logger.
- The Prometheus metrics live in their own :data:`REGISTRY` (not the process-global default), so
  ``/metrics`` shows nymph's metrics only and tests do not collide.
- :func:`start_health_server` serves ``GET /healthz`` and ``GET /metrics`` from a small stdlib
  HTTP server on a daemon thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from nymph.errors import redact

log = logging.getLogger(__name__)

# --- logging ---------------------------------------------------------------------------------------

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTEXT_FIELDS = ("invocation_id", "exec_id")  # the ids a line can be about, in JSON output

# the ids of the current log context, as (field, id) pairs
_context: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "nymph_log_context", default=()
)


@contextlib.contextmanager
def log_context(**ids: str) -> Iterator[None]:
    """Every line logged inside (in this thread) is about ``ids`` (``invocation_id=`` / ``exec_id=``)."""
    unknown = set(ids) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(
            f"log context fields are {', '.join(CONTEXT_FIELDS)}, not {', '.join(sorted(unknown))}"
        )
    token = _context.set(tuple({**dict(_context.get()), **ids}.items()))
    try:
        yield
    finally:
        _context.reset(token)


class JobContextFilter(logging.Filter):
    """Copy the ids of the current :func:`log_context` onto each record (an explicit one wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in _context.get():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


class RedactFilter(logging.Filter):
    """Mask credentials (:func:`nymph.errors.redact`) in each record's message and traceback before
    a handler writes it: a ``--server`` URL with ``user:password@``, a presigned URL's signature, a
    token in an error message never reach the log."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (epoch seconds), level, logger, msg, invocation_id?, exec_id?, exc?."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                doc[name] = value
        if record.exc_text:  # already formatted (and redacted: RedactFilter)
            doc["exc"] = record.exc_text
        elif record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: str = "text", level: str | int = "INFO", stream: Any = None) -> None:
    """Send logs to ``stream`` (stderr) as ``text`` or ``json`` lines; replaces earlier handlers."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(JobContextFilter())
    handler.addFilter(RedactFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


class InvocationAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger for one invocation: prefixes messages with the id and sets ``invocation_id``."""

    def __init__(self, logger: logging.Logger, invocation_id: str) -> None:
        super().__init__(logger, {"invocation_id": invocation_id})
        self.invocation_id = invocation_id

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(kwargs.get("extra") or {}), "invocation_id": self.invocation_id}
        return f"[{self.invocation_id}] {msg}", kwargs


# --- metrics ---------------------------------------------------------------------------------------

REGISTRY = CollectorRegistry(auto_describe=True)

INVOCATIONS = Counter(
    "nymph_invocations",
    "Invocations finished by this nymph, by runner and final state.",
    ["runner", "state"],
    registry=REGISTRY,
)
INVOCATION_SECONDS = Histogram(
    "nymph_invocation_seconds",
    "Wall time from start to exit of an invocation.",
    ["runner"],
    buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
    registry=REGISTRY,
)
POLLS = Counter(
    "nymph_polls",
    "Polls of the control plane by outcome (claimed, empty, error, ...).",
    ["outcome"],
    registry=REGISTRY,
)
ACKS = Counter(
    "nymph_acks_delivered",
    "Acks the control plane settled, by how they went: carried by a poll, or a request of their own.",
    ["via"],
    registry=REGISTRY,
)
CODE_ARCHIVES = Counter(
    "nymph_code_archives",
    "Code archives calls shipped, by how the cache answered (hit, fetched, refused).",
    ["result"],
    registry=REGISTRY,
)
PIP_ENVS = Counter(
    "nymph_pip_envs",
    "Pip environments calls asked for, by how the cache answered (hit, built, failed).",
    ["result"],
    registry=REGISTRY,
)
PIP_ENV_BUILD_SECONDS = Histogram(
    "nymph_pip_env_build_seconds",
    "Time to resolve and build a pip environment (uv), per build.",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900),
    registry=REGISTRY,
)
RUNNING = Gauge("nymph_running", "Invocations running now.", registry=REGISTRY)
OUTBOX_PENDING = Gauge(
    "nymph_outbox_pending",
    "Acks and exec results in the outbox, and streams with frames, not yet confirmed.",
    registry=REGISTRY,
)
OUTBOX_BYTES = Gauge(
    "nymph_outbox_bytes", "Bytes of the messages in the outbox directory.", registry=REGISTRY
)
OUTBOX_BYTES_PEAK = Gauge(
    "nymph_outbox_bytes_peak", "The highest nymph_outbox_bytes since nymph started.", registry=REGISTRY
)
OUTBOX_AGE = Gauge(
    "nymph_outbox_age_seconds",
    "How long the outbox lane that waits longest has gone without delivering anything.",
    registry=REGISTRY,
)
STREAM_UNDELIVERED_FRAMES = Gauge(
    "nymph_stream_undelivered_frames",
    "Stream frames read from journals and not yet confirmed by the control plane.",
    registry=REGISTRY,
)
STREAM_UNDELIVERED_BYTES = Gauge(
    "nymph_stream_undelivered_bytes",
    "Stream bytes on disk (journals, script logs) not yet confirmed by the control plane.",
    registry=REGISTRY,
)
STREAM_UNDELIVERED_BYTES_PEAK = Gauge(
    "nymph_stream_undelivered_bytes_peak",
    "The highest nymph_stream_undelivered_bytes of one stream seen since nymph started.",
    registry=REGISTRY,
)
STREAM_PAUSED = Counter(
    "nymph_stream_paused_seconds",
    "Time streams spent with a full window (their task paused at its next yield).",
    registry=REGISTRY,
)
STREAM_FRAMES_SENT = Counter(
    "nymph_stream_frames_sent", "Stream frames confirmed by the control plane.", registry=REGISTRY
)
OUTPUT_BYTES_SENT = Counter(
    "nymph_output_bytes_sent",
    "Bytes of tasks' stdout/stderr delivered as LOG frames (confirmed, or left in the outbox to send).",
    registry=REGISTRY,
)
OUTPUT_TRUNCATED = Counter(
    "nymph_output_truncated",
    "Attempts whose output passed stream_log_max_bytes (the rest was not sent).",
    registry=REGISTRY,
)


def bind_outbox(outbox: Any) -> None:
    """Read the outbox gauges from ``outbox`` (its ``stats()``) at every scrape."""
    OUTBOX_AGE.set_function(lambda: outbox.stats()["oldest_s"])
    OUTBOX_BYTES.set_function(lambda: outbox.stats()["disk_bytes"])
    OUTBOX_BYTES_PEAK.set_function(lambda: outbox.stats()["disk_peak"])
    STREAM_UNDELIVERED_FRAMES.set_function(lambda: outbox.stats()["frames"])
    STREAM_UNDELIVERED_BYTES.set_function(lambda: outbox.stats()["bytes"])
    STREAM_UNDELIVERED_BYTES_PEAK.set_function(lambda: outbox.stats()["bytes_peak"])


# --- health and metrics server ---------------------------------------------------------------------


class HealthServer:
    """A running ``/healthz`` + ``/metrics`` server; :meth:`stop` shuts it down."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host: str = httpd.server_address[0]  # type: ignore[assignment]
        self.port: int = httpd.server_address[1]

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _handler(
    health: Callable[[], dict[str, Any]], registry: CollectorRegistry
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "nymph"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                try:
                    doc = dict(health())
                except Exception as exc:  # a broken probe is unhealthy, not a crash
                    log.exception("health check raised")
                    doc = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                body = json.dumps(doc, default=str).encode()
                self._send(200 if doc.get("ok") else 503, "application/json", body)
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            else:
                self._send(404, "application/json", b'{"error": "not found"}')

        def _send(self, status: int, ctype: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("health server: " + format, *args)

    return Handler


def start_health_server(
    host: str,
    port: int,
    health: Callable[[], dict[str, Any]],
    registry: CollectorRegistry = REGISTRY,
) -> HealthServer:
    """Serve ``GET /healthz`` (200 when ``health()["ok"]``, else 503) and ``GET /metrics``.

    ``port`` 0 picks a free port; the server's ``.port`` says which.
    """
    httpd = ThreadingHTTPServer((host, port), _handler(health, registry))
    httpd.daemon_threads = True
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="nymph-health", daemon=True
    )
    thread.start()
    server = HealthServer(httpd, thread)
    log.info("health and metrics on http://%s:%d/healthz and /metrics", server.host, server.port)
    return server
