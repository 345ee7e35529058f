"""The README's main job: a control plane, a nymph, and a real workload through them.

Starts ``lakeshore server`` (embedded SQLite in a temporary data directory) and ``nymph start
--runner process`` as real processes on loopback, submits a plain call, a generator that streams
live, and a failing call, and prints what comes back. Everything is torn down at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lakeshore server exited early with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"lakeshore server did not become healthy at {url} within {timeout:.0f} s")


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="lakeshore-demo-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        print(f"== control plane: lakeshore server on {url} (SQLite in {tmp / 'cp'})")
        server = subprocess.Popen(
            [str(BIN / "lakeshore"), "server", "--port", str(port), "--data-dir", str(tmp / "cp")],
            env=env,
        )
        procs.append(server)
        wait_healthy(url, server)
        tokens = json.loads((tmp / "cp" / "tokens.json").read_text())

        print("== nymph: process runner, queue 'demo', 2 slots")
        nymph = subprocess.Popen(
            [
                str(BIN / "nymph"), "start", "--server", url, "--token", tokens["daemon"],
                "--runner", "process", "--queue", "demo", "--concurrency", "2",
                "--workdir", str(tmp / "work"), "--state-dir", str(tmp / "state"),
            ],
            env=env,
        )  # fmt: skip
        procs.append(nymph)

        sys.path.insert(0, str(HERE))
        import workload

        import dreamlake.lakeshore as dls

        plane = dls.HttpDispatch(url, tokens["admin"])
        q = dls.SyncQueue("demo", dispatch=plane)

        print("\n-- a plain call: add(2, 3)")
        t0 = time.perf_counter()
        inv = workload.add.submit(2, 3, _dispatch=plane)
        print(f"   submitted {inv}; result = {q.result(inv, timeout=60)} "
              f"({(time.perf_counter() - t0) * 1000:.0f} ms round trip, first call includes nymph start-up)")

        t0 = time.perf_counter()
        inv = workload.add.submit(40, 2, _dispatch=plane)
        print(f"   again: result = {q.result(inv, timeout=60)} ({(time.perf_counter() - t0) * 1000:.0f} ms)")

        print("\n-- a generator, streamed live: countdown(5)")
        inv = workload.countdown.submit(5, _dispatch=plane)
        for frame in q.stream(inv, timeout=30.0):
            lag_ms = (time.time() - frame["at"]) * 1000
            print(f"   frame {frame}  (yield-to-consumer {lag_ms:.0f} ms)")
        print(f"   stream ended; state = {q.status(inv)['state']}")

        print("\n-- a failure: explode(-1)")
        inv = workload.explode.submit(-1, _dispatch=plane)
        try:
            q.result(inv, timeout=60)
        except dls.DispatchError as exc:
            print(f"   DispatchError: {exc}")
            print("   remote traceback:")
            for line in (exc.traceback or "").rstrip().splitlines():
                print(f"     {line}")
        print("\nDone.")
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
