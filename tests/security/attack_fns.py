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


# --- issue 31: one task against another on the same host ------------------------------------------

VICTIM = "victim.json"  # what the victim tells the test: its pid and its child's
RELEASE = "release"  # the test creates it in the victim's workdir once the attacker is done


def victim(value: str) -> str:
    """A task with a child process (the kind that inherits its environment: the attacker's target),
    that waits for ``release`` in its workdir, then returns ``value`` (unless someone forged it)."""
    import json
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    Path(".victim.tmp").write_text(json.dumps({"pid": os.getpid(), "child": child.pid}))
    os.replace(".victim.tmp", VICTIM)
    while not Path(RELEASE).exists():
        time.sleep(0.02)
    child.kill()
    child.wait()
    return value


def _try(fn: object) -> str:
    """``done`` when ``fn()`` worked, else ``refused: <exception type>``."""
    try:
        fn()  # type: ignore[operator]
    except OSError as exc:
        return f"refused: {type(exc).__name__}"
    return "done"


def attack_sibling(workdir: str, victim_pid: int, child_pid: int) -> dict[str, str]:
    """What a hostile task tries against a sibling task it knows everything about (its workdir,
    its pid and its child's): forge its result and its error, read its child's environment (the
    credential) and its token file, signal it. Each: ``done``, or ``refused: <why>``."""
    import signal

    from dreamlake.lakeshore import wire

    found: dict[str, str] = {}

    def forge(name: str, data: bytes) -> None:
        tmp = Path(workdir) / f".forged-{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, Path(workdir) / name)

    found["forge_result"] = _try(lambda: forge("result.msgpack", wire.pack("forged by the sibling")))
    found["forge_error"] = _try(
        lambda: forge("error.json", b'{"type": "Forged", "message": "forged by the sibling"}')
    )

    def environ() -> None:
        data = Path(f"/proc/{child_pid}/environ").read_bytes()
        found["environ_has_token"] = str(b"LAKESHORE_TOKEN" in data)

    found["read_environ"] = _try(environ)
    found["read_token_file"] = _try(lambda: (Path(workdir) / "task.token").read_bytes())
    found["signal_child"] = _try(lambda: os.kill(child_pid, signal.SIGKILL))
    found["signal_victim"] = _try(lambda: os.kill(victim_pid, signal.SIGTERM))
    return found


def leak_token(gate: str) -> str:
    """Copy this task's credential (from the file LAKESHORE_TOKEN_FILE names) to ``token`` in the
    workdir, say whether the token itself is in the environment, wait for ``gate``."""
    path = os.environ["LAKESHORE_TOKEN_FILE"]
    Path(".token.tmp").write_text(Path(path).read_text())
    os.replace(".token.tmp", "token")
    while not Path(gate).exists():
        time.sleep(0.02)
    return "in environment" if "LAKESHORE_TOKEN" in os.environ else "file only"


def hog(step_mib: int = 16) -> int:
    """Allocate (and touch) memory without bound; returns only if nothing stops it (it must not)."""
    held = []
    while True:
        held.append(bytearray(step_mib << 20))  # zeroed, so every page is touched
        if len(held) * step_mib > 64 << 10:  # 64 GiB: no limit held it, give up
            return len(held) * step_mib


def fork_bomb(tries: int) -> dict[str, object]:
    """Fork children that sleep, up to ``tries``; stop at the first refusal and say why."""
    forked = 0
    for _ in range(tries):
        try:
            pid = os.fork()
        except OSError as exc:
            return {"forked": forked, "errno": exc.errno}
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        forked += 1
    return {"forked": forked, "errno": None}


def big_result(mib: int) -> bytes:
    """A result of ``mib`` MiB: fits the task's memory once, not twice (packing copies it)."""
    return bytes(mib << 20)


def fail_when(gate: str, limit_s: float = 60.0) -> None:
    """Wait for the file ``gate`` (relative: in the workdir, where the test puts it), then fail:
    nymph keeps the workdir of a failed call."""
    deadline = time.monotonic() + limit_s
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    raise RuntimeError("failed on cue")


def echo(value: str) -> str:
    """A tenant's task whose argument is its secret (what another tenant's task hunts for)."""
    return value


def scan_memory(needles_file: str) -> dict[str, int]:
    """Hunt this process's own memory for another task's request data: for each ``[anchor,
    length, sha256]`` in the JSON file ``needles_file``, how many places hold ``length`` bytes
    starting with ``anchor`` whose digest is ``sha256``. Only digests are handed over (and in a file,
    so the request that started this task stays small), so the needles themselves never enter this
    process unless they were in its memory already (inherited from whatever it was forked from). Reads every
    readable mapping that is not a file (the heap, anonymous arenas, the stack) listed in
    ``/proc/self/maps``, directly (``/proc/self/mem`` is root's in a process that changed its uid)."""
    import ctypes
    import hashlib
    import json

    needles = json.loads(Path(needles_file).read_text())
    found = {digest: 0 for _anchor, _length, digest in needles}
    with open("/proc/self/maps") as fh:
        maps = [line.split() for line in fh.read().splitlines()]
    for parts in maps:
        name = parts[5] if len(parts) > 5 else ""
        if "r" not in parts[1] or (name and name not in ("[heap]", "[stack]")):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        data = ctypes.string_at(lo, hi - lo)
        for anchor, length, digest in needles:
            key = anchor.encode()
            at = data.find(key)
            while at != -1:
                if hashlib.sha256(data[at : at + length]).hexdigest() == digest:
                    found[digest] += 1
                at = data.find(key, at + 1)
    return found
