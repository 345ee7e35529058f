"""Files nymph reads and writes in a directory its task's user can write (a workdir).

A workdir belongs to the task's user, and nymph may run as root: a task can plant a symbolic link,
a hard link or a FIFO under any name nymph uses there, to make root write, truncate or read a file
outside the workdir (or hang reading a FIFO). So nymph never opens a workdir path the ordinary way;
every helper here opens the directory first (``O_DIRECTORY | O_NOFOLLOW``) and the name relative to
that descriptor, never following a link, never blocking on a FIFO:

- :func:`write_file` / :func:`write_stream`: atomic replacement. The bytes go to a fresh file under
  a random name, created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted name makes it fail, never
  write through), which is then renamed over the target (a rename replaces a planted link, it does
  not write through it).
- :func:`read_own`: nymph's own documents (``handle.json``, ``invocation.json``, ``pump.json``,
  ``outcome.json``). Only a regular file owned by nymph's uid with exactly one link is read: a task
  running as another user cannot create one, and a hard link it made to one has two links. Anything
  else reads as absent (and is logged), so a task cannot forge what a restarted nymph acts on.
- :func:`open_output`: what the task wrote (``result.msgpack``, ``error.json``, ``frames.msgpack``,
  the logs), for reading. A regular file owned by the directory's owner (the task's user), or one of
  nymph's own files (owned by nymph, one link); else None, so a planted link to a file the task
  cannot read itself is never read by nymph on its behalf.
- :func:`open_fd` / :func:`open_append`: a file nymph opens for the task (``stdout.log`` to append
  to, the process runner's entry lock), under the same rule as :func:`open_output`.

When nymph and the task run as the same user there is no boundary to keep (the task can do whatever
nymph can); the helpers then behave like plain opens.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class UnsafeFile(OSError):
    """A name in a task-writable directory is not a file nymph may use (a link, a FIFO, not its own)."""


@contextlib.contextmanager
def _directory(directory: Path) -> Iterator[int]:
    fd = os.open(directory, _DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def read_all(fd: int, limit: int | None = None) -> bytes:
    """``os.read`` from ``fd``'s position to its end, or ``limit`` bytes (no file object, as in
    :func:`write_all`)."""
    chunks: list[bytes] = []
    total = 0
    while limit is None or total < limit:
        chunk = os.read(fd, _READ_CHUNK if limit is None else min(_READ_CHUNK, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_READ_CHUNK = 1 << 20


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """``os.write`` until all of ``data`` is written (no file object: its set-up costs an fstat,
    an ioctl and an lseek per file, on paths every invocation takes)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_file(directory: Path, name: str, data: bytes, mode: int = 0o600, *, sync: bool = False) -> None:
    """Replace ``directory/name`` with ``data`` atomically, never through a planted link."""
    write_stream(directory, name, (data,), mode, sync=sync)


def write_stream(
    directory: Path, name: str, chunks: Iterable[bytes], mode: int = 0o600, *, sync: bool = False
) -> None:
    """:func:`write_file` for data that comes in chunks (a container's log)."""
    with _directory(directory) as dfd:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd
        )
        try:
            for chunk in chunks:
                write_all(fd, chunk)
            if sync:
                os.fsync(fd)
            os.fchmod(fd, mode)  # not narrowed by the umask
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.close(fd)
        try:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise


def create_new(directory: Path, files: Iterable[tuple[str, bytes, int]]) -> None:
    """Create each ``(name, data, mode)`` in ``directory``, which must still be nymph's alone (just
    made, not yet handed to a task): written in place, through one directory fd, with no temporary
    name and no rename (nothing else can write there yet, and ``O_EXCL | O_NOFOLLOW`` refuses a name
    that exists). Not atomic: a crash leaves a partial file, in a workdir a restart removes."""
    with _directory(directory) as dfd:
        for name, data, mode in files:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd
            )
            try:
                write_all(fd, data)
                os.fchmod(fd, mode)  # not narrowed by the umask
            finally:
                os.close(fd)


