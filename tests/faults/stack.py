"""Real processes on loopback for the fault suite: ``lakeshore server`` and ``nymph start``.

Built on the one test stack (:mod:`tests.stack`):

- :class:`Server`: ``lakeshore server`` as a subprocess on one port and one data directory (SQLite),
  with a short lease, that a test stops, kills with ``kill -9`` and starts again;
- :class:`Nymph`: ``nymph start`` as a subprocess (its own session, so ``kill -9`` reaches nymph
  alone, as a crash would; its tasks live on), with ``/healthz`` on a port of its own;
- :class:`Producer`: the producer routes over HTTP (submit, await, status, cancel, stream), each
  call retried while the control plane is away, with the same invocation id (submit is
  idempotent on it), so an outage costs the test time, never a call;
- :class:`Tally`: what happened to a batch of calls (lost, duplicated, wrong, executions per call),
  printed by every test and asserted on.

Every wait is for a condition with a bound (:func:`until`), never a bare sleep.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import psutil

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.envelope import Envelope
from tests.stack import server as stack_server
from tests.stack.nymph import NYMPH, ROOT_TASKS, NymphProcess
from tests.stack.ports import free_port
from tests.stack.producer import submit_body
from tests.stack.wait import until

__all__ = ["free_port", "until"]  # the stack's, for the fault tests that take them from here

LEASE_S = 2.0  # the server's lease: a dead nymph's work comes back this soon
LIMIT_S = 90.0
FNS = "tests.faults.fns"


def ref(qualname: str, *args: Any) -> bytes:
    return Envelope.create({"kind": "ref", "module": FNS, "qualname": qualname}, args, {}).to_bytes()


class Server(stack_server.Server):
    """``lakeshore server`` (:class:`tests.stack.server.Server`) with the suite's short lease."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        super().__init__(data_dir, "--lease-s", str(LEASE_S), *extra)


