"""The code-archive cache: each archive a call ships (``cfg["code"]``) fetched once per sha256.

``{code_cache}/<sha256>/`` holds one archive unpacked: the directory the task gets first on its
import path (``LAKESHORE_CODE_PATH``, see :mod:`dreamlake.lakeshore.daemon.entry`). By default
``code_cache`` is ``{workdir}/.code``: on the workdir's filesystem, so the Slurm job (a shared
workdir) and the kube pod (the hostPath) see it at the same path, and never taken for an
invocation's workdir (those are named by ULIDs).

An archive is used only after its bytes hash to the sha256 the record names (a mismatch is
``payload corrupt: sha256 mismatch (expected …, got …)``, seed 003's text, and the invocation is
refused before anything runs); inline bytes are checked on a cache hit too, a ref is not fetched
again. It is unpacked into a private staging directory and renamed into
place, so a reader sees the whole tree or none of it, and two nymph threads (or processes)
unpacking the same archive at once end with one copy. Every entry is checked first: relative,
no ``..``, no absolute or drive path, a regular file or a directory (a symbolic link, a device or
a FIFO in the archive refuses it), within :data:`MAX_ENTRIES` and :data:`MAX_UNPACKED_BYTES`
(a zip bomb stops while it is read, whatever its headers claim). Files are written without
following links, mode 0444 in directories 0555, owned by nymph: any task user can read them and
no task can change the copy the next task runs. Its Python files are then compiled to bytecode
in the background (:func:`_precompile`), so the tasks after the first import the shipped code
without compiling it.

Pruning (:meth:`CodeCache.prune`, after each unpack): archives unused for ``max_age_s`` go, then
the least recently used until the cache is under ``max_bytes``; an archive a running task holds
(:meth:`CodeCache.acquire` / :meth:`CodeCache.release`) is never removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nymph import cachedir
from nymph import observability as obs
from nymph.errors import NymphError

log = logging.getLogger(__name__)

MAX_ENTRIES = 20_000
MAX_FETCH_BYTES = 256 * 1024 * 1024  # an archive fetched by reference larger than this is refused
MAX_UNPACKED_BYTES = 512 * 1024 * 1024
PRECOMPILE_MAX_BYTES = 32 * 1024 * 1024  # Python source compiled to bytecode at unpack, at most
PRECOMPILE_TIMEOUT_S = 600.0  # a compile still running then is killed (the tasks compile from source)
DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0
_STAGING = cachedir.STAGING


class CodeArchiveError(NymphError):
    """An archive nymph will not use (corrupt, unsafe, unfetchable); the message says why."""


Fetch = Callable[[Mapping[str, Any]], bytes]


def _no_fetch(ref: Mapping[str, Any]) -> bytes:
    raise CodeArchiveError(
        "the code archive came by reference (cfg.code.ref) and this cache has no way to fetch it"
    )


_is_sha256 = cachedir.is_sha256


class CodeCache:
    """Archives unpacked under ``root``, one directory per sha256 (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        fetch: Fetch | None = None,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.fetch = fetch or _no_fetch
        self._lock = threading.Lock()
        self._unpacking: dict[str, threading.Lock] = {}
        self._held: dict[str, int] = {}
        self._compiling: dict[str, threading.Thread] = {}  # archives whose bytecode is being written
        self.fetches = 0  # archives fetched and unpacked by this process (the cache's misses)

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256

    def acquire(self, record: Mapping[str, Any], fetch: Fetch | None = None) -> Path:
        """The unpacked directory of ``record`` (``cfg["code"]``), fetched (``fetch``: how a ref's
        bytes are read, else the cache's) and unpacked if new; held until :meth:`release`.
        :class:`CodeArchiveError` when it cannot be used."""
        sha = record.get("sha256") if isinstance(record, Mapping) else None
        if not _is_sha256(sha):
            raise CodeArchiveError(f"cfg.code.sha256 must be 64 lowercase hex digits, got {sha!r}")
        assert isinstance(sha, str)
        with self._lock:
            self._held[sha] = self._held.get(sha, 0) + 1
            gate = self._unpacking.setdefault(sha, threading.Lock())
        try:
            with gate:
                target = self.path_for(sha)
                try:
                    mode = os.stat(target).st_mode
                except FileNotFoundError:
                    mode = 0
                if stat.S_ISDIR(mode):
                    if record.get("inline") is not None:  # cheap to check: a tampered one is refused
                        self._bytes(record, fetch or self.fetch)  # whether the cache has it or not
                    _touch(target)
                    if stat.S_IMODE(mode) != 0o555:  # a compile cut off (nymph killed): again, then sealed
                        self._compile_later(sha, target)
                    obs.CODE_ARCHIVES.labels(result="hit").inc()
                    return target
                data = self._bytes(record, fetch or self.fetch)
                if self._unpack(sha, data, target):
                    self._compile_later(sha, target)
                self.fetches += 1
        except BaseException as exc:
            self.release(sha)
            if isinstance(exc, CodeArchiveError):
                obs.CODE_ARCHIVES.labels(result="refused").inc()
            raise
        obs.CODE_ARCHIVES.labels(result="fetched").inc()
        self.prune()
        return target

    def hold(self, sha256: str) -> bool:
        """Hold an archive already unpacked (a task a restarted nymph re-attached to runs from it);
        False when it is not in the cache. :meth:`release` it as an acquired one."""
        if not _is_sha256(sha256) or not self.path_for(sha256).is_dir():
            return False
        with self._lock:
            self._held[sha256] = self._held.get(sha256, 0) + 1
        return True

    def release(self, sha256: str) -> None:
        with self._lock:
            left = self._held.get(sha256, 0) - 1
            if left > 0:
                self._held[sha256] = left
            else:
                self._held.pop(sha256, None)

    def _bytes(self, record: Mapping[str, Any], fetch: Fetch) -> bytes:
        inline, ref = record.get("inline"), record.get("ref")
        if isinstance(inline, bytes | bytearray | memoryview):
            data = bytes(inline)
        elif ref is not None:
            if not isinstance(ref, Mapping):
                raise CodeArchiveError(f"cfg.code.ref must be a payload ref map, got {type(ref).__name__}")
            data = fetch(ref)
        else:
            raise CodeArchiveError("cfg.code names neither 'inline' bytes nor a 'ref': re-submit the call")
        expected = str(record["sha256"])
        got = hashlib.sha256(data).hexdigest()
        if got != expected:
            raise CodeArchiveError(
                f"code archive: payload corrupt: sha256 mismatch (expected {expected}, got {got})"
            )
        size = record.get("size")
        if isinstance(size, int) and size != len(data):
            raise CodeArchiveError(
                f"code archive {expected}: {len(data)} bytes, but cfg.code.size says {size}"
            )
        return data

    def _unpack(self, sha: str, data: bytes, target: Path) -> bool:
        """Unpack into ``target``; False when another process placed it first."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # traversable by task users, not listable
        staging = Path(self._mkdtemp(sha))
        try:
            _extract(data, staging)
            _seal(staging)
            try:
                os.rename(staging, target)
            except OSError:
                if not target.is_dir():  # not a lost race: a real failure
                    raise
                _remove(staging)  # another process unpacked the same archive first
                return False
        except BaseException:
            if staging.exists():
                _remove(staging)
            raise
        return True

    def _compile_later(self, sha: str, target: Path) -> None:
        """Write the copy's bytecode in the background (:func:`_precompile`, a thread waiting on a
        child process): the task that asked for the archive starts at once (compiling what it
        imports, as before), the later ones import the bytecode. Once per archive at a time."""

        def work() -> None:
            try:
                _precompile(target)
            except Exception:  # the tasks compile what they import, as without it
                log.exception("code archive %s: bytecode not written", sha)
            finally:
                with self._lock:
                    if self._compiling.get(sha) is thread:
                        del self._compiling[sha]

        thread = threading.Thread(target=work, name=f"nymph-code-compile-{sha[:12]}", daemon=True)
        with self._lock:
            if sha in self._compiling:
                return
            self._compiling[sha] = thread
        thread.start()

    def compiled(self, sha256: str, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` for the bytecode of an archive this cache unpacked; True when
        none is being written any more."""
        with self._lock:
            thread = self._compiling.get(sha256)
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _mkdtemp(self, sha: str) -> str:
        import tempfile

        return tempfile.mkdtemp(prefix=f"{_STAGING}{sha[:16]}-", dir=self.root)

    def prune(self, now: float | None = None) -> list[str]:
        """Remove archives unused for ``max_age_s``, then the least recently used over ``max_bytes``;
        never one a task holds (:func:`nymph.cachedir.prune`). Returns the sha256s removed."""
        with self._lock:
            held = set(self._held) | set(self._compiling)
        return cachedir.prune(
            self.root,
            max_age_s=self.max_age_s,
            max_bytes=self.max_bytes,
            held=held,
            what="code cache",
            now=now,
        )


