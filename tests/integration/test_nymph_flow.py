"""Flow control end to end (issue 15): generators that yield faster than the network, through one
real nymph (process runner) and ``lakeshore server`` subprocesses.

Each stream must end in one success on attempt 1 with every frame delivered once and in order,
while nymph's undelivered bytes and its outbox stay under the configured bounds (read from its
``/metrics``). A control-plane outage in the middle of a stream costs latency, never the result.
No assertion is about speed; ``bench/streams.py`` measures that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.errors import Unavailable
from tests import nymph_fns
from tests.integration.test_nymph_agent import (
    Nymph,
    Server,
    _free_port,
    _until,
    await_result,
    envelope,
    submit,
)

pytestmark = pytest.mark.slow  # real nymph and server processes, 100,000 values
MiB = 1024 * 1024


def _metrics(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _start(factory: Callable[..., Nymph], srv: Server, *flags: str) -> tuple[Nymph, int]:
    port = _free_port()
    n = factory(srv.url, srv.tokens()["daemon"], "--metrics-port", str(port), *flags)
    _until(lambda: _up(port), "nymph's metrics")
    return n, port


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Follower:
    """A live consumer of one result stream (``HttpDispatch.frames``), resuming after drops,
    checking order as it goes and keeping only what the test needs."""

    def __init__(self, url: str, token: str, inv: str, check: Callable[[wire.Frame], None]) -> None:
        self.plane = HttpDispatch(url, token, retries=2)
        self.inv = inv
        self.check = check
        self.last = -1
        self.count = 0
        self.final: wire.Frame | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self.final is None:
                try:
                    for frame in self.plane.frames(self.inv, since=self.last, timeout=120):
                        assert frame.seq == self.last + 1, f"seq {frame.seq} after {self.last}"
                        self.last = frame.seq
                        self.count += 1
                        if frame.kind in (wire.FRAME_END, wire.FRAME_ERROR):
                            self.final = frame
                        else:
                            self.check(frame)
                except Unavailable:  # the control plane is away: resume from the last seq
                    time.sleep(0.5)
        except BaseException as exc:
            self.error = exc
        finally:
            self.plane.close()

    def result(self, limit_s: float = 120) -> wire.Frame:
        self.thread.join(limit_s)
        assert not self.thread.is_alive(), f"the follower is stuck at seq {self.last}"
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final


class RssPeak:
    """Nymph's resident memory, sampled every 50 ms (its own process, not its tasks)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _values(expect: Callable[[int], Any]) -> Callable[[wire.Frame], None]:
    def check(frame: wire.Frame) -> None:
        assert frame.kind == wire.FRAME_VALUE
        value = wire.unpack(frame.body)  # type: ignore[arg-type]
        assert value == expect(frame.seq), f"frame {frame.seq} carries the wrong value"

    return check


def _run_stream(
    srv: Server, n: Nymph, port: int, fn: Any, args: tuple[Any, ...], expect: Callable[[int], Any], count: int
) -> tuple[dict[str, float], Follower, dict[str, Any]]:
    tokens = srv.tokens()
    inv = submit(srv.url, tokens["admin"], envelope(fn, *args))
    follower = Follower(srv.url, tokens["admin"], inv, _values(expect))
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
    _until(lambda: not (n.workdir / inv).exists(), "the workdir to go")
    return _metrics(port), follower, info


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Server, Callable[..., Nymph]]]:
    """``lakeshore server`` (stoppable, restartable) and a maker of nymphs pointed at it."""
    data = tmp_path / "cp"
    data.mkdir()
    srv = Server(data)
    srv.start()
    started: list[Nymph] = []

    def make(url: str, token: str, *extra: str) -> Nymph:
        n = Nymph(url, token, tmp_path, *extra)
        started.append(n)
        return n.start()

    try:
        yield srv, make
    finally:
        for n in started:
            n.stop()
        srv.stop()


def test_a_hundred_thousand_values_arrive_once_in_order_on_attempt_1(
    stack: tuple[Server, Callable[..., Nymph]],
) -> None:
    srv, factory = stack
    window_frames = 2000
    n, port = _start(factory, srv, "--stream-window-frames", str(window_frames))
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
    n, port = _start(factory, srv, "--stream-window-bytes", str(window), "--stream-max-bytes", str(64 * MiB))
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
    n, port = _start(factory, srv, "--stream-window-frames", str(window_frames))
    tokens = srv.tokens()
    count, gate = 30_000, tmp_path / "gate"
    inv = submit(srv.url, tokens["admin"], envelope(nymph_fns.count_to, count, str(gate), count // 2))
    follower = Follower(srv.url, tokens["admin"], inv, _values(lambda i: i))
    _until(lambda: follower.last >= count // 2 - 1, "the first half to arrive")
    srv.stop()  # the control plane goes away in the middle of the stream
    gate.touch()
    # the task runs on until its window is full, then waits at its yield
    _until(lambda: _metrics(port)["nymph_stream_undelivered_bytes"] > 0, "frames to pile up")
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
    metrics = _metrics(port)
    assert metrics["nymph_stream_undelivered_bytes_peak"] <= window_frames * 64
    assert metrics["nymph_outbox_bytes_peak"] < window_frames * 64 + 64 * 1024
