"""The control plane with ``--redis``: live frames between replicas over a real redis-server.

Two control-plane replicas share one store; a daemon writes frames to replica A, producers follow
them on replica B. B re-checks the store only every 30 s, so a frame that reaches B's follower at
once came through Redis. Then Redis is killed mid-stream: writes still succeed (the failure is
logged and swallowed) and B's followers still complete, from the database.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.app import create_app
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.server.fanout import STREAM_PREFIX, RedisFanout, make_fanout
from dreamlake.lakeshore.store import open_store
from tests.integration.conftest import ControlPlane, ServerThread, running_control_plane
from tests.integration.redis_fixture import RedisServer
from tests.stack.ports import free_port

FOLLOW_TIMEOUT_S = 20.0  # a client read timeout; the live path answers in milliseconds


def _frame(seq: int, kind: int = wire.FRAME_VALUE) -> bytes:
    return wire.encode_frame(kind, seq, wire.pack(seq), {"ts": 0.0})


class Follower:
    """A producer following one stream route on a replica, in a thread; frames land in ``frames``."""

    def __init__(self, url: str, token: str, path: str) -> None:
        self.frames: queue.Queue[wire.Frame | None] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, token, path), daemon=True)
        self._thread.start()

    def _run(self, url: str, token: str, path: str) -> None:
        reader = wire.FrameReader()
        try:
            with (
                httpx.Client(base_url=url, timeout=FOLLOW_TIMEOUT_S) as c,
                c.stream("GET", path, headers={"Authorization": f"Bearer {token}"}) as resp,
            ):
                assert resp.status_code == 200
                for chunk in resp.iter_raw():
                    for frame in reader.feed(chunk):
                        self.frames.put(frame)
        except BaseException as exc:  # surfaced by next()/done()
            self.error = exc
        finally:
            self.frames.put(None)

    def next(self) -> wire.Frame:
        frame = self.frames.get(timeout=FOLLOW_TIMEOUT_S + 5)
        assert frame is not None, f"stream ended early: {self.error!r}"
        return frame

    def rest(self) -> list[wire.Frame]:
        """Every remaining frame, once the stream ended."""
        out: list[wire.Frame] = []
        while (frame := self.frames.get(timeout=FOLLOW_TIMEOUT_S + 5)) is not None:
            out.append(frame)
        self._thread.join(5)
        assert self.error is None, repr(self.error)
        return out


def _redis_len(url: str, key: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.xlen(key))
    finally:
        client.close()


def _chunk(cp: ControlPlane, inv: str, seq: int, kind: int = wire.FRAME_VALUE) -> None:
    body = {"invocation_id": inv, "seq": seq, "bytes": _frame(seq, kind), "final": kind != wire.FRAME_VALUE}
    holder = cp.store.get(inv)  # the worker holding the lease posts the frames
    assert holder is not None
    lease = {"attempt": 1, "worker_id": holder.worker_id}
    assert cp.daemon("/v1/daemon/result-chunk", {**body, **lease}) == (200, {"ok": True, "seq": seq})


def _post(cp: ControlPlane, topic: str, value: int, final: bool = False) -> int:
    status, out = cp.producer(f"/v1/producer/topics/{topic}/post", {"body": wire.pack(value), "final": final})
    assert status == 200, out
    return int(out["seq"])


def test_replicas_follow_live_over_redis_and_survive_its_death(
    store_url: str, private_redis: RedisServer
) -> None:
    a_config = ServerConfig(recheck_s=0.3, expire_every_s=0.2)
    b_config = ServerConfig(recheck_s=30.0, expire_every_s=0.2)  # B learns of A's writes only via Redis
    with running_control_plane(store_url, config=a_config, fanout=make_fanout(private_redis.url)) as a:
        assert isinstance(a.app.state.ctx.fanout, RedisFanout)
        b_app = create_app(open_store(store_url), fanout=make_fanout(private_redis.url), config=b_config)
        b = ServerThread(b_app)
        b.start()
        try:
            inv, topic = a.submit(), f"t-{new_ulid()}"
            status, out = a.daemon(
                "/v1/daemon/poll", {"worker_id": new_ulid(), "queues": ["default"], "timeout_s": 5}
            )
            assert status == 200 and len(out["commands"]) == 1
            result = Follower(
                b.url, a.producer_token, f"/v1/producer/invocations/{inv}/result/stream?since=-1&timeout=60"
            )
            topical = Follower(
                b.url, a.producer_token, f"/v1/producer/topics/{topic}/stream?since=-1&timeout=60"
            )

            # Live: frame 0 may come by replay; frame 1 is written after B's follower is streaming.
            _chunk(a, inv, 0)
            _post(a, topic, 0)
            assert result.next().seq == 0 and topical.next().seq == 0
            _chunk(a, inv, 1)
            _post(a, topic, 1)
            assert result.next().seq == 1 and topical.next().seq == 1
            assert _redis_len(private_redis.url, STREAM_PREFIX + inv) == 2
            assert _redis_len(private_redis.url, f"{STREAM_PREFIX}topic:{topic}") == 2

            # Redis dies mid-stream. Writes still succeed; followers go on from the database.
            # B re-checks its store often from here on. Set before the kill: a follower that falls
            # back to the journal at once would otherwise wait out the old 30 s re-check.
            b_app.state.ctx.config = dataclasses.replace(b_config, recheck_s=0.3)
            private_redis.kill()
            _chunk(a, inv, 2)
            _post(a, topic, 2)
            _chunk(a, inv, 3, wire.FRAME_END)
            assert _post(a, topic, 3, final=True) == 3
            assert [f.seq for f in result.rest()] == [2, 3]
            assert [(f.seq, f.kind) for f in topical.rest()] == [(2, wire.FRAME_VALUE), (3, wire.FRAME_END)]
            late = Follower(
                b.url, a.producer_token, f"/v1/producer/invocations/{inv}/result/stream?since=0&timeout=60"
            )
            assert [f.seq for f in late.rest()] == [1, 2, 3]
            assert [f.seq for f in a.store.read_frames(inv)] == [0, 1, 2, 3]
        finally:
            b.stop()
            b_app.state.ctx.store.close()


@pytest.fixture
def cli_server(tmp_path: Path, redis_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    port = free_port()
    data = tmp_path / "data"
    env = {**os.environ, "LAKESHORE_DATA_DIR": str(data)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dreamlake.lakeshore.cli",
            "server",
            "--port",
            str(port),
            "--redis",
            redis_url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "lakeshore server exited"
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "lakeshore server did not answer /healthz"
                time.sleep(0.05)
        yield url, json.loads((data / "tokens.json").read_text())
    finally:
        proc.terminate()
        proc.wait(10)


def test_server_flag_redis_publishes_topic_posts_to_redis(
    cli_server: tuple[str, dict[str, str]], redis_url: str
) -> None:
    url, tokens = cli_server
    topic = f"cli-{new_ulid()}"
    headers: dict[str, Any] = {"Authorization": f"Bearer {tokens['admin']}"}
    r = httpx.post(
        f"{url}/v1/producer/topics/{topic}/post",
        headers=headers,
        content=msgpack.packb({"body": wire.pack("hi"), "final": True}),
    )
    assert r.status_code == 200 and msgpack.unpackb(r.content) == {"seq": 0}
    assert _redis_len(redis_url, f"{STREAM_PREFIX}topic:{topic}") == 1
    r = httpx.get(f"{url}/v1/producer/topics/{topic}/stream?since=-1&timeout=5", headers=headers, timeout=30)
    (frame,) = wire.FrameReader().feed(r.content)
    assert isinstance(frame.body, bytes)
    assert (frame.seq, frame.kind, wire.unpack(frame.body)) == (0, wire.FRAME_END, "hi")