def _check_name(name: str) -> str:
    if (
        not name
        or "\x00" in name
        or "\\" in name
        or name.startswith("/")
        or (len(name) > 1 and name[1] == ":")
    ):
        raise CodeArchiveError(f"code archive refused: entry {name!r} is not a relative path")
    parts = name.rstrip("/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise CodeArchiveError(f"code archive refused: entry {name!r} has an empty, '.' or '..' segment")
    return "/".join(parts)


def _extract(data: bytes, dest: Path) -> None:
    """Unpack ``data`` under ``dest`` after checking every entry (see the module docstring)."""
    import io

    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise CodeArchiveError(f"code archive refused: not a zip ({exc})") from exc
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_ENTRIES:
            raise CodeArchiveError(f"code archive refused: {len(infos)} entries, over {MAX_ENTRIES}")
        for info in infos:
            _check_name(info.filename)
            kind_bits = stat.S_IFMT(info.external_attr >> 16)  # 0: a zip without unix modes
            if kind_bits not in (0, stat.S_IFREG, stat.S_IFDIR):
                kind = "a symbolic link" if kind_bits == stat.S_IFLNK else "not a regular file"
                raise CodeArchiveError(f"code archive refused: entry {info.filename!r} is {kind}")
        written = 0
        dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for info in infos:
                name = _check_name(info.filename)
                parts = name.split("/")
                if info.is_dir():
                    _makedirs(dest_fd, parts)
                    continue
                parent = _makedirs(dest_fd, parts[:-1])
                try:
                    fd = os.open(
                        parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=parent
                    )
                except FileExistsError:
                    raise CodeArchiveError(
                        f"code archive refused: entry {info.filename!r} appears twice"
                    ) from None
                finally:
                    if parent != dest_fd:
                        os.close(parent)
                with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                    while chunk := src.read(1 << 20):
                        written += len(chunk)
                        if written > MAX_UNPACKED_BYTES:
                            raise CodeArchiveError(
                                f"code archive refused: over {MAX_UNPACKED_BYTES} bytes unpacked"
                            )
                        out.write(chunk)
        except (zipfile.BadZipFile, zlib.error) as exc:
            raise CodeArchiveError(f"code archive refused: {exc}") from exc
        finally:
            os.close(dest_fd)


def _makedirs(dest_fd: int, parts: list[str]) -> int:
    """The fd of ``parts`` under ``dest_fd``, created as needed, never through a link."""
    fd = dest_fd
    for part in parts:
        try:
            os.mkdir(part, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
        nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        if fd != dest_fd:
            os.close(fd)
        fd = nxt
    return fd


def _precompile(root: Path, timeout: float = PRECOMPILE_TIMEOUT_S) -> None:
    """Write the bytecode of an unpacked copy's Python files (``__pycache__``, this interpreter's
    tag), then seal it again. No task can write it into the read-only copy, so without it every
    task compiled each shipped module it imports from source, every time (a 60-module package:
    about 85 ms a task here). A task on another Python ignores it; a file that does not compile
    is left to fail at its import, as before. The directories are nymph's to write meanwhile, as
    before the seal, and no task user's; what is written appears whole (written aside, renamed).

    The compile runs in a child process (``python -I -m compileall``): compiling a module holds
    the interpreter lock until it is done, seconds for a large generated one, and nymph's
    heartbeat and loop must not wait on that; ``-I`` leaves out nymph's ``PYTHONPYCACHEPREFIX``
    (the bytecode would go elsewhere) and ``PYTHONOPTIMIZE``; the bytecode is checked by the
    source's mtime even where ``SOURCE_DATE_EPOCH`` is set (else each import hashes the source).
    Skipped over :data:`PRECOMPILE_MAX_BYTES` of source; killed after ``timeout``."""
    import subprocess
    import sys

    total = 0
    for here, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                try:
                    total += os.lstat(os.path.join(here, name)).st_size
                except OSError:
                    pass
    if total > PRECOMPILE_MAX_BYTES:
        log.info("code archive %s: %d bytes of Python source, not precompiled", root.name, total)
    try:  # with nothing to compile, only sealed (again: a seal cut off is finished here)
        if 0 < total <= PRECOMPILE_MAX_BYTES:
            for here, _dirs, _files in os.walk(root):
                os.chmod(here, 0o755)
            run = subprocess.run(
                [
                    sys.executable,
                    "-I",
                    "-m",
                    "compileall",
                    "-q",
                    "--invalidation-mode",
                    "timestamp",
                    str(root),
                ],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
            )
            if run.returncode:  # a file that does not compile: its import fails in the task, as before
                log.debug("code archive %s: not all compiled:\n%s", root.name, run.stdout[-2000:])
    except subprocess.TimeoutExpired:
        log.warning("code archive %s: bytecode not written in %.0f s, left out", root.name, timeout)
    except OSError as exc:
        log.warning("code archive %s: bytecode not written: %s", root.name, exc)
    finally:
        try:
            _seal(root)
        except OSError as exc:
            log.warning("code archive %s: not sealed again: %s", root.name, exc)


_seal = cachedir.seal
_touch = cachedir.touch
_size = cachedir.tree_size
_remove = cachedir.remove


def shipped_modules(path: Path) -> list[str]:
    """Every module an unpacked archive makes importable (``pkg``, ``pkg.sub``, ``tool``), sorted:
    what ``--allow-module`` must allow before the archive goes on a task's import path."""
    import importlib.machinery

    suffixes = tuple(importlib.machinery.all_suffixes())
    found = set()
    for here, _dirs, files in os.walk(path):
        rel = Path(here).relative_to(path).parts
        for name in files:
            suffix = next((s for s in suffixes if name.endswith(s)), None)
            if suffix is None:
                continue
            if suffix in importlib.machinery.BYTECODE_SUFFIXES and "." in name[: -len(suffix)]:
                continue  # __pycache__/mod.cpython-311.pyc: the bytecode of mod.py, no module of its own
            stem = name[: -len(suffix)].partition(".")[0]  # mod.cpython-311-x86_64-linux-gnu.so -> mod
            found.add(".".join(rel if stem == "__init__" else (*rel, stem)))
    return sorted(m for m in found if m)


def code_env(dirs: list[Path]) -> dict[str, str]:
    """The task's ``LAKESHORE_CODE_PATH`` for the unpacked archives ``dirs`` (nymph's paths; a
    container runner rewrites it to where it mounts them); empty when nothing shipped."""
    from dreamlake.lakeshore.daemon.entry import CODE_PATH_ENV

    return {CODE_PATH_ENV: os.pathsep.join(str(d) for d in dirs)} if dirs else {}


_SHARED: dict[Path, CodeCache] = {}
_SHARED_LOCK = threading.Lock()


def shared(
    root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S
) -> CodeCache:
    """The one cache of this process for ``root`` (every job of a nymph shares it: one fetch per sha256)."""
    key = Path(os.path.abspath(root))
    with _SHARED_LOCK:
        cache = _SHARED.get(key)
        if cache is None:
            cache = _SHARED[key] = CodeCache(key, max_bytes=max_bytes, max_age_s=max_age_s)
        else:
            cache.max_bytes, cache.max_age_s = max_bytes, max_age_s
        return cache
