"""Control planes in subprocesses and the load that drives them, for the crash and replica tests.

``server_process`` runs ``lakeshore server`` (its own process group, so ``kill -9`` reaches every
worker of ``--workers N``); :class:`Load` runs producers and daemons in threads that record every
submit, ack (and, with ``frames``, batch of frames) the server confirmed with a 200.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import submit_body
from tests.stack.server import Server

MSGPACK = {"Content-Type": "application/x-msgpack"}


@contextlib.contextmanager
def server_process(
    db: str, data_dir: Path, *extra: str, port: int | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """``lakeshore server`` over ``db`` in a subprocess (its own process group); yields the
    process, its URL and the admin token it minted (or found) in ``data_dir``; killed after."""
    server = Server(data_dir, "--db", db, *extra, port=port)
    server.log = data_dir / f"server-{server.port}.log"
    try:
        server.start()
        assert server.proc is not None
        yield server.proc, server.url, server.tokens()["admin"]
    finally:
        server.kill()


class Load:
    """Producers submitting and daemons polling and acking until the server goes away; each
    records what the server confirmed with a 200."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        producers: int = 3,
        daemons: int = 2,
        queue: str = "load",
        frames: int = 0,
    ) -> None:
        self.url, self.token, self.queue = url, token, queue
        self.frames = frames  # a daemon posts this many frames (one result-chunks batch) before its ack
        self.framed: dict[str, int] = {}  # invocation -> frames the server confirmed journaled
        self.submitted: set[str] = set()
        self.acked: list[str] = []  # one entry per ack the server took (ok, not a duplicate)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.no_submits = threading.Event()
        self.producers = producers
        self.threads = [threading.Thread(target=self._produce, daemon=True) for _ in range(producers)]
        self.threads += [threading.Thread(target=self._work, daemon=True) for _ in range(daemons)]

    def _client(self) -> httpx.Client:
        headers = {**MSGPACK, "Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)

    def _produce(self) -> None:
        with self._client() as c, contextlib.suppress(httpx.HTTPError):
            while not (self.stop.is_set() or self.no_submits.is_set()):
                inv = new_ulid()
                r = c.post("/v1/producer/submit", content=msgpack.packb(submit_body(inv, self.queue)))
                if r.status_code == 200:
                    with self.lock:
                        self.submitted.add(inv)

    def _work(self) -> None:
        worker = new_ulid()
        with self._client() as c, contextlib.suppress(httpx.HTTPError):
            while not self.stop.is_set():
                poll = {"worker_id": worker, "queues": [self.queue], "max": 8, "timeout_s": 0.2}
                r = c.post("/v1/daemon/poll", content=msgpack.packb(poll))
                for cmd in msgpack.unpackb(r.content)["commands"] if r.status_code == 200 else []:
                    body = cmd["body"]
                    if self.frames and not self._post_frames(c, worker, body):
                        continue
                    ack = {
                        "invocation_id": body["invocation_id"],
                        "state": "succeeded",
                        "result_blob": b"\xc0",
                        "worker_id": worker,
                        "attempt": body["attempt"],
                    }
                    r = c.post("/v1/daemon/ack", content=msgpack.packb(ack))
                    if r.status_code == 200 and not msgpack.unpackb(r.content).get("duplicate"):
                        with self.lock:
                            self.acked.append(body["invocation_id"])

    def _post_frames(self, c: httpx.Client, worker: str, body: dict[str, Any]) -> bool:
        from dreamlake.lakeshore import wire

        inv = body["invocation_id"]
        frames = [wire.encode_frame(wire.FRAME_VALUE, s, wire.pack(s), {}) for s in range(self.frames)]
        batch = {"invocation_id": inv, "attempt": body["attempt"], "worker_id": worker, "frames": frames}
        r = c.post("/v1/daemon/result-chunks", content=msgpack.packb(batch))
        if r.status_code != 200:
            return False
        with self.lock:
            self.framed[inv] = self.frames
        return True

    def stop_producing(self) -> None:
        """Stop the producers (the daemons go on draining); waits for them to finish."""
        self.no_submits.set()
        for t in self.threads[: self.producers]:
            t.join(15)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)

    def wait_for(self, submitted: int, acked: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.submitted) < submitted or len(self.acked) < acked:
            assert time.monotonic() < deadline, "the load made no progress"
            time.sleep(0.05)
