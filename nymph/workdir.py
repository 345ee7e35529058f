"""nymph's side of the workdir contract (docs/architecture.md, "The workdir contract").

``{workdir}/{invocation_id}/`` is created mode 0700 only after the id was validated as a ULID, so an
id from the network never becomes an arbitrary path. It holds ``args.msgpack`` (the Envelope,
verbatim), nymph's own ``invocation.json`` (what a restarted nymph needs to ack: attempt, script,
timeout), the empty ``stdout.log`` / ``stderr.log``, the attempt's credential ``task.token``
(mode 0400: the task finds it through ``LAKESHORE_TOKEN_FILE``, not in an environment every child
inherits and ``/proc/PID/environ`` shows) and, once settled, ``outcome.json``. Everything
is written while the directory is still nymph's; then the directory, ``args.msgpack``, the token and
the logs are handed to the user the task runs as (``run_as``: ``as_user`` or nymph's task user, see
:mod:`nymph.taskuser`), so every runner finds that user as the workdir's owner.

From then on the task's user can write the directory, so nymph reads and writes in it only through
:mod:`nymph.safeio` (no symbolic link followed, no FIFO opened blocking, atomic replacement, an
ownership rule for what it reads). After the runner is done, :func:`read_outcome` turns
``result.msgpack`` / ``error.json`` and the exit status into the ack's state, result and error.
A failed call's workdir is kept; one of a task user pool's user is taken back (:func:`seal`) before
that user serves another tenant: the files stay, but no path reaches them but root's.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pwd
import shutil
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import ids
from nymph import outputcheck, safeio
from nymph.runner import HANDLE_FILE, ExitStatus

log = logging.getLogger(__name__)

ARGS = "args.msgpack"
RESULT = "result.msgpack"
ERROR = "error.json"
FRAMES = "frames.msgpack"
META = "invocation.json"
OUTCOME = "outcome.json"
STDOUT = "stdout.log"
STDERR = "stderr.log"
TOKEN = "task.token"  # the attempt's task token, 0400, the task's user's (LAKESHORE_TOKEN_FILE)
STOP = "stop.json"  # nymph's record of why it stopped the task (mark_stopping): a restart acks that
OLD_MARK = ".old-"  # ``{invocation_id}.old-{unix time}``: an earlier attempt's workdir, moved aside


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


def create(
    root: Path,
    invocation_id: str,
    args_blob: bytes,
    meta: dict[str, Any],
    run_as: str | None,
    *,
    args_file: Path | None = None,
    write_args: bool = True,
    token: str | None = None,
    extra: Sequence[tuple[str, bytes, int]] = (),
) -> Path:
    """Create the private workdir with args.msgpack, invocation.json and the empty logs; return its path.

    ``run_as``: the local user the task runs as (None: nymph's own user), who gets the directory.
    ``args_file``: a file of nymph's on the same filesystem (arguments fetched by reference, see
    :mod:`nymph.refs`) moved in as ``args.msgpack`` instead of writing ``args_blob``.
    ``write_args`` False: no ``args.msgpack`` (the runner takes the arguments in ``Task.args``).
    ``token``: the attempt's task token, written to ``task.token`` (0400, the task's user's).
    ``extra``: more ``(name, bytes, mode)`` files handed to the task's user likewise (the control
    plane's CA for the task, :mod:`nymph.tasktls`).
    """
    path = path_for(root, invocation_id)
    if os.path.lexists(path):
        aside = root / f"{invocation_id}{OLD_MARK}{int(time.time())}"
        log.warning(
            "invocation %s: workdir exists from an earlier attempt, moved to %s", invocation_id, aside
        )
        try:
            os.replace(path, aside)
        except FileNotFoundError:  # pruned meanwhile: nothing left to move
            pass
    path.mkdir(mode=0o700)
    try:
        os.chmod(path, 0o700)
        # No fsync: the workdir only has to survive nymph's death, not the host's (a task dies with
        # its host, and the control plane re-queues it when the lease lapses); the page cache is enough.
        # The directory is nymph's alone until hand_over: its files are written in place through
        # one directory fd (no temporary names, no renames); a crash meanwhile leaves a workdir
        # whose task never started, which the next life removes (nothing_runs).
        files = [(META, json.dumps(meta).encode(), 0o600), (STDOUT, b"", 0o644), (STDERR, b"", 0o644)]
        if args_file is not None:
            os.chmod(args_file, 0o600)
            os.replace(args_file, path / ARGS)
        elif write_args:
            files.insert(0, (ARGS, bytes(args_blob), 0o600))
        if token:
            files.append((TOKEN, token.encode(), 0o400))
        files.extend(extra)
        safeio.create_new(path, files)
        has_args = args_file is not None or write_args
        names = (ARGS, STDOUT, STDERR) if has_args else (STDOUT, STDERR)
        names = (*names, TOKEN) if token else names
        hand_over(path, run_as, (*names, *(name for name, _, _ in extra)))
    except BaseException:  # a full disk, say: leave no half-made workdir for a restart to puzzle over
        remove(path)
        raise
    return path


def hand_over(path: Path, run_as: str | None, names: tuple[str, ...] = ()) -> None:
    """Give the directory ``path`` and its files ``names`` to ``run_as`` (None: keep them nymph's).

    Called while nothing but nymph can write ``path`` (before the task starts).
    """
    if not run_as:
        return
    pw = pwd.getpwnam(run_as)
    if (pw.pw_uid, pw.pw_gid) == (os.geteuid(), os.getegid()):
        return
    for name in names:
        os.chown(path / name, pw.pw_uid, pw.pw_gid, follow_symlinks=False)
    os.chown(path, pw.pw_uid, pw.pw_gid, follow_symlinks=False)


def read_meta(path: Path) -> dict[str, Any] | None:
    data = safeio.read_own(path, META)
    try:
        raw = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return raw if isinstance(raw, dict) else None


def mark_settled(path: Path, outcome: Outcome) -> None:
    """Record that the outcome was handed to the outbox (a restart leaves this workdir alone)."""
    try:
        data = json.dumps({"state": outcome.state, "error": outcome.error}).encode()
        safeio.write_file(path, OUTCOME, data, sync=True)
    except OSError as exc:
        log.warning("workdir %s: cannot write %s: %s", path, OUTCOME, exc)


def seal(path: Path, owners: Collection[int] | None = None) -> None:
    """Take a kept workdir back from the task's user: the directory itself becomes nymph's
    (``chown`` to nymph's uid:gid, mode 0700, through an ``O_NOFOLLOW | O_DIRECTORY`` fd: never a
    link), so no path reaches the files in it for anyone but root, whatever their modes. For a
    user of the task user pool, before it goes back to the pool: the next task as that uid is
    another tenant's. ``owners``: only a workdir one of these uids owns. A workdir that cannot be
    sealed is removed (its logs are not worth a leak)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:  # owner first: the task's user can change the mode no more
            if owners is not None and os.fstat(fd).st_uid not in owners:
                return
            os.fchown(fd, os.geteuid(), os.getegid())
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.error("workdir %s: cannot take it back from the task's user (%s); removed", path, exc)
        remove(path)


def is_settled(path: Path) -> bool:
    return safeio.exists_own(path, OUTCOME)


def mark_stopping(path: Path, reason: str, message: str, detail: str = "") -> None:
    """Record, before the ladder signals the task, why nymph stops it (``Stop.reason``, message
    and detail): a nymph that dies before the outcome is settled acks it so after its restart
    (:func:`read_stopping`), not as the failure the task's ``Interrupted`` left."""
    try:
        data = json.dumps({"reason": reason, "message": message, "detail": detail}).encode()
        safeio.write_file(path, STOP, data, sync=True)
    except OSError as exc:
        log.warning("workdir %s: cannot write %s: %s", path, STOP, exc)


def read_stopping(path: Path) -> tuple[str, str, str] | None:
    """``(reason, message, detail)`` as :func:`mark_stopping` recorded it (nymph's own file only);
    None when nymph never stopped the task."""
    data = safeio.read_own(path, STOP)
    try:
        raw = json.loads(data) if data is not None else None
    except ValueError:
        return None
    if not isinstance(raw, dict) or not all(
        isinstance(raw.get(k, ""), str) for k in ("reason", "message", "detail")
    ):
        return None
    return str(raw.get("reason")), str(raw.get("message") or ""), str(raw.get("detail") or "")


ENTRY_LOCK = ".entry.lock"  # the process runner's entry lock: held by whichever process runs the entry
# what a task leaves once it got somewhere: an outcome, frames, or the runner's handle
OUTCOME_SIGNS = (RESULT, ERROR, FRAMES, HANDLE_FILE)


def _entry_lock_state(path: Path) -> str:
    """The workdir's entry lock: ``"none"`` (no lock file), ``"free"``, ``"held"`` (an entry
    process runs there) or ``"unknown"`` (it could not be opened or tried)."""
    if not os.path.lexists(path / ENTRY_LOCK):
        return "none"
    try:
        fd = safeio.open_fd(path, ENTRY_LOCK, os.O_RDONLY)
    except OSError:
        return "unknown"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: nobody holds it
    except BlockingIOError:
        return "held"
    except OSError:
        return "unknown"
    finally:
        os.close(fd)  # releases it again when it was taken
    return "free"


def entry_never_ran(path: Path) -> bool:
    """Whether no entry process ever took the workdir's entry lock (no lock file): the task never
    started there, as far as the workdir can tell."""
    return _entry_lock_state(path) == "none"


def entry_runs(path: Path) -> bool:
    """Whether an entry process holds the workdir's entry lock now (a task is running there)."""
    return _entry_lock_state(path) == "held"


def nothing_runs(path: Path) -> bool:
    """Whether no task runs in the workdir now and none left anything to report: a previous life
    claimed it and died before its task started (or its task died with it, before any outcome).

    A free entry lock (or none) means no entry process is alive here; an outcome, frames or a
    handle mean there is something to collect or report instead.
    """
    if any(os.path.lexists(path / name) for name in OUTCOME_SIGNS):
        return False
    return _entry_lock_state(path) in ("none", "free")


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def leftovers(root: Path) -> list[Path]:
    """Workdirs named by a ULID under ``root`` (what a previous life may have left)."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and ids.is_ulid(p.name))
    except FileNotFoundError:
        return []


def tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` bytes of a file the task wrote, decoded as UTF-8; empty when it cannot be
    read (or is not the task's to show: see :func:`nymph.safeio.open_output`)."""
    try:
        data = safeio.read_output(path.parent, path.name, tail=limit)
    except OSError:
        return ""
    return "" if data is None else data.decode("utf-8", "replace")


def read_outcome(
    path: Path, status: ExitStatus | None, *, script: bool = False, big: int | None = None
) -> Outcome:
    """Turn the entry's outputs and exit status into an Outcome (seed 000 semantics).

    A ``result.msgpack`` over ``big`` bytes is left on disk, not read: the Outcome says
    ``extra["result_file"]`` and nymph streams it to the payload store (:mod:`nymph.refs`)."""
    code = status.exit_code if status is not None else -1
    reason = f" ({status.reason})" if status is not None and status.reason else ""
    if script:
        if code == 0:
            from dreamlake.lakeshore import wire

            return Outcome("succeeded", wire.pack({"exit_code": 0}))
        return Outcome.failed("ScriptFailed", f"script exited with code {code}{reason}", tail(path / STDERR))
    result = None
    if code == 0 or status is None:
        result, size = safeio.read_output_within(path, RESULT, big)
        if result is None and size >= 0:  # over ``big``: left on disk
            digest, damage = _result_digest(path)
            if damage is None:
                damage = _result_file_damage(path, digest)
            if damage is not None:
                return _damaged(path, RESULT, damage, status)
            return Outcome("succeeded", b"", None, {"result_file": RESULT, "result_size": size})
    if code == 0 or result is not None:
        if result is None:
            return Outcome.failed("MissingResult", "the entry exited 0 but left no result.msgpack")
        digest, damage = _result_digest(path)
        if damage is None:
            damage = outputcheck.result_damage(result, digest)
        if damage is not None:
            return _damaged(path, RESULT, damage, status)
        return Outcome("succeeded", result)
    try:
        err, damage = outputcheck.error_damage(safeio.read_output(path, ERROR))
    except OSError:
        err, damage = None, None
    if damage is not None:
        return _damaged(path, ERROR, damage, status)
    if err is not None:
        error: dict[str, Any] = {
            "type": str(err.get("type")),
            "message": str(err.get("message", "")),
            "traceback": str(err.get("traceback") or ""),
        }
        mro = err.get("mro")
        if isinstance(mro, list) and len(mro) <= 64:  # the base classes retry_on may name
            error["mro"] = [str(n)[:200] for n in mro]
        return Outcome("failed", b"", error)
    logs = status.logs if status is not None and status.logs else tail(path / STDERR)
    if status is not None and (status.oom is not None or (status.reason or "").startswith("OOMKilled")):
        return out_of_memory(status, logs)
    message = f"the entry exited with code {code}{reason} and left no error.json"
    full = _full(path)
    if full is not None:  # most likely why: it could not write its result, nor its error
        message += f"; {full}"
    outcome = Outcome.failed("ProcessExited", message, logs)
    if full is not None:
        outcome.extra["disk_full"] = True
        if outcome.error is not None:  # the control plane does not retry such a crash by default
            outcome.error["disk_full"] = True
    return outcome


def out_of_memory(status: ExitStatus, logs: str | None) -> Outcome:
    """``OutOfMemory``: the kernel killed the task at its memory limit (the runner saw it: the
    cgroup's OOM count, a container's ``OOMKilled``). Not retried unless ``retry_on`` names it."""
    from nymph.limits import OomKill

    oom = status.oom or {}
    kill = OomKill(oom.get("limit"), oom.get("peak"))
    outcome = Outcome.failed("OutOfMemory", kill.message(), logs)
    assert outcome.error is not None
    outcome.error["memory_limit"] = kill.limit
    outcome.error["memory_peak"] = kill.peak
    return outcome


def _result_file_damage(path: Path, digest: bytes | None) -> str | None:
    fh = safeio.open_output(path, RESULT)
    if fh is None:
        return "it could not be opened again to be checked"
    with fh:
        return outputcheck.result_file_damage(fh, digest)


def _result_digest(path: Path) -> tuple[bytes | None, str | None]:
    """``(the entry's result.digest record, None)``; ``(None, None)`` when there is none (an entry
    from before the digest: the result gets the structural check alone); ``(None, what is
    wrong)`` when there is one nymph may not or cannot read (it never reads as absent then)."""
    name = outputcheck.RESULT_DIGEST
    try:
        fd = safeio.open_fd(path, name, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"its digest record ({name}) could not be read ({exc}), so its bytes cannot be checked"
    try:
        return safeio.read_all(fd, outputcheck.DIGEST_MAX_BYTES + 1), None
    except OSError as exc:
        return None, f"its digest record ({name}) could not be read ({exc}), so its bytes cannot be checked"
    finally:
        os.close(fd)


def _damaged(path: Path, name: str, damage: str, status: ExitStatus | None) -> Outcome:
    """The failure of a task whose ``name`` is damaged: ``DamagedOutput``, retried by default (a
    crash's rule), never a success; the file stays in the kept workdir to be looked at."""
    code = "unknown (collected after a restart)" if status is None else str(status.exit_code)
    message = (
        f"the task's {name} is damaged: {damage}; the entry exited with code {code}. "
        "Its output cannot be trusted, so it was not reported as the task's outcome"
    )
    log.warning("workdir %s: %s", path, message)
    return Outcome.failed(outputcheck.DAMAGED, message)


FULL_BELOW_BYTES = 1024 * 1024  # a workdir filesystem with less free space than this counts as full


def _full(path: Path) -> str | None:
    """What to say when ``path``'s filesystem is full (``No space left on device``), else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= FULL_BELOW_BYTES:
        return None
    return (
        f"the workdir's filesystem is full (No space left on device: {free / 2**20:.1f} MiB free "
        f"under {path.parent}), so the task could not write its result"
    )
