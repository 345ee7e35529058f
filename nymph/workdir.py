"""nymph's side of the workdir contract (docs/architecture.md, "The workdir contract").

``{workdir}/{invocation_id}/`` is created mode 0700 (owned by ``as_user`` when set) only after the
id was validated as a ULID, so an id from the network never becomes an arbitrary path. It holds
``args.msgpack`` (the Envelope, verbatim), nymph's own ``invocation.json`` (what a restarted nymph
needs to ack: attempt, script, timeout) and, once settled, ``outcome.json``. After the runner is
done, :func:`read_outcome` turns ``result.msgpack`` / ``error.json`` and the exit status into the
ack's state, result and error.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import ids
from nymph.runner import ExitStatus

log = logging.getLogger(__name__)

ARGS = "args.msgpack"
RESULT = "result.msgpack"
ERROR = "error.json"
FRAMES = "frames.msgpack"
META = "invocation.json"
OUTCOME = "outcome.json"
STDOUT = "stdout.log"
STDERR = "stderr.log"


@dataclass
class Outcome:
    """What an ack reports: ``state`` in succeeded | failed | killed | timeout."""

    state: str
    result_blob: bytes = b""
    error: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def failed(cls, type_: str, message: str, traceback: str | None = None) -> Outcome:
        error: dict[str, Any] = {"type": type_, "message": message}
        if traceback:
            error["traceback"] = traceback
        return cls("failed", b"", error)


def path_for(root: Path, invocation_id: str) -> Path:
    """The workdir of ``invocation_id``; raises InvalidId before anything touches the disk."""
    return root / ids.validate(invocation_id, "invocation_id")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def create(
    root: Path, invocation_id: str, args_blob: bytes, meta: dict[str, Any], as_user: str | None
) -> Path:
    """Create the private workdir with args.msgpack and invocation.json; return its path."""
    path = path_for(root, invocation_id)
    if path.exists():
        aside = root / f"{invocation_id}.old-{int(time.time())}"
        log.warning(
            "invocation %s: workdir exists from an earlier attempt, moved to %s", invocation_id, aside
        )
        os.replace(path, aside)
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    # No fsync: the workdir only has to survive nymph's death, not the host's (a task dies with
    # its host, and the control plane re-queues it when the lease lapses); the page cache is enough.
    (path / ARGS).write_bytes(bytes(args_blob))
    (path / META).write_bytes(json.dumps(meta).encode())
    if as_user:
        pw = pwd.getpwnam(as_user)
        for target in (path, path / ARGS):
            os.chown(target, pw.pw_uid, pw.pw_gid)
    return path


def read_meta(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def mark_settled(path: Path, outcome: Outcome) -> None:
    """Record that the outcome was handed to the outbox (a restart leaves this workdir alone)."""
    try:
        _write_atomic(path / OUTCOME, json.dumps({"state": outcome.state, "error": outcome.error}).encode())
    except OSError as exc:
        log.warning("workdir %s: cannot write %s: %s", path, OUTCOME, exc)


def is_settled(path: Path) -> bool:
    return (path / OUTCOME).exists()


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def leftovers(root: Path) -> list[Path]:
    """Workdirs named by a ULID under ``root`` (what a previous life may have left)."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and ids.is_ulid(p.name))
    except FileNotFoundError:
        return []


def tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` bytes of a file, decoded as UTF-8; empty when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def read_outcome(path: Path, status: ExitStatus | None, *, script: bool = False) -> Outcome:
    """Turn the entry's outputs and exit status into an Outcome (seed 000 semantics)."""
    code = status.exit_code if status is not None else -1
    reason = f" ({status.reason})" if status is not None and status.reason else ""
    if script:
        if code == 0:
            from dreamlake.lakeshore import wire

            return Outcome("succeeded", wire.pack({"exit_code": 0}))
        return Outcome.failed("ScriptFailed", f"script exited with code {code}{reason}", tail(path / STDERR))
    result = path / RESULT
    if code == 0 or (status is None and result.exists()):
        try:
            return Outcome("succeeded", result.read_bytes())
        except OSError:
            return Outcome.failed("MissingResult", "the entry exited 0 but left no result.msgpack")
    try:
        err = json.loads((path / ERROR).read_text())
        if isinstance(err, dict) and "type" in err:
            error = {
                "type": str(err.get("type")),
                "message": str(err.get("message", "")),
                "traceback": str(err.get("traceback") or ""),
            }
            return Outcome("failed", b"", error)
    except (OSError, ValueError):
        pass
    logs = status.logs if status is not None and status.logs else tail(path / STDERR)
    return Outcome.failed(
        "ProcessExited", f"the entry exited with code {code}{reason} and left no error.json", logs
    )
