"""What a hostile task does on a nymph host (issue 11), shipped by reference like any function.

These run as nymph's task user, from a copy of this module in a directory that user can read
(:func:`tests.security.nymph_stack.readable_runtime`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

# Every name nymph writes in a workdir (and the temporaries it once used), and the task's outputs
# it reads: a link planted under any of them must not make root write or read outside the workdir.
PLANTED = (
    "handle.json",
    "handle.json.tmp",
    "invocation.json",
    "invocation.json.tmp",
    "outcome.json",
    "outcome.json.tmp",
    "pump.json",
    "pump.json.tmp",
    ".entry.lock",
    "slurm-job.sh",
    ".stdout.log.tmp",
    ".stderr.log.tmp",
)
READ_BY_NYMPH = ("stdout.log", "stderr.log")


def plant_links(victims: str, mine: str, kind: str) -> Iterator[int]:
    """Plant ``kind`` (symlink | hardlink) links in the workdir, then stream, then die without error.json.

    ``victims``: a root-owned directory with ``victim-<name>`` files and ``secret``; ``mine``: a
    directory of the task user's own. A hard link to a root-owned file is refused by the kernel
    (``fs.protected_hardlinks``); the task then links its own file there instead, which nymph must
    not write through either. Yields two values (nymph saves its pump progress after each), then
    exits with code 3 and no error.json, so nymph reads the (planted) stderr.log for the failure.
    """
    refused = []
    for name in PLANTED:
        target = Path(victims) / f"victim-{name}"
        with_fallback = Path(mine) / f"mine-{name}"
        _unlink(name)
        if kind == "symlink":
            os.symlink(target, name)
            continue
        try:
            os.link(target, name)
        except PermissionError:
            refused.append(name)
            with_fallback.write_text("original")
            os.link(with_fallback, name)
    for name in READ_BY_NYMPH:  # nymph would send their tail with the failure
        _unlink(name)
        os.symlink(Path(victims) / "secret", name)
    Path("planted.txt").write_text(" ".join(refused))
    yield 1
    time.sleep(0.3)
    yield 2
    time.sleep(0.3)
    os._exit(3)


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def ids() -> tuple[int, int]:
    """The task's real and effective uid."""
    return os.getuid(), os.geteuid()


def token_seen(token: str) -> dict[str, object]:
    """Look for the daemon token where a local user could: every process's command line (what
    ``ps`` shows) and this task's environment. Then wait for ``release`` in the workdir."""
    cmdlines = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                line = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if token in line:
            cmdlines.append(line[:200])
    Path("scanned").write_text("")
    while not Path("release").exists():
        time.sleep(0.02)
    return {"environ": any(token in value for value in os.environ.values()), "cmdlines": cmdlines}
