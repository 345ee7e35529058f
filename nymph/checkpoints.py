"""Checkpoints carried from one attempt of a call to the next (issue 30 item 4): nymph's side.

Inside a task ``dls.checkpoint_dir()`` is ``{workdir}/checkpoint`` (the entry exports its absolute
path as ``LAKESHORE_CHECKPOINT_DIR``; every runner shares the workdir with the task, so this works
on each). When an attempt ends without succeeding (failed, timed out, preempted, also after an
``Interrupted``), :func:`save` tars that directory (regular files and directories only: links and
devices are left out, nothing is followed), uploads the tar through the payload store (key
``payloads/<date>/<invocation_id>.<random>/checkpoint``) and records it with ``POST
/v1/daemon/checkpoint`` before the ack, while the lease is still this attempt's: the control plane
refuses a stale attempt's. A checkpoint over ``checkpoint_max_mb`` (default 1024) is not carried
(one warning). The next run command carries ``checkpoint_ref``; :func:`restore` fetches it (size
and sha256 checked), unpacks it with tarfile's ``data`` filter (no absolute paths, no ``..``, no
links out, no devices) into the new workdir's ``checkpoint/`` and gives it to the task's user.

A checkpoint that cannot be saved or restored costs the progress it held, never the call: the
attempt starts from nothing, and the reason is logged. Without a payload store (the control plane
has neither a bucket nor a blob directory) checkpoints are not carried.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import blobs
from dreamlake.lakeshore.client import retrying
from dreamlake.lakeshore.errors import LakeshoreError
from nymph import refs
from nymph.client import ControlPlaneClient

log = logging.getLogger(__name__)

DIR = "checkpoint"
KIND = "checkpoint"
ENV = "LAKESHORE_CHECKPOINT_DIR"


def _regular_tree(root: Path, limit: int) -> tuple[list[tuple[str, os.stat_result]], int] | None:
    """The directories and regular files under ``root`` (relative names, lstat), not following
    links, with their total size; None when over ``limit``."""
    out: list[tuple[str, os.stat_result]] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                continue  # links, fifos, devices: never carried
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > limit:
                    return None
            out.append((os.path.relpath(path, root), st))
    return out, total


def _pack(root: Path, members: list[tuple[str, os.stat_result]], into: Any) -> None:
    with tarfile.open(fileobj=into, mode="w") as tar:
        for name, st in members:
            info = tarfile.TarInfo(name)
            info.mtime = int(st.st_mtime)
            info.mode = stat.S_IMODE(st.st_mode) & 0o755 | 0o600
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                info.mode |= 0o700
                tar.addfile(info)
                continue
            try:
                fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue  # replaced by a link (or gone) since the walk: left out
            with os.fdopen(fd, "rb") as fh:
                now = os.fstat(fh.fileno())
                if not stat.S_ISREG(now.st_mode):
                    continue
                info.size = now.st_size
                tar.addfile(info, fh)


def save(
    client: ControlPlaneClient | None,
    workdir: Path,
    *,
    invocation_id: str,
    attempt: int,
    worker_id: str,
    namespace: str,
    max_bytes: int,
) -> bool:
    """Carry ``{workdir}/checkpoint`` to the next attempt (see the module docstring); whether it was."""
    root = workdir / DIR
    try:
        st = os.lstat(root)
    except OSError:
        return False  # the task left no checkpoint
    if not stat.S_ISDIR(st.st_mode):
        log.warning("invocation %s: %s is not a directory; no checkpoint carried", invocation_id, root)
        return False
    try:
        tree = _regular_tree(root, max_bytes)
        if tree is None:
            log.warning(
                "invocation %s: checkpoint over %d MiB (checkpoint_max_mb); not carried to the next attempt",
                invocation_id,
                max_bytes // 2**20,
            )
            return False
        members, total = tree
        if not members:
            return False
        with tempfile.TemporaryFile(dir=workdir.parent) as tmp:
            _pack(root, members, tmp)
            ref = refs.ship(client, namespace, invocation_id, tmp, KIND)
        assert client is not None
        client.checkpoint(
            {
                "invocation_id": invocation_id,
                "attempt": attempt,
                "worker_id": worker_id,
                "checkpoint_ref": ref,
            }
        )
    except (LakeshoreError, OSError, tarfile.TarError) as exc:
        log.warning("invocation %s: checkpoint not carried to the next attempt: %s", invocation_id, exc)
        return False
    log.info("invocation %s: checkpoint of attempt %d carried (%d bytes)", invocation_id, attempt, total)
    return True


def restore(client: ControlPlaneClient | None, workdir: Path, body: dict[str, Any]) -> bool:
    """Unpack the run command's ``checkpoint_ref`` into ``{workdir}/checkpoint``, owned by the
    workdir's owner (the task's user); whether there was one to restore."""
    ref = body.get("checkpoint_ref")
    if not isinstance(ref, dict):
        return False
    invocation_id = str(body.get("invocation_id"))
    owner = os.lstat(workdir)
    target = workdir / DIR
    try:
        if client is None:
            raise LakeshoreError("this nymph has no control-plane client")
        with tempfile.TemporaryFile(dir=workdir.parent) as tmp:
            retrying(attempts=refs.ATTEMPTS)(blobs.get, client, refs.namespace_of(body), ref, into=tmp)
            tmp.seek(0)
            target.mkdir(mode=0o700)
            with tarfile.open(fileobj=tmp, mode="r") as tar:
                tar.extractall(target, filter="data")
        for dirpath, dirnames, filenames in os.walk(target):
            for name in [".", *dirnames, *filenames]:
                os.lchown(os.path.join(dirpath, name), owner.st_uid, owner.st_gid)
    except (LakeshoreError, OSError, tarfile.TarError) as exc:
        log.warning(
            "invocation %s: the checkpoint of an earlier attempt could not be restored (%s); "
            "this attempt starts without it",
            invocation_id,
            exc,
        )
        with contextlib.suppress(OSError):
            import shutil

            shutil.rmtree(target)
        return False
    log.info(
        "invocation %s: checkpoint of an earlier attempt restored (%s bytes)", invocation_id, ref.get("size")
    )
    return True
