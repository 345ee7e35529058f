"""Checkpoints carried from one attempt of a call to the next (issue 30 item 4): nymph's side.

Inside a task ``dls.checkpoint_dir()`` is ``{workdir}/checkpoint`` (the entry exports its absolute
path as ``LAKESHORE_CHECKPOINT_DIR``; every runner shares the workdir with the task, so this works
on each). When an attempt ends without succeeding (failed, timed out, preempted, also after an
``Interrupted``), :func:`save` tars that directory (regular files and directories the task owns
only: links, devices and other users' files are left out, nothing is followed, every name opened
relative to its parent's descriptor, see :func:`_pack_tree`), uploads the tar through the payload store (key
``payloads/<date>/<invocation_id>.<random>/checkpoint``) and records it with ``POST
/v1/daemon/checkpoint`` before the ack, while the lease is still this attempt's: the control plane
refuses a stale attempt's. A checkpoint (its tar) over ``checkpoint_max_mb`` (default 1024) or over
the control plane's ``MAX_PAYLOAD_BYTES`` (default 100 MiB; its register answer says it: the
client's ``limits.max_payload_bytes``), whichever is smaller, is not carried: one warning names
the setting to raise (:func:`size_limit`). The next run command carries ``checkpoint_ref``; :func:`restore` fetches it (size
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
MAX_DEPTH = 64  # directories deeper than this are left out


class _TooBig(Exception):
    pass


def _listing(dfd: int) -> list[str]:
    """The names in the directory open at ``dfd``, sorted (a tar that packs the same tree alike)."""
    return sorted(os.listdir(dfd))


def _owned(st: os.stat_result, owner: int) -> bool:
    """Whether a checkpoint entry may be carried: the task's own (the workdir's owner), or nymph's
    with one link (a hard link the task made to one of nymph's files has two)."""
    if st.st_uid == owner:
        return True
    return st.st_uid == os.geteuid() and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1)


def _pack_tree(workdir: Path, into: Any, limit: int) -> tuple[int, int] | None:
    """Tar ``workdir/checkpoint`` into ``into``: ``(members, bytes)``, or None when over ``limit``
    bytes. The task owns that tree and may change it while nymph (root) reads it, so every name is
    opened relative to its parent's descriptor with ``O_NOFOLLOW`` (a directory with
    ``O_DIRECTORY`` too) and checked on the descriptor (``fstat``), never by path: a link planted
    anywhere in it, even swapped in for a directory between the listing and the open, fails the
    open (ELOOP) and is left out, as are FIFOs, devices and files owned by anyone but the task (or
    nymph), e.g. a hard link to a file the task cannot read. Raises OSError when ``checkpoint``
    itself is not such a directory."""
    wfd = os.open(workdir, _DIR_FLAGS)
    try:
        owner = os.fstat(wfd).st_uid
        rfd = os.open(DIR, _DIR_FLAGS, dir_fd=wfd)
    finally:
        os.close(wfd)
    counts = [0, 0]  # members, bytes
    try:
        st = os.fstat(rfd)
        if not _owned(st, owner):
            raise PermissionError(f"{workdir / DIR} is owned by uid {st.st_uid}, not the task's")
        with tarfile.open(fileobj=into, mode="w") as tar:
            _pack_dir(tar, rfd, "", owner, limit, counts, 0)
    except _TooBig:
        return None
    finally:
        os.close(rfd)
    return counts[0], counts[1]


def _pack_dir(
    tar: tarfile.TarFile, dfd: int, prefix: str, owner: int, limit: int, counts: list[int], depth: int
) -> None:
    for name in _listing(dfd):
        member = prefix + name
        try:
            seen = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not (stat.S_ISDIR(seen.st_mode) or stat.S_ISREG(seen.st_mode)):
                continue  # links, FIFOs, devices, sockets: never opened, never carried
            fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
        except OSError as exc:  # ELOOP: a link; ENOENT: gone since the listing; EACCES ...
            log.debug("checkpoint: %s left out (%s)", member, exc.strerror or exc)
            continue
        try:
            st = os.fstat(fd)
            if not _owned(st, owner) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                log.warning("checkpoint: %s left out (not the task's own file or directory)", member)
                continue
            info = tarfile.TarInfo(member)
            info.mtime = int(st.st_mtime)
            info.mode = stat.S_IMODE(st.st_mode) & 0o755 | 0o600
            if stat.S_ISDIR(st.st_mode):
                if depth >= MAX_DEPTH:
                    continue
                info.type = tarfile.DIRTYPE
                info.mode |= 0o700
                tar.addfile(info)
                counts[0] += 1
                sub = os.open(".", _DIR_FLAGS, dir_fd=fd)  # the very directory checked above
                try:
                    _pack_dir(tar, sub, member + "/", owner, limit, counts, depth + 1)
                finally:
                    os.close(sub)
                continue
            counts[1] += st.st_size
            if counts[1] > limit:
                raise _TooBig
            info.size = st.st_size
            os.set_blocking(fd, True)
            with os.fdopen(os.dup(fd), "rb") as fh:
                tar.addfile(info, fh)
            counts[0] += 1
        finally:
            os.close(fd)


def size_limit(client: ControlPlaneClient | None, max_bytes: int) -> tuple[int, str]:
    """The largest checkpoint nymph carries, and what to raise to carry a larger one. ``max_bytes``
    is nymph's ``checkpoint_max_mb``; the control plane refuses an upload over its
    ``MAX_PAYLOAD_BYTES`` (the client's ``limits``, from the register answer)."""
    plane = getattr(getattr(client, "limits", None), "max_payload_bytes", None)
    if isinstance(plane, int) and plane < max_bytes:
        return plane, (
            f"the control plane's MAX_PAYLOAD_BYTES ({plane / 2**20:g} MiB, under nymph's checkpoint_max_mb "
            f"of {max_bytes / 2**20:g} MiB) is the limit: raise MAX_PAYLOAD_BYTES on the control plane"
        )
    return max_bytes, f"nymph's checkpoint_max_mb ({max_bytes / 2**20:g} MiB) is the limit: raise it"


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
    """Carry ``{workdir}/checkpoint`` to the next attempt (see the module docstring); whether it
    was. ``max_bytes``: nymph's ``checkpoint_max_mb`` (the control plane's limit may be smaller)."""
    try:
        st = os.lstat(workdir / DIR)
    except OSError:
        return False  # the task left no checkpoint
    if not stat.S_ISDIR(st.st_mode):
        log.warning(
            "invocation %s: %s is not a directory; no checkpoint carried", invocation_id, workdir / DIR
        )
        return False
    try:
        limit, setting = size_limit(client, max_bytes)
        with tempfile.TemporaryFile(dir=workdir.parent) as tmp:
            packed = _pack_tree(workdir, tmp, limit)
            size = tmp.tell()  # the tar, headers and padding included: what is uploaded
            if packed is None or size > limit:
                log.warning(
                    "invocation %s: checkpoint not carried to the next attempt: its tar is over %d bytes; "
                    "%s to carry a larger one",
                    invocation_id,
                    limit,
                    setting,
                )
                return False
            members, total = packed
            if not members:
                return False
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
