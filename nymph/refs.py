"""Arguments, results and frames by reference (seed 003 ``argsRef`` / ``resultRef``): nymph's side.

A run command whose Envelope went to the payload store carries ``args_ref`` ({bucket, key, size,
sha256}) and an empty ``args_blob``: :func:`stage_args` streams the blob into a private file under
``{workdir}/.incoming/`` (verified against its sha256 before anything else looks at it), the gates
read the Envelope's header off that file (a memory map: the arguments are skipped, not read), and
the workdir takes the file as its ``args.msgpack``, so every runner works unchanged.

On the way back, a result (``result.msgpack``) or a frame body larger than the control plane's
``inline_threshold_bytes`` (its register answer) is uploaded before the ack or the frame is sent:
the ack carries ``result_ref`` instead of ``result_blob``, the frame a body ``{"ref": {...}}``.
The keys are ``payloads/<namespace>/<date>/<invocation_id>.<random>/result`` and ``.../frame-<seq>``
(:func:`~dreamlake.lakeshore.blobs.private_job_id`).

Failures: a blob that cannot be had or fails its sha256 refuses the invocation before it runs
(``PayloadCorrupt`` with seed 003's message, or ``PayloadUnavailable``); a result that cannot be
uploaded fails it with ``ResultUploadFailed`` (the task's output is in the kept workdir).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

from dreamlake.lakeshore import blobs, ids
from dreamlake.lakeshore.client import retrying
from dreamlake.lakeshore.envelope import Envelope
from dreamlake.lakeshore.errors import LakeshoreError, PayloadCorrupt, PlaneError
from nymph.client import ControlPlaneClient
from nymph.errors import GateRefused

log = logging.getLogger(__name__)

INCOMING = ".incoming"
STALE_S = 86400.0  # a staged argument file this old belongs to no running job
ATTEMPTS = 5  # tries of a blob transfer that fails retryably (the store or the control plane away)


def namespace_of(body: dict[str, Any]) -> str:
    """The namespace a run command's blobs are presigned in (the invocation's)."""
    return str(body.get("namespace") or "default")


def stage_args(client: ControlPlaneClient | None, root: Path, body: dict[str, Any]) -> Path:
    """Download the run command's ``args_ref`` into ``root/.incoming/<invocation_id>.args`` (0600,
    nymph's) and return its path; GateRefused when it cannot be had or is corrupt."""
    invocation_id = ids.validate(body.get("invocation_id"), "invocation_id")
    ref = body.get("args_ref")
    if client is None:
        raise GateRefused(
            "PayloadUnavailable", "this nymph has no control-plane client to fetch args_ref with"
        )
    incoming = root / INCOMING
    incoming.mkdir(mode=0o700, parents=True, exist_ok=True)
    _prune(incoming)
    path = incoming / f"{invocation_id}.args"
    try:
        assert isinstance(ref, dict)
        retrying(attempts=ATTEMPTS)(blobs.get, client, namespace_of(body), ref, into=path)
    except PayloadCorrupt as exc:
        raise GateRefused("PayloadCorrupt", str(exc)) from exc
    except (PlaneError, OSError, AssertionError) as exc:
        raise GateRefused(
            "PayloadUnavailable",
            f"the arguments (args_ref {str((ref or {}).get('key'))!r}) could not be fetched: {exc}",
        ) from exc
    log.info("invocation %s: arguments fetched by reference (%s bytes)", invocation_id, ref.get("size"))
    return path


def _prune(incoming: Path, max_age_s: float = STALE_S) -> None:
    """Drop what an earlier life left half-fetched (a crash between fetch and workdir)."""
    cutoff = time.time() - max_age_s
    for entry in incoming.iterdir():
        with contextlib.suppress(OSError):
            if entry.lstat().st_mtime < cutoff:
                entry.unlink()


def header_of(path: Path) -> dict[str, Any]:
    """The Envelope header of a staged ``args.msgpack``, read through a memory map (the arguments
    themselves are skipped, never copied)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return Envelope.header(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
            return Envelope.header(view)


def discard(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def ship(
    client: ControlPlaneClient | None, namespace: str, invocation_id: str, data: bytes | BinaryIO, kind: str
) -> dict[str, Any]:
    """Upload ``data`` (bytes, or a file) as ``payloads/<namespace>/<date>/<invocation_id>/<kind>`` -> its ref.
    Raises LakeshoreError (the client's errors) when it cannot."""
    if client is None:
        raise LakeshoreError("no control-plane client to upload through")

    def once() -> dict[str, Any]:
        if not isinstance(data, bytes):
            data.seek(0)  # a try again starts from the file's beginning
        return blobs.put(client, namespace, data, job_id=blobs.private_job_id(invocation_id), kind=kind)

    ref: dict[str, Any] = retrying(attempts=ATTEMPTS)(once)
    return ref
