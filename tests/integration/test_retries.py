"""Retries through a real nymph and ``lakeshore server`` (issue 12, item 4).

Before: an exception or ``os._exit(17)`` failed on attempt 1 whatever ``max_attempts`` said. Now a
function declared ``retry_on=(TimeoutError,)`` runs again after its backoff and succeeds on its
third attempt, a base class matches (``OSError`` retries a ``ConnectionRefusedError``), a crashed
process is retried, an exception not named is final at once, and the status shows each attempt's
outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from tests import retry_fns
from tests.stack.nymph import Nymph
from tests.stack.producer import await_result, envelope, submit
from tests.stack.server import Server


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Server, Nymph]]:
    """``lakeshore server`` and one nymph with four slots, both subprocesses."""
    data = tmp_path / "cp"
    data.mkdir()
    srv = Server(data)
    srv.start()
    n = Nymph(srv.url, srv.tokens()["daemon"], tmp_path, "--concurrency", "4").start()
    try:
        yield srv, n
    finally:
        n.stop()
        srv.stop()


def _status(srv: Server, token: str, inv: str) -> dict[str, Any]:
    resp = httpx.get(f"{srv.url}/v1/producer/invocations/{inv}", headers={"Authorization": f"Bearer {token}"})
    return dict(msgpack.unpackb(resp.content, raw=False))


def _outcomes(status: dict[str, Any]) -> list[tuple[int, str, str | None]]:
    return [(a["attempt"], a["state"], (a["error"] or {}).get("type")) for a in status["attempts"]]


def test_declared_failures_and_crashes_retry_with_backoff_others_fail_at_once(
    stack: tuple[Server, Nymph], tmp_path: Path
) -> None:
    server, n = stack
    admin = server.tokens()["admin"]
    flaky = submit(
        server.url, admin, envelope(retry_fns.flaky, str(tmp_path / "flaky"), 2),
        max_attempts=3, retry_on=["TimeoutError"], backoff_s=0.2,
    )  # fmt: skip
    base = submit(
        server.url, admin, envelope(retry_fns.refused, str(tmp_path / "refused")),
        max_attempts=2, retry_on=["OSError"], backoff_s=0.1,
    )  # fmt: skip
    crash = submit(
        server.url, admin, envelope(retry_fns.crash, str(tmp_path / "crash")), max_attempts=2, backoff_s=0.1
    )
    final = submit(
        server.url, admin, envelope(retry_fns.bad_value, str(tmp_path / "bad")),
        max_attempts=3, retry_on=["TimeoutError"],
    )  # fmt: skip
    out = await_result(server.url, admin, flaky)
    assert out["state"] == "succeeded", n.output()[-3000:]
    assert msgpack.unpackb(out["result_blob"]) == "ok on call 3"
    status = _status(server, admin, flaky)
    assert status["attempt"] == 3
    assert _outcomes(status) == [
        (1, "failed", "TimeoutError"),
        (2, "failed", "TimeoutError"),
        (3, "succeeded", None),
    ]
    first, second = status["attempts"][:2]
    assert second["started_at"] >= first["retry_at"] >= first["finished_at"]  # not before its backoff
    detail = httpx.get(
        f"{server.url}/v1/ops/invocations/{flaky}", headers={"Authorization": f"Bearer {admin}"}
    )
    shown = [(a["attempt"], a["outcome"], (a["error"] or {}).get("type")) for a in detail.json()["attempts"]]
    assert shown == [(1, "failed", "TimeoutError"), (2, "failed", "TimeoutError"), (3, "succeeded", None)]

    assert await_result(server.url, admin, base)["state"] == "failed"
    assert _outcomes(_status(server, admin, base)) == [
        (1, "failed", "ConnectionRefusedError"),
        (2, "failed", "ConnectionRefusedError"),
    ]
    assert await_result(server.url, admin, crash)["state"] == "failed"
    assert _outcomes(_status(server, admin, crash)) == [
        (1, "failed", "ProcessExited"),
        (2, "failed", "ProcessExited"),
    ]
    assert (tmp_path / "crash").read_text() == "2"

    assert await_result(server.url, admin, final)["state"] == "failed"
    assert _outcomes(_status(server, admin, final)) == [(1, "failed", "ValueError")]
    assert (tmp_path / "bad").read_text() == "1"  # ran once
