"""Functions the docker/gvisor (and kube) runner tests ship by reference, written as a user writes them.

They run inside a container whose image has python3 and msgpack but no dreamlake: the runner mounts
this repository read-only (``code_dirs``) and the entry bundle, whose ``dreamlake.lakeshore`` (the
SDK's import-time surface) wins over the repository's copy.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import dreamlake.lakeshore as dls


@dls.udf(queue="docker")
def add(a: int, b: int = 0) -> int:
    return a + b


@dls.udf(queue="docker")
def noop() -> None:
    return None


@dls.udf(queue="docker")
def gated_count(n: int, gate: str) -> Iterator[int]:
    """Yield 0..n-1; before the last value, wait until the file ``gate`` (in the workdir) exists."""
    for i in range(n):
        if i == n - 1:
            while not Path(gate).exists():
                time.sleep(0.02)
        yield i


def count_to(n: int, gate: str | None = None, at: int = -1) -> Iterator[int]:
    """Yield 0..n-1 as fast as the stream takes them; before value ``at``, wait for the file
    ``gate`` (relative: in the workdir, which is the task's working directory)."""
    for i in range(n):
        if i == at and gate is not None:
            while not Path(gate).exists():
                time.sleep(0.02)
        yield i


@dls.udf(queue="docker")
def blobs(n: int, size: int) -> Iterator[bytes]:
    """Yield ``n`` values of ``size`` bytes each; value i is filled with the byte i % 256."""
    for i in range(n):
        yield bytes([i % 256]) * size


@dls.udf(queue="docker")
def boom(message: str = "kaboom") -> None:
    raise ValueError(message)


@dls.udf(queue="docker")
def hang(ignore_sigterm: bool) -> None:
    """Write ``started`` in the workdir, then sleep forever (optionally deaf to SIGTERM)."""
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path("started").touch()
    while True:
        time.sleep(1)


@dls.udf(queue="docker")
def hog_memory(mib: int) -> int:
    """Allocate and touch ``mib`` MiB, so a memory limit below that is hit for real."""
    blocks = [b"x" * (1024 * 1024) for _ in range(mib)]
    return len(blocks)


@dls.udf(queue="docker")
def ids() -> list[int]:
    """The uid and gid the function runs as, after writing a file into the workdir."""
    Path("written-by-task").write_text("ok")
    return [os.getuid(), os.getgid()]


@dls.udf(queue="docker")
def wait_for_file(path: str, limit_s: float = 60.0) -> str:
    deadline = time.monotonic() + limit_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)
    return "released"


@dls.udf(queue="docker")
def where_is_the_entry() -> str:
    """The file the entry module was imported from (the bundle, when the image lacks dreamlake)."""
    import dreamlake.lakeshore.daemon.entry as entry

    return str(entry.__file__)


@dls.udf(queue="docker")
def echo_bytes(data: bytes) -> bytes:
    """Big arguments and results through the workdir (issue 13: what nymph fetched by reference)."""
    return data[::-1]


@dls.udf(queue="docker")
def interrupted_marker(seconds: float = 120.0) -> str:
    """Touch ``started`` in the workdir, sleep; ``finally`` writes ``marker`` there with the
    Interrupted's reason (issue 30; the workdir of a stopped call is kept)."""
    reason = "none"
    Path("started").touch()
    try:
        time.sleep(seconds)
    except dls.Interrupted as exc:
        reason = exc.reason
        raise
    finally:
        Path("marker").write_text(reason)
    return "slept"
