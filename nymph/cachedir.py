"""What nymph's content-addressed caches share: sealed directories, removal, pruning by age and size.

Two caches keep one directory per sha256 under a root: the code archives calls ship
(:mod:`nymph.codecache`) and the pip environments calls ask for (:mod:`nymph.envcache`). Both
build an entry in a staging directory (``.staging-…``) beside it and rename it into place, so a
reader sees a whole entry or none; both seal it (:func:`seal`: files 0444, directories 0555,
readable by any task user, written by none); both mark a use by its mtime (:func:`touch`) and
:func:`prune` what is unused for ``max_age_s``, then the least recently used while the entries
take more than ``max_bytes``, never one a running task holds. A removal renames the entry aside
first (:func:`remove`), so one cut off leaves a staging directory (pruned after an hour), never a
partial tree under a sha256 that would pass for a hit.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path

log = logging.getLogger(__name__)

STAGING = ".staging-"
STALE_STAGING_S = 3600.0


def is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def seal(root: Path) -> None:
    """Files 0444 (0555 when executable) and directories 0555: readable by any task user, written by
    none. Bottom up, so the top directory is sealed last: a seal cut off leaves it writable, which
    the next use sees. Links are left as they are (never followed)."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(here, name)
            st = os.lstat(path)
            if os.path.islink(path):
                continue
            os.chmod(path, 0o555 if st.st_mode & 0o100 else 0o444, follow_symlinks=False)
        os.chmod(here, 0o555)


def touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # read-only: the age rule then counts from the unpack
        pass


def tree_size(path: Path) -> int:
    total = 0
    for here, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(here, name)).st_size
            except OSError:
                pass
    return total


def remove(path: Path) -> None:
    """Remove an entry (or a staging directory): renamed aside first (see the module docstring)."""
    if not path.name.startswith(STAGING):
        aside = path.with_name(f"{STAGING}{path.name[:16]}-removed-{os.urandom(6).hex()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        except OSError:
            pass  # removed in place, as before
        else:
            path = aside
    for here, dirs, _ in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(here, name), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):  # a link to a directory (Linux cannot chmod a
                pass  # link itself): left as it is, removed as a link, never followed
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def prune(
    root: Path,
    *,
    max_age_s: float,
    max_bytes: int,
    held: Collection[str],
    what: str,
    is_entry: Callable[[str], bool] = is_sha256,
    now: float | None = None,
) -> list[str]:
    """Remove the entries of ``root`` unused for ``max_age_s``, then the least recently used while
    they take more than ``max_bytes``; never one named in ``held``. Stale staging directories go
    too. Returns the names removed (``what`` names the cache in the log line)."""
    now = time.time() if now is None else now
    try:
        entries = [p for p in root.iterdir() if is_entry(p.name) and p.is_dir()]
    except OSError:
        return []
    aged: list[tuple[float, int, Path]] = []
    for path in entries:
        try:
            used = path.stat().st_mtime
        except OSError:
            continue
        aged.append((used, tree_size(path), path))
    aged.sort()
    total = sum(size for _, size, _ in aged)
    removed = []
    for used, size, path in aged:
        if path.name in held:
            continue
        if now - used > max_age_s or total > max_bytes:
            remove(path)
            total -= size
            removed.append(path.name)
    for stale in root.glob(STAGING + "*"):  # a staging directory left by a crash
        try:
            if now - stale.stat().st_mtime > STALE_STAGING_S:
                remove(stale)
        except OSError:
            pass
    if removed:
        log.info(
            "%s: pruned %d entr%s from %s", what, len(removed), "y" if len(removed) == 1 else "ies", root
        )
    return removed