class Nymph(NymphProcess):
    """``nymph start`` in its own session; its log in a file, ``/healthz`` on :attr:`health_url`."""

    def __init__(
        self,
        server: Server,
        base: Path,
        *extra: str,
        workdir: Path | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        workdir = workdir or base / "work"
        state_dir = state_dir or base / "state"
        self.port = free_port()
        self.health_url = f"http://127.0.0.1:{self.port}/healthz"
        token_file = base / "token"
        token_file.write_text(server.tokens()["daemon"] + "\n")
        os.chmod(token_file, 0o600)
        args = [
            *NYMPH, "start", "--server", server.url, "--token-file", str(token_file),
            "--queue", "default", "--workdir", str(workdir), "--state-dir", str(state_dir),
            "--heartbeat-s", "0.5", "--poll-timeout-s", "2", "--stop-grace-s", "0.5", "--grace-s", "5",
            "--metrics-port", str(self.port), "--log-level", "INFO", *ROOT_TASKS, *extra,
        ]  # fmt: skip
        super().__init__(args, base / "nymph.log", workdir, state_dir)

    def start(self, env: dict[str, str] | None = None) -> Nymph:
        super().start(env)
        return self

    def health(self) -> tuple[int, dict[str, Any]]:
        try:
            resp = httpx.get(self.health_url, timeout=2)
        except httpx.HTTPError:
            return 0, {}
        return resp.status_code, resp.json()


class Producer:
    """The producer routes, each call retried (same body, same invocation id) while the plane is away."""

    def __init__(self, server: Server, token: str | None = None) -> None:
        self.server = server
        self.token = token or server.tokens()["admin"]
        self.client = httpx.Client(headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        self.retries = 0
        self.statuses: collections.Counter[int] = collections.Counter()  # every answer's status
        self.errors: dict[int, bytes] = {}  # the first body of each 5xx status seen

    def close(self) -> None:
        self.client.close()

    def _retry(self, send: Callable[[], httpx.Response], limit_s: float = LIMIT_S) -> Any:
        deadline = time.monotonic() + limit_s
        while True:
            try:
                resp = send()
                self.statuses[resp.status_code] += 1
                if resp.status_code >= 500:
                    self.errors.setdefault(resp.status_code, resp.content[:300])
                if resp.status_code < 500:
                    assert resp.status_code == 200, (resp.status_code, resp.content[:300])
                    return msgpack.unpackb(resp.content, raw=False)
            except httpx.TransportError:
                pass
            self.retries += 1
            assert time.monotonic() < deadline, "the control plane did not come back"
            time.sleep(0.1)

    def post(self, path: str, body: Any, timeout: float = 60.0) -> Any:
        data = msgpack.packb(body, use_bin_type=True)
        headers = {"Content-Type": "application/x-msgpack"}
        url = self.server.url + path
        return self._retry(lambda: self.client.post(url, content=data, headers=headers, timeout=timeout))

    def submit(self, args_blob: bytes, invocation_id: str | None = None, **run_config: Any) -> str:
        inv = invocation_id or ids.new_ulid()
        out = self.post(
            "/v1/producer/submit", submit_body(inv, "default", run_config=run_config, args_blob=args_blob)
        )
        assert out["invocation_id"] == inv
        return inv

    def await_(self, invocation_id: str, limit_s: float = LIMIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + limit_s
        while True:
            left = max(0.5, min(10.0, deadline - time.monotonic()))
            out = self.post("/v1/producer/await", {"invocation_id": invocation_id, "timeout_s": left})
            if out["state"] != "pending" or time.monotonic() >= deadline:
                return dict(out)

    def status(self, invocation_id: str) -> dict[str, Any]:
        url = f"{self.server.url}/v1/producer/invocations/{invocation_id}"
        return dict(self._retry(lambda: self.client.get(url, timeout=10)))

    def cancel(self, invocation_id: str) -> dict[str, Any]:
        return dict(self.post(f"/v1/producer/invocations/{invocation_id}/cancel", {}))

    def frames(self, invocation_id: str, since: int = -1, timeout: float = 5.0) -> list[wire.Frame]:
        """The frames after ``since`` (one stream request; its cursor is the last seq read)."""
        url = f"{self.server.url}/v1/producer/invocations/{invocation_id}/result/stream"
        params = {"since": since, "timeout": timeout}
        try:
            resp = self.client.get(url, params=params, timeout=timeout + 30)
        except httpx.TransportError:  # cut off (the server went away): resume from the cursor
            self.retries += 1
            time.sleep(0.2)
            return []
        self.statuses[resp.status_code] += 1
        if resp.status_code == 503:  # the control plane's store is away: nothing new yet
            self.errors.setdefault(503, resp.content[:300])
            time.sleep(0.2)
            return []
        assert resp.status_code == 200, (resp.status_code, resp.content[:300])
        return wire.FrameReader().feed(resp.content)


@dataclass
class Tally:
    """Calls made and what became of them: printed by every fault test, asserted on."""

    name: str
    marks: Path
    expected: dict[str, Any] = field(default_factory=dict)  # invocation id -> the right result
    keys: dict[str, str] = field(default_factory=dict)  # invocation id -> its mark file's name
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    delivered: collections.Counter[str] = field(default_factory=collections.Counter)

    def add(self, invocation_id: str, key: str, result: Any) -> None:
        self.expected[invocation_id] = result
        self.keys[invocation_id] = key

    def executions(self, invocation_id: str) -> int:
        path = self.marks / self.keys[invocation_id]
        return len(path.read_text().splitlines()) if path.exists() else 0

    def report(self, states: Callable[[str], str] | None = None) -> dict[str, Any]:
        lost = [i for i in self.expected if self.outcomes.get(i, {}).get("state") != "succeeded"]
        wrong = [
            i
            for i, out in self.outcomes.items()
            if out.get("state") == "succeeded" and wire.unpack(out["result_blob"]) != self.expected[i]
        ]
        duplicated = [i for i, n in self.delivered.items() if n > 1]
        runs = collections.Counter(self.executions(i) for i in self.expected)
        counts = {
            "calls": len(self.expected),
            "lost": len(lost),
            "duplicated": len(duplicated),
            "wrong": len(wrong),
            "executions_per_call": dict(sorted(runs.items())),
        }
        print(f"\n[fault {self.name}] " + " ".join(f"{k}={v}" for k, v in counts.items()))
        if lost:
            print(f"[fault {self.name}] not succeeded: {[(i, self.outcomes.get(i)) for i in lost[:5]]}")
        return counts


def wait_all(producer: Producer, tally: Tally, limit_s: float = LIMIT_S) -> None:
    """Await every call of ``tally`` (each outcome delivered once to this consumer)."""
    deadline = time.monotonic() + limit_s
    for inv in tally.expected:
        out = producer.await_(inv, max(1.0, deadline - time.monotonic()))
        tally.outcomes[inv] = out
        tally.delivered[inv] += 1


def kill_leftovers(base: Path) -> None:
    """Kill what a killed nymph left running under ``base`` (tasks whose cwd or argv is there)."""
    mine = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            if proc.pid == mine:
                continue
            where = [proc.info.get("cwd") or "", *(proc.info.get("cmdline") or [])]
            if any(str(base) in str(w) for w in where):
                proc.kill()
        except (psutil.Error, OSError):
            continue


@contextlib.contextmanager
def stack(tmp_path: Path, *server_extra: str) -> Iterator[tuple[Server, list[Nymph], Path]]:
    """A started server, a list the test adds its nymphs to (all stopped at the end), a marks dir."""
    server = Server(tmp_path / "cp", *server_extra).start()
    marks = tmp_path / "marks"
    marks.mkdir()
    os.chmod(marks, 0o777)
    nymphs: list[Nymph] = []
    try:
        yield server, nymphs, marks
    finally:
        for n in nymphs:
            n.stop()
        server.stop()
        kill_leftovers(tmp_path)
        for n in nymphs:
            if n.proc is not None and n.proc.returncode not in (0, None, -9):
                print(n.output()[-4000:])
