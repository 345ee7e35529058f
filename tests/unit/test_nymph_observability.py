"""nymph's logs (text and JSON lines), metrics and the health server, over real HTTP."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nymph.observability import (
    INVOCATION_SECONDS,
    INVOCATIONS,
    OUTBOX_PENDING,
    POLLS,
    REGISTRY,
    RUNNING,
    InvocationAdapter,
    configure_logging,
    start_health_server,
)


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_carry_the_invocation_id(restore_root_logger: None) -> None:
    out = io.StringIO()
    configure_logging("json", "DEBUG", stream=out)
    logger = logging.getLogger("nymph.test")
    InvocationAdapter(logger, "01HZX0000000000000000000AB").info("started %s in %d ms", "proc", 12)
    logger.warning("plain line")
    try:
        raise RuntimeError("kaput")
    except RuntimeError:
        logger.exception("failed")

    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    first = lines[0]
    assert first["level"] == "INFO"
    assert first["logger"] == "nymph.test"
    assert first["invocation_id"] == "01HZX0000000000000000000AB"
    assert "started proc in 12 ms" in first["msg"]
    assert isinstance(first["ts"], float)
    assert "invocation_id" not in lines[1]
    assert "RuntimeError: kaput" in lines[2]["exc"]


def test_text_lines_and_level(restore_root_logger: None) -> None:
    out = io.StringIO()
    configure_logging("text", "WARNING", stream=out)
    logger = logging.getLogger("nymph.test")
    logger.info("hidden")
    InvocationAdapter(logger, "inv-1").warning("shown %d", 1)
    text = out.getvalue()
    assert "hidden" not in text
    assert "WARNING nymph.test: [inv-1] shown 1" in text


def test_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError, match="json"):
        configure_logging("yaml")


@pytest.fixture
def health_state() -> dict[str, Any]:
    return {"ok": True, "running": 0}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as client:
        yield client


@pytest.fixture
def server(health_state: dict[str, Any]) -> Iterator[str]:
    def health() -> dict[str, Any]:
        if health_state.get("raise"):
            raise RuntimeError("probe exploded")
        return dict(health_state)

    srv = start_health_server("127.0.0.1", 0, health)
    try:
        yield f"http://127.0.0.1:{srv.port}"
    finally:
        srv.stop()


def test_healthz_follows_the_health_callback(
    http: httpx.Client, server: str, health_state: dict[str, Any]
) -> None:
    r = http.get(f"{server}/healthz")
    assert r.status_code == 200
    assert r.json() == {"ok": True, "running": 0}

    health_state.update(ok=False, reason="control plane unreachable")
    r = http.get(f"{server}/healthz")
    assert r.status_code == 503
    assert r.json()["reason"] == "control plane unreachable"

    health_state["raise"] = True
    r = http.get(f"{server}/healthz")
    assert r.status_code == 503
    assert "probe exploded" in r.json()["error"]

    assert http.get(f"{server}/nope").status_code == 404


def test_metrics_expose_nymph_counters(http: httpx.Client, server: str) -> None:
    INVOCATIONS.labels(runner="obs-test", state="succeeded").inc()
    INVOCATION_SECONDS.labels(runner="obs-test").observe(2.5)
    POLLS.labels(outcome="obs-test").inc(3)
    RUNNING.set(2)
    OUTBOX_PENDING.set(5)

    r = http.get(f"{server}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'nymph_invocations_total{runner="obs-test",state="succeeded"} 1.0' in text
    assert 'nymph_invocation_seconds_count{runner="obs-test"} 1.0' in text
    assert 'nymph_polls_total{outcome="obs-test"} 3.0' in text
    assert "nymph_running 2.0" in text
    assert "nymph_outbox_pending 5.0" in text
    # Only nymph's registry: no process-global default collectors.
    assert "python_gc_objects_collected_total" not in text
    assert REGISTRY.get_sample_value("nymph_polls_total", {"outcome": "obs-test"}) == 3.0


def test_stop_frees_the_port(http: httpx.Client, health_state: dict[str, Any]) -> None:
    srv = start_health_server("127.0.0.1", 0, lambda: health_state)
    url = f"http://127.0.0.1:{srv.port}/healthz"
    assert http.get(url).status_code == 200
    srv.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url)
