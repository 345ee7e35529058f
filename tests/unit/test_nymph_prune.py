"""Pruning the workdir root (issue 12, item 7): kept failed workdirs by age and by total size,
oldest first, and ``*.old-*`` directories; never a running job's workdir or an unsettled one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dreamlake.lakeshore import ids
from nymph import workdir as wd
from nymph.prune import prune

NOW = time.time()


def _failed(root: Path, age_s: float, size: int = 100) -> Path:
    path = root / ids.new_ulid()
    path.mkdir()
    (path / wd.STDERR).write_bytes(b"e" * size)
    (path / wd.OUTCOME).write_text(json.dumps({"state": "failed", "error": {"type": "E", "message": "m"}}))
    os.utime(path / wd.OUTCOME, (NOW - age_s, NOW - age_s))
    return path


def test_failed_workdirs_older_than_keep_s_go_younger_stay(tmp_path: Path) -> None:
    old, young = _failed(tmp_path, 7200), _failed(tmp_path, 10)
    running = tmp_path / ids.new_ulid()  # no outcome.json: a job runs in it, or reconcile owns it
    running.mkdir()
    out = prune(tmp_path, keep_s=3600, keep_bytes=2**30, now=NOW)
    assert (out.aged, out.oversize) == (1, 0)
    assert not old.exists() and young.exists() and running.exists()


def test_beyond_keep_bytes_the_oldest_go_first(tmp_path: Path) -> None:
    dirs = [_failed(tmp_path, 100 - i, size=10_000) for i in range(5)]  # dirs[0] is the oldest
    out = prune(tmp_path, keep_s=3600, keep_bytes=25_000, now=NOW)
    assert out.oversize == 3
    assert [d.exists() for d in dirs] == [False, False, False, True, True]


def test_busy_workdirs_are_never_pruned(tmp_path: Path) -> None:
    busy = _failed(tmp_path, 7200)
    out = prune(tmp_path, keep_s=1, keep_bytes=0, busy={busy.name}, now=NOW)
    assert out.total == 0 and busy.exists()


def test_old_attempt_directories_are_removed_and_nothing_else(tmp_path: Path) -> None:
    inv = ids.new_ulid()
    old = tmp_path / f"{inv}{wd.OLD_MARK}{int(NOW)}"
    old.mkdir()
    (old / "stdout.log").write_text("x")
    stranger = tmp_path / "not-ours.old-1"
    stranger.mkdir()
    kept = prune(tmp_path, keep_s=3600, keep_bytes=2**30, old_dirs=False, now=NOW)
    assert kept.old == 0 and old.exists()
    out = prune(tmp_path, keep_s=3600, keep_bytes=2**30, now=NOW)
    assert out.old == 1 and not old.exists() and stranger.exists()
