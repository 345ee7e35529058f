"""The daemon routes as a test drives them by hand: poll for work, a frame's bytes, follow a result stream."""

from __future__ import annotations

import threading
from typing import Any

from dreamlake.lakeshore import wire
from tests.integration.conftest import ControlPlane


def poll(
    cp: ControlPlane, worker: str, queues: list[str] | None = None, timeout_s: float = 2, limit: int = 1
) -> dict[str, Any]:
    status, out = cp.daemon(
        "/v1/daemon/poll",
        {
            "worker_id": worker,
            "queues": queues or ["default"],
            "max": limit,
            "timeout_s": timeout_s,
            "version": "0.1.0",
        },
    )
    assert status == 200, out
    return out  # type: ignore[no-any-return]


def frame(seq: int, kind: int = wire.FRAME_VALUE) -> bytes:
    return wire.encode_frame(kind, seq, wire.pack(seq), {"ts": 0.0})


def follow(cp: ControlPlane, inv: str, timeout: float, started: threading.Event | None = None) -> list[Any]:
    """``(seq, kind)`` of each frame the result stream sends, until the server ends the body."""
    url = f"/v1/producer/invocations/{inv}/result/stream?since=-1&timeout={timeout}"
    reader = wire.FrameReader()
    seen: list[Any] = []
    with cp.client(cp.producer_token, timeout=timeout + 30).stream("GET", url) as resp:
        assert resp.status_code == 200
        if started is not None:
            started.set()
        for chunk in resp.iter_bytes():
            seen += [(f.seq, f.kind) for f in reader.feed(chunk)]
    return seen
