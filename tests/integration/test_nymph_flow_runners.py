"""Flow control end to end on every runner of the conformance suite (issue 15), at full size.

``tests/integration/test_nymph_flow.py`` runs the two streams through nymph's default process
runner (warm fork); here the same two run through ``nymph start --runner ...`` for the process
runner's spawned entry, docker, gvisor, slurm and kube (at its fake seam, ``kube_fake.py``: pods
run as local processes): a 100,000-value generator and 200 values of 1 MiB each. Each must end in one success on attempt 1 with every frame delivered once, in order,
while nymph's undelivered frames stay within the window and its outbox holds the ack alone (read
from nymph's ``/metrics``), and nymph's own memory stays within a few batches. Each test prints
its duration, frames/s and peaks; no assertion is about speed (``bench/streams.py`` measures it).
A control-plane outage halfway through the 100,000-value stream still ends in one success on
attempt 1, on every runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import wire
from tests.integration.flow_kit import (
    Follower,
    MiB,
    RssPeak,
    nymph_metrics,
    runner_for,
    stack,
    start_with_metrics,
    values,
)
from tests.stack.nymph import Nymph
from tests.stack.producer import await_result, envelope, submit
from tests.stack.server import Server
from tests.stack.wait import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["runner_for", "stack"]  # the fixtures (flow_kit)

RUNNERS = ("process-spawn", "docker", "gvisor", "slurm", "kube")
COUNT = 100_000
WINDOW_FRAMES = 2000
BLOBS, BLOB = 200, MiB
WINDOW_BYTES = 8 * MiB


def _run_stream(
    srv: Server,
    n: Nymph,
    port: int,
    fn: Any,
    args: tuple[Any, ...],
    expect: Callable[[int], Any],
    count: int,
    run_config: dict[str, Any],
) -> dict[str, float]:
    """Submit ``fn(*args)``, follow it live to its END and check the outcome (one success on
    attempt 1, every frame once and in order); nymph's metrics after."""
    tokens = srv.tokens()
    inv = submit(srv.url, tokens["admin"], envelope(fn, *args), **run_config)
    follower = Follower(srv.url, tokens["admin"], inv, values(expect))
    end = follower.result(limit_s=300)
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
    return nymph_metrics(port)


@pytest.mark.parametrize("name", RUNNERS)
def test_a_hundred_thousand_values_arrive_once_in_order_on_attempt_1(
    name: str, stack: tuple[Server, Callable[..., Nymph]], runner_for: Callable[[str], Any]
) -> None:
    srv, factory = stack
    flags, fns, run_config = runner_for(name)
    n, port = start_with_metrics(factory, srv, *flags, "--stream-window-frames", str(WINDOW_FRAMES))
    started = time.monotonic()
    metrics = _run_stream(srv, n, port, fns.count_to, (COUNT,), lambda i: i, COUNT, run_config)
    took = time.monotonic() - started
    assert metrics["nymph_stream_frames_sent_total"] >= COUNT + 1
    undelivered, outbox = metrics["nymph_stream_undelivered_bytes_peak"], metrics["nymph_outbox_bytes_peak"]
    assert 0 < undelivered <= WINDOW_FRAMES * 64  # the task paused at the window
    assert outbox < 64 * 1024  # the ack alone went through the outbox dir
    print(
        f"[{name}] {COUNT} values in {took:.1f} s ({COUNT / took:.0f} frames/s); "
        f"peak undelivered {undelivered / 1024:.0f} KiB, peak outbox {outbox / 1024:.1f} KiB"
    )


