"""Flow control end to end (issue 15): generators that yield faster than the network, through one
real nymph (process runner) and ``lakeshore server`` subprocesses.

Each stream must end in one success on attempt 1 with every frame delivered once and in order,
while nymph's undelivered bytes and its outbox stay under the configured bounds (read from its
``/metrics``). A control-plane outage in the middle of a stream costs latency, never the result.
No assertion is about speed; ``bench/streams.py`` measures that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import wire
from tests import nymph_fns
from tests.integration.flow_kit import (
    Follower,
    MiB,
    RssPeak,
    nymph_metrics,
    stack,
    start_with_metrics,
    values,
)
from tests.stack.nymph import Nymph
from tests.stack.producer import await_result, envelope, submit
from tests.stack.server import Server
from tests.stack.wait import until

__all__ = ["stack"]  # the fixture (flow_kit)

pytestmark = pytest.mark.slow  # real nymph and server processes, 100,000 values


def _run_stream(
    srv: Server, n: Nymph, port: int, fn: Any, args: tuple[Any, ...], expect: Callable[[int], Any], count: int
) -> tuple[dict[str, float], Follower, dict[str, Any]]:
    tokens = srv.tokens()
    inv = submit(srv.url, tokens["admin"], envelope(fn, *args))
    follower = Follower(srv.url, tokens["admin"], inv, values(expect))
    end = follower.result()
    assert end.kind == wire.FRAME_END and end.seq == count, n.output()[-3000:]
    assert follower.count == count + 1  # every value once, in order, then END
    out = await_result(srv.url, tokens["admin"], inv)
    assert out["state"] == "succeeded", n.output()[-3000:]
    status = httpx.get(
        f"{srv.url}/v1/producer/invocations/{inv}",
        headers={"Authorization": f"Bearer {tokens['admin']}"},
        timeout=10,
    )
    info = msgpack.unpackb(status.content, raw=False)
    assert info["attempt"] == 1, info
    until(lambda: not (n.workdir / inv).exists(), "the workdir to go")
    return nymph_metrics(port), follower, info


def test_a_hundred_thousand_values_arrive_once_in_order_on_attempt_1(
    stack: tuple[Server, Callable[..., Nymph]],
) -> None:
    srv, factory = stack
    window_frames = 2000
    n, port = start_with_metrics(factory, srv, "--stream-window-frames", str(window_frames))
    count = 100_000
    metrics, _follower, _info = _run_stream(srv, n, port, nymph_fns.count_to, (count,), lambda i: i, count)
    assert metrics["nymph_stream_frames_sent_total"] >= count + 1
    # the task paused at the window: never more than window_frames small frames waited on disk
    assert 0 < metrics["nymph_stream_undelivered_bytes_peak"] <= window_frames * 64
    assert metrics["nymph_outbox_bytes_peak"] < 64 * 1024  # the ack alone went through the outbox dir


def test_two_hundred_values_of_one_mib_stay_within_the_window(
    stack: tuple[Server, Callable[..., Nymph]],
) -> None:
    srv, factory = stack
    window = 8 * MiB
    n, port = start_with_metrics(
        factory, srv, "--stream-window-bytes", str(window), "--stream-max-bytes", str(64 * MiB)
    )
    assert n.proc is not None
    rss = RssPeak(n.proc.pid)
    size = MiB

    def expect(i: int) -> bytes:
        return bytes([i % 256]) * size

    metrics, _follower, _info = _run_stream(srv, n, port, nymph_fns.blobs, (200, size), expect, 200)
    peak = rss.stop()
    frame = size + 64  # one value's frame
    assert metrics["nymph_stream_undelivered_bytes_peak"] <= window + frame
    assert metrics["nymph_outbox_bytes_peak"] < 64 * 1024
    # nymph holds a batch (1 MiB by default), never the stream: its memory grows by a few batches
    assert peak - rss.base < 48 * MiB, (rss.base, peak)  # the stream carries 200 MiB
    print(f"nymph rss: base {rss.base / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB")


def test_a_control_plane_outage_mid_stream_ends_in_one_success_on_attempt_1(
    stack: tuple[Server, Callable[..., Nymph]], tmp_path: Path
) -> None:
    srv, factory = stack
    window_frames = 1000
    n, port = start_with_metrics(factory, srv, "--stream-window-frames", str(window_frames))
    tokens = srv.tokens()
    count, gate = 30_000, tmp_path / "gate"
    inv = submit(srv.url, tokens["admin"], envelope(nymph_fns.count_to, count, str(gate), count // 2))
    follower = Follower(srv.url, tokens["admin"], inv, values(lambda i: i))
    until(lambda: follower.last >= count // 2 - 1, "the first half to arrive")
    srv.stop()  # the control plane goes away in the middle of the stream
    gate.touch()
    # the task runs on until its window is full, then waits at its yield
    until(lambda: nymph_metrics(port)["nymph_stream_undelivered_bytes"] > 0, "frames to pile up")
    time.sleep(1.0)
    srv.start()
    end = follower.result()
    assert end.kind == wire.FRAME_END and end.seq == count and follower.count == count + 1
    out = await_result(srv.url, tokens["admin"], inv)
    assert out["state"] == "succeeded", n.output()[-3000:]
    info = httpx.get(
        f"{srv.url}/v1/producer/invocations/{inv}",
        headers={"Authorization": f"Bearer {tokens['admin']}"},
        timeout=10,
    )
    assert msgpack.unpackb(info.content, raw=False)["attempt"] == 1
    metrics = nymph_metrics(port)
    assert metrics["nymph_stream_undelivered_bytes_peak"] <= window_frames * 64
    assert metrics["nymph_outbox_bytes_peak"] < window_frames * 64 + 64 * 1024
