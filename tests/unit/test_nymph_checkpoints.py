"""nymph's checkpoint packing (nymph/checkpoints.py) against a task that plants links: nymph runs
as root and the task owns ``checkpoint/``, so whatever nymph packs there the task reads back in its
next attempt. A link (to a file or a directory, planted before the save or swapped in for a
directory while nymph walks the tree) and a file nymph's task does not own are never carried."""

from __future__ import annotations

import io
import logging
import os
import tarfile
from pathlib import Path
from typing import BinaryIO

import pytest

from dreamlake.lakeshore.protocol.limits import ServerLimits
from nymph import checkpoints


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("root's secret")
    workdir = tmp_path / "work"
    (workdir / "checkpoint" / "sub").mkdir(parents=True)
    (workdir / "checkpoint" / "state.bin").write_bytes(b"step 7")
    (workdir / "checkpoint" / "sub" / "secret").write_text("the task's own")
    return workdir, outside


def _packed(workdir: Path, limit: int = 1 << 20) -> dict[str, bytes | None]:
    buf = io.BytesIO()
    assert checkpoints._pack_tree(workdir, buf, limit) is not None
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        return {
            m.name: (tar.extractfile(m).read() if m.isfile() else None)  # type: ignore[union-attr]
            for m in tar.getmembers()
        }


def test_the_tasks_files_and_directories_are_carried(tmp_path: Path) -> None:
    workdir, _ = _tree(tmp_path)
    assert _packed(workdir) == {"state.bin": b"step 7", "sub": None, "sub/secret": b"the task's own"}
    assert checkpoints._pack_tree(workdir, io.BytesIO(), 5) is None  # over the limit: not carried


def test_planted_links_are_not_followed(tmp_path: Path) -> None:
    workdir, outside = _tree(tmp_path)
    root = workdir / "checkpoint"
    (root / "file-link").symlink_to(outside / "secret")
    (root / "dir-link").symlink_to(outside)
    os.mkfifo(root / "fifo")
    assert _packed(workdir) == {"state.bin": b"step 7", "sub": None, "sub/secret": b"the task's own"}


def test_a_directory_swapped_for_a_link_during_the_save_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task replaces ``checkpoint/sub`` by a link to a directory it cannot read right after
    nymph listed ``checkpoint/``: a walk by path would then read ``outside/secret`` as root."""
    workdir, outside = _tree(tmp_path)
    root = workdir / "checkpoint"
    listing = checkpoints._listing

    def swap_after_listing(dfd: int) -> list[str]:
        names = listing(dfd)
        if "sub" in names and (root / "sub").is_dir() and not (root / "sub").is_symlink():
            (root / "sub" / "secret").unlink()
            (root / "sub").rmdir()
            (root / "sub").symlink_to(outside)
        return names

    monkeypatch.setattr(checkpoints, "_listing", swap_after_listing)
    packed = _packed(workdir)
    assert packed == {"state.bin": b"step 7"}
    assert b"root's secret" not in b"".join(v or b"" for v in packed.values())


def test_checkpoint_itself_as_a_link_carries_nothing(tmp_path: Path) -> None:
    workdir, outside = _tree(tmp_path)
    os.rename(workdir / "checkpoint", tmp_path / "moved")
    (workdir / "checkpoint").symlink_to(outside)
    with pytest.raises(OSError):
        checkpoints._pack_tree(workdir, io.BytesIO(), 1 << 20)
    assert not checkpoints.save(
        None, workdir, invocation_id="x", attempt=1, worker_id="w", namespace="default", max_bytes=1 << 20
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_file_the_task_does_not_own_is_not_carried(tmp_path: Path) -> None:
    """The workdir and its checkpoint belong to the task's user; a file of a third user found there
    (a hard link to something the task cannot read) is left out."""
    workdir, _ = _tree(tmp_path)
    task_uid, other_uid = 61234, 61235
    for dirpath, dirnames, filenames in os.walk(workdir):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), task_uid, task_uid)
    os.lchown(workdir, task_uid, task_uid)
    foreign = workdir / "checkpoint" / "foreign"
    foreign.write_text("someone else's")
    os.chown(foreign, other_uid, other_uid)
    assert "foreign" not in _packed(workdir)
    assert "state.bin" in _packed(workdir)


class _Client:
    """A control-plane client whose register answer said ``max_payload_bytes``; records uploads."""

    def __init__(self, max_payload_bytes: int) -> None:
        self.limits = ServerLimits(max_payload_bytes=max_payload_bytes)
        self.recorded: list[dict[str, object]] = []

    def checkpoint(self, body: dict[str, object]) -> None:
        self.recorded.append(body)


@pytest.mark.parametrize(
    ("checkpoint_max", "plane_max", "carried", "raise_what"),
    [
        (
            1 << 20,
            16 << 10,
            False,
            "raise MAX_PAYLOAD_BYTES on the control plane",
        ),  # 1 GiB vs 100 MiB, scaled
        (16 << 10, 1 << 20, False, "checkpoint_max_mb (0.015625 MiB) is the limit: raise it"),
        (1 << 20, 40_000, False, "MAX_PAYLOAD_BYTES"),  # its files fit; the tar (headers, padding) does not
        (1 << 20, 10 << 20, True, None),
    ],
)
def test_a_checkpoint_is_carried_up_to_the_smaller_of_the_two_limits_and_a_skip_says_what_to_raise(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    checkpoint_max: int,
    plane_max: int,
    carried: bool,
    raise_what: str | None,
) -> None:
    """The control plane refuses an upload over its MAX_PAYLOAD_BYTES (100 MiB by default), which
    its register answer says; nymph's checkpoint_max_mb defaults to 1 GiB. A checkpoint between the
    two used to be packed and then dropped at the upload."""
    workdir, _ = _tree(tmp_path)
    (workdir / "checkpoint" / "weights").write_bytes(b"w" * 39_000)  # 39 KB of files, ~42 KB of tar
    shipped: list[int] = []

    def ship(
        client: object, namespace: str, invocation_id: str, data: BinaryIO, kind: str
    ) -> dict[str, object]:
        shipped.append(data.seek(0, os.SEEK_END))
        return {"key": "k"}

    monkeypatch.setattr(checkpoints.refs, "ship", ship)
    client = _Client(plane_max)
    with caplog.at_level(logging.WARNING, logger="nymph.checkpoints"):
        got = checkpoints.save(
            client,  # type: ignore[arg-type]
            workdir,
            invocation_id="x",
            attempt=1,
            worker_id="w",
            namespace="default",
            max_bytes=checkpoint_max,
        )
    assert got is carried and bool(shipped) is carried and bool(client.recorded) is carried
    if carried:
        assert shipped[0] <= min(checkpoint_max, plane_max)
    else:
        (line,) = [r.getMessage() for r in caplog.records]
        assert "checkpoint not carried" in line and str(raise_what) in line, line