@pytest.mark.parametrize("name", RUNNERS)
def test_two_hundred_values_of_one_mib_stay_within_the_window(
    name: str, stack: tuple[Server, Callable[..., Nymph]], runner_for: Callable[[str], Any]
) -> None:
    srv, factory = stack
    flags, fns, run_config = runner_for(name)
    n, port = start_with_metrics(
        factory,
        srv,
        *flags,
        "--stream-window-bytes",
        str(WINDOW_BYTES),
        "--stream-max-bytes",
        str(64 * MiB),
    )
    assert n.proc is not None
    rss = RssPeak(n.proc.pid)

    def expect(i: int) -> bytes:
        return bytes([i % 256]) * BLOB

    started = time.monotonic()
    metrics = _run_stream(srv, n, port, fns.blobs, (BLOBS, BLOB), expect, BLOBS, run_config)
    took = time.monotonic() - started
    peak = rss.stop()
    undelivered, outbox = metrics["nymph_stream_undelivered_bytes_peak"], metrics["nymph_outbox_bytes_peak"]
    assert undelivered <= WINDOW_BYTES + BLOB + 64
    assert outbox < 64 * 1024
    # nymph holds a batch (1 MiB by default), never the stream: its memory grows by a few batches
    assert peak - rss.base < 48 * MiB, (rss.base, peak)  # the stream carries 200 MiB
    print(
        f"[{name}] {BLOBS} x 1 MiB in {took:.1f} s ({BLOBS / took:.1f} frames/s, {BLOBS / took:.1f} MiB/s); "
        f"peak undelivered {undelivered / MiB:.1f} MiB, peak outbox {outbox / 1024:.1f} KiB, "
        f"nymph rss {rss.base / MiB:.0f} -> {peak / MiB:.0f} MiB"
    )


@pytest.mark.parametrize("name", RUNNERS)
def test_a_control_plane_outage_mid_stream_ends_in_one_success_on_attempt_1(
    name: str, stack: tuple[Server, Callable[..., Nymph]], runner_for: Callable[[str], Any]
) -> None:
    """The control plane goes away halfway through a 100,000-value stream: the task runs on until
    its window is full, waits at its yield, and the stream resumes where it stopped once the
    control plane is back, on the same attempt."""
    srv, factory = stack
    flags, fns, run_config = runner_for(name)
    n, port = start_with_metrics(factory, srv, *flags, "--stream-window-frames", str(WINDOW_FRAMES))
    tokens = srv.tokens()
    gate = "gate"  # in the workdir: the task's working directory on every runner
    args = envelope(fns.count_to, COUNT, gate, COUNT // 2)
    inv = submit(srv.url, tokens["admin"], args, **run_config)
    started = time.monotonic()
    follower = Follower(srv.url, tokens["admin"], inv, values(lambda i: i))
    until(lambda: follower.last >= COUNT // 2 - 1, "the first half to arrive")
    srv.stop()  # the control plane goes away in the middle of the stream
    (n.workdir / inv / gate).touch()
    # the task runs on until its window is full, then waits at its yield
    until(lambda: nymph_metrics(port)["nymph_stream_undelivered_bytes"] > 0, "frames to pile up")
    time.sleep(1.0)
    srv.start()
    end = follower.result(limit_s=300)
    took = time.monotonic() - started
    assert end.kind == wire.FRAME_END and end.seq == COUNT and follower.count == COUNT + 1
    out = await_result(srv.url, tokens["admin"], inv)
    assert out["state"] == "succeeded", n.output()[-3000:]
    info = httpx.get(
        f"{srv.url}/v1/producer/invocations/{inv}",
        headers={"Authorization": f"Bearer {tokens['admin']}"},
        timeout=10,
    )
    assert msgpack.unpackb(info.content, raw=False)["attempt"] == 1
    metrics = nymph_metrics(port)
    undelivered, outbox = metrics["nymph_stream_undelivered_bytes_peak"], metrics["nymph_outbox_bytes_peak"]
    assert undelivered <= WINDOW_FRAMES * 64
    assert outbox < WINDOW_FRAMES * 64 + 64 * 1024
    print(
        f"[{name}] {COUNT} values across an outage in {took:.1f} s; peak undelivered {undelivered / 1024:.0f} KiB"
    )
