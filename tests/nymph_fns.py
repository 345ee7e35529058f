"""Functions nymph's tests ship by reference, as ``@dls.udf`` functions; the spawned entry imports this
module (PYTHONPATH = repo root; in a container the SDK comes from the entry bundle)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import dreamlake.lakeshore as dls


@dls.udf(queue="nymph")
def add(a: int, b: int = 0) -> int:
    return a + b


@dls.udf(queue="nymph")
def add_nested(a: int, b: int = 0) -> dict[str, object]:
    """Submit ``add(a, b)`` from inside the task (its own credential, the plane nymph names in
    LAKESHORE_URL) and return its result with what the task was told about TLS."""
    ca = os.environ.get("LAKESHORE_CA_FILE", "")
    return {"sum": add.submit(a, b).result(timeout=60), "ca_file": ca, "ca_mode": os.stat(ca).st_mode & 0o777}


@dls.udf(queue="nymph")
def slow_count(n: int, delay_s: float = 0.2, gate: str | None = None) -> Iterator[int]:
    """Yield 0..n-1; before the last value, wait until the file ``gate`` exists (when given)."""
    for i in range(n):
        if gate is not None and i == n - 1:
            while not Path(gate).exists():
                time.sleep(0.02)
        yield i
        time.sleep(delay_s)


def count_to(n: int, gate: str | None = None, at: int = -1) -> Iterator[int]:
    """Yield 0..n-1 as fast as the stream takes them; before value ``at``, wait for the file ``gate``."""
    for i in range(n):
        if i == at and gate is not None:
            while not Path(gate).exists():
                time.sleep(0.02)
        yield i


def blobs(n: int, size: int) -> Iterator[bytes]:
    """Yield ``n`` values of ``size`` bytes each; value i is filled with the byte i % 256."""
    for i in range(n):
        yield bytes([i % 256]) * size


@dls.udf(queue="nymph")
def boom(message: str = "kaboom") -> None:
    raise ValueError(message)


@dls.udf(queue="nymph")
def sleep_for(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


@dls.udf(queue="nymph")
def wait_for_file(path: str, limit_s: float = 60.0) -> str:
    """Return once ``path`` exists (the test's release), so a test controls when a job ends."""
    deadline = time.monotonic() + limit_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)
    return "released"


@dls.udf(queue="nymph")
def chatty(gate: str, limit_s: float = 60.0) -> str:
    """Print to stdout (no flush), to stderr, and from a child process; then wait for the file
    ``gate`` (the output must be readable before that) and print once more."""
    import subprocess
    import sys

    print("hello from print")
    print("careful, stderr", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "print('from a child process')"], check=True)
    deadline = time.monotonic() + limit_s
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} never appeared")
        time.sleep(0.02)
    print("after the gate")
    return "talked"


def noisy_count(n: int, lines: int, pad: int = 0) -> Iterator[int]:
    """Yield 0..n-1 as fast as the stream takes them, printing ``lines`` lines (padded with ``pad``
    x's) before each value, and one line on stderr at the end."""
    import sys

    tail = " " + "x" * pad if pad else ""
    for i in range(n):
        for j in range(lines):
            print(f"value {i} line {j}{tail}")
        yield i
    print("noisy_count done", file=sys.stderr)


@dls.udf(queue="nymph")
def stubborn_tree(children: int = 2) -> None:
    """Fork children that ignore SIGTERM, ignore it too, record all pids in pids.txt, then hang."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pids = [os.getpid()]
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1)
        pids.append(pid)
    Path("pids.txt.tmp").write_text(" ".join(map(str, pids)))
    os.replace("pids.txt.tmp", "pids.txt")
    while True:
        time.sleep(1)


@dls.udf(queue="nymph")
def setsid_daemons(count: int, marker: str, release: str | None = None) -> int:
    """Start ``count`` daemons the classic way, record their pids in daemons.txt, then hang (or,
    with ``release``, return once that file exists), leaving the daemons running.

    Each daemon is forked by a child that calls ``setsid()`` and exits at once (so the daemon is in
    a session of its own and orphaned), ignores SIGTERM and carries ``marker`` on its command line.
    """
    import sys

    pids = []
    for _ in range(count):
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(read_end)
            os.setsid()
            daemon = os.fork()
            if daemon == 0:
                os.close(write_end)
                code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)"
                os.execv(sys.executable, [sys.executable, "-c", code, marker])
            os.write(write_end, str(daemon).encode())
            os._exit(0)
        os.close(write_end)
        os.waitpid(middle, 0)
        pids.append(int(os.read(read_end, 32) or b"0"))
        os.close(read_end)
    Path("daemons.txt.tmp").write_text(" ".join(map(str, pids)))
    os.replace("daemons.txt.tmp", "daemons.txt")
    while release is None or not Path(release).exists():
        time.sleep(0.02)
    return count


@dls.udf(queue="nymph")
def env_value(name: str) -> str | None:
    return os.environ.get(name)


@dls.udf(queue="nymph")
def whoami() -> int:
    return os.getuid()


async def async_add(a: int, b: int) -> int:
    import asyncio

    await asyncio.sleep(0.01)
    return a + b


async def async_count(n: int) -> AsyncIterator[int]:
    import asyncio

    for i in range(n):
        await asyncio.sleep(0)
        yield i