def _open_checked(directory: Path, name: str, flags: int, mode: int, *, own: bool) -> int:
    """An fd on ``directory/name`` that passed the ownership rule (``own``: nymph's documents only)."""
    with _directory(directory) as dfd:
        fd = os.open(name, flags, mode, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            owner = os.fstat(dfd).st_uid
            why = _refusal(st, owner, own=own)
            if why is not None:
                raise UnsafeFile(f"{directory / name}: {why}; not used")
            # O_NONBLOCK only kept the open from blocking on a FIFO; nymph's own reads and writes of
            # a regular file (all that passes the rule) are the same with it, so it stays (one ioctl
            # less); an fd a task inherits is made blocking (open_append)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _refusal(st: os.stat_result, dir_owner: int, *, own: bool) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    me = os.geteuid()
    if st.st_uid == me and st.st_nlink == 1:
        return None
    if st.st_uid == me == dir_owner:
        return None  # the task runs as nymph's own user: nothing to keep apart
    if not own and st.st_uid == dir_owner:
        return None  # the task's own file
    if st.st_uid == me:
        return f"owned by nymph but with {st.st_nlink} links (a planted hard link)"
    return f"owned by uid {st.st_uid}, not by nymph (uid {me})" + ("" if own else " nor the task")


def read_own(directory: Path, name: str, limit: int = 1 << 20) -> bytes | None:
    """The bytes of nymph's own document ``directory/name``; None when absent or not nymph's."""
    try:
        fd = _open_checked(directory, name, _READ_FLAGS, 0, own=True)
    except FileNotFoundError:
        return None
    except UnsafeFile as exc:
        log.warning("%s", exc)
        return None
    except OSError as exc:  # ELOOP: a symbolic link; ENOTDIR, EACCES ...
        log.warning("%s: cannot open safely (%s); not used", directory / name, exc.strerror or exc)
        return None
    try:
        return read_all(fd, limit)
    finally:
        os.close(fd)


def exists_own(directory: Path, name: str) -> bool:
    """True when ``directory/name`` is a document nymph wrote (see :func:`read_own`)."""
    return read_own(directory, name, limit=0) is not None


def open_output(directory: Path, name: str) -> BinaryIO | None:
    """``directory/name`` open for reading when it is the task's (or nymph's) regular file, else None.

    Raises nothing: a missing file is None, a refused one is None and logged.
    """
    fd = _output_fd(directory, name)
    return None if fd is None else os.fdopen(fd, "rb")


def read_output(directory: Path, name: str, tail: int | None = None) -> bytes | None:
    """All of ``directory/name`` (see :func:`open_output`), or its last ``tail`` bytes; None when
    absent or refused."""
    fd = _output_fd(directory, name)
    if fd is None:
        return None
    try:
        if tail is not None:
            os.lseek(fd, max(0, os.fstat(fd).st_size - tail), os.SEEK_SET)
        return read_all(fd)
    finally:
        os.close(fd)


def read_output_within(directory: Path, name: str, limit: int | None) -> tuple[bytes | None, int]:
    """``(all of directory/name, its size)`` when it holds at most ``limit`` bytes (None: any),
    ``(None, its size)`` when it holds more (left on disk, not read), ``(None, -1)`` when absent or
    refused (see :func:`open_output`): one open for both the size and the bytes."""
    fd = _output_fd(directory, name)
    if fd is None:
        return None, -1
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            return None, size
        data = read_all(fd)
        return data, len(data)
    finally:
        os.close(fd)


def _output_fd(directory: Path, name: str) -> int | None:
    """An fd on ``directory/name`` under the rule of :func:`open_output`, or None (logged if refused)."""
    try:
        return _open_checked(directory, name, _READ_FLAGS, 0, own=False)
    except FileNotFoundError:
        return None
    except UnsafeFile as exc:
        log.warning("%s", exc)
        return None
    except OSError as exc:
        log.warning("%s: cannot open safely (%s); not read", directory / name, exc.strerror or exc)
        return None


def open_fd(directory: Path, name: str, flags: int, mode: int = 0o600) -> int:
    """``os.open(directory/name, flags)`` under the rule of :func:`open_output` (close-on-exec).

    Raises :class:`UnsafeFile` (an OSError) for a link, a FIFO or another user's file, and the
    usual OSError (FileNotFoundError ...) otherwise.
    """
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        return _open_checked(directory, name, flags, mode, own=False)
    except OSError as exc:
        if isinstance(exc, UnsafeFile) or exc.errno != errno.ELOOP:
            raise
        raise UnsafeFile(exc.errno, f"{directory / name}: a symbolic link; not used") from exc


def open_append(directory: Path, name: str, mode: int = 0o644) -> int:
    """An ``O_APPEND`` fd on ``directory/name`` (created if missing) for the task's output: blocking,
    as a task (and whatever it hands it to: io_uring, a FUSE server) expects its stdout to be."""
    fd = open_fd(directory, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    os.set_blocking(fd, True)
    return fd


def append_stream(directory: Path, name: str, chunks: Iterable[bytes], mode: int = 0o644) -> int:
    """Append ``chunks`` to ``directory/name`` (created if missing) under the rule of
    :func:`open_output`: nothing is opened until the first non-empty chunk; returns the bytes written."""
    fd: int | None = None
    written = 0
    try:
        for chunk in chunks:
            if not chunk:
                continue
            if fd is None:
                fd = open_append(directory, name, mode)
            view = memoryview(chunk)
            while view:
                n = os.write(fd, view)
                written += n
                view = view[n:]
    finally:
        if fd is not None:
            os.close(fd)
    return written


def unlink(directory: Path, name: str) -> None:
    """Remove ``directory/name`` (a link itself, never its target); absent is fine."""
    with _directory(directory) as dfd, contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)
