"""Pruning the workdir root: kept failed workdirs by age and total size, and ``*.old-*`` leftovers.

A failed (or killed, timed-out) invocation keeps its workdir, with its logs, for whoever wants to
look (:func:`nymph.workdir.mark_settled` writes ``outcome.json`` there). Without a bound those pile
up until the disk is full, so :func:`prune` removes them:

- by age: a settled workdir whose ``outcome.json`` is older than ``keep_s`` (``keep_failed_s``,
  default 7 days);
- by size: while the settled workdirs together take more than ``keep_bytes`` (``keep_failed_mb``,
  default 1024 MiB), the oldest first;
- ``{invocation_id}.old-{time}`` directories (an earlier attempt's workdir, moved aside when a
  newer attempt of the same invocation arrived here) once the previous life was reconciled: by
  then nothing runs in them (a newer attempt starts only after the older one is gone).

Only settled workdirs and ``.old-`` directories are touched, never one of a job running here
(``busy``): a workdir without ``outcome.json`` belongs to a running job or is reconciled at start.
The agent runs it once after reconciling, then from its main loop every :data:`PRUNE_EVERY_S` (or
twice per ``keep_failed_s`` when that is shorter) and soon after a job kept its workdir.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from dreamlake.lakeshore import ids
from nymph import workdir as wd

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 60.0


@dataclass
class Pruned:
    """What one pass removed: counts and bytes."""

    aged: int = 0
    oversize: int = 0
    old: int = 0
    bytes: int = 0

    @property
    def total(self) -> int:
        return self.aged + self.oversize + self.old


def tree_bytes(path: Path) -> int:
    """Bytes the files under ``path`` take (links not followed; unreadable parts count 0)."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def _settled_at(path: Path) -> float | None:
    """When the workdir was settled (``outcome.json``'s mtime); None when it is not settled."""
    if not wd.is_settled(path):
        return None
    try:
        return (path / wd.OUTCOME).lstat().st_mtime
    except OSError:
        return None


def _old_dirs(root: Path) -> list[Path]:
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    out = []
    for p in entries:
        name, sep, stamp = p.name.partition(wd.OLD_MARK)
        if sep and ids.is_ulid(name) and stamp.isdigit() and p.is_dir() and not p.is_symlink():
            out.append(p)
    return sorted(out)


def prune(
    root: Path,
    *,
    keep_s: float,
    keep_bytes: int,
    busy: Collection[str] = (),
    old_dirs: bool = True,
    now: float | None = None,
) -> Pruned:
    """One pass over ``root`` (see the module docstring); never raises."""
    now = time.time() if now is None else now
    out = Pruned()
    settled: list[tuple[float, Path, int]] = []
    for path in wd.leftovers(root):
        if path.name in busy:
            continue
        at = _settled_at(path)
        if at is None:
            continue
        size = tree_bytes(path)
        if now - at > keep_s:
            wd.remove(path)
            out.aged += 1
            out.bytes += size
        else:
            settled.append((at, path, size))
    total = sum(size for _, _, size in settled)
    for _, path, size in sorted(settled, key=lambda item: item[0]):
        if total <= keep_bytes:
            break
        wd.remove(path)
        total -= size
        out.oversize += 1
        out.bytes += size
    if old_dirs:
        for path in _old_dirs(root):
            if path.name.partition(wd.OLD_MARK)[0] in busy:
                continue
            size = tree_bytes(path)
            wd.remove(path)
            out.old += 1
            out.bytes += size
    if out.total:
        log.info(
            "pruned %d workdir(s) under %s (%.1f MiB): %d failed older than %gs, %d beyond %.0f MiB "
            "of failed workdirs, %d earlier attempts' (.old-)",
            out.total, root, out.bytes / 2**20, out.aged, keep_s, out.oversize, keep_bytes / 2**20, out.old,
        )  # fmt: skip
    return out
