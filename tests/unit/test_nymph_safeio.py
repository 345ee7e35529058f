"""nymph.safeio: nymph's reads and writes in a directory the task's user owns follow no link."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from nymph import safeio
from nymph.cgroup import TaskCgroups, cgroup2_mount, own_cgroup
from nymph.cli import strip_token


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    victim = tmp_path / "outside"
    victim.write_text("untouched")
    return victim


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def test_write_file_replaces_a_planted_symlink_and_never_writes_through_it(
    workdir: Path, outside: Path
) -> None:
    (workdir / "pump.json").symlink_to(outside)
    (workdir / "pump.json.tmp").symlink_to(outside)  # the temporary name nymph once used
    safeio.write_file(workdir, "pump.json", b"{}")
    assert outside.read_text() == "untouched"
    st = (workdir / "pump.json").lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert (workdir / "pump.json").read_bytes() == b"{}"
    assert sorted(p.name for p in workdir.iterdir()) == ["pump.json", "pump.json.tmp"]  # no temporary left


def test_write_file_replaces_a_planted_hard_link_without_touching_its_other_name(
    workdir: Path, outside: Path
) -> None:
    os.link(outside, workdir / "outcome.json")
    safeio.write_file(workdir, "outcome.json", b"{}")
    assert outside.read_text() == "untouched" and outside.stat().st_nlink == 1


def test_create_new_writes_in_place_with_its_modes_and_never_through_an_existing_name(
    workdir: Path, outside: Path
) -> None:
    old = os.umask(0o077)
    try:
        safeio.create_new(workdir, [("args.msgpack", b"\x90", 0o600), ("stdout.log", b"", 0o644)])
    finally:
        os.umask(old)
    assert (workdir / "args.msgpack").read_bytes() == b"\x90"
    assert stat.S_IMODE((workdir / "stdout.log").stat().st_mode) == 0o644  # not narrowed by the umask
    assert sorted(p.name for p in workdir.iterdir()) == ["args.msgpack", "stdout.log"]  # no temporary
    (workdir / "stderr.log").symlink_to(outside)
    with pytest.raises(FileExistsError):
        safeio.create_new(workdir, [("stderr.log", b"planted", 0o644)])
    assert outside.read_text() == "untouched"


def test_read_own_refuses_links_fifos_and_hard_links(workdir: Path, outside: Path) -> None:
    (workdir / "handle.json").symlink_to(outside)
    os.mkfifo(workdir / "invocation.json")
    os.link(outside, workdir / "outcome.json")
    safeio.write_file(workdir, "pump.json", b"ok")
    assert safeio.read_own(workdir, "handle.json") is None
    assert safeio.read_own(workdir, "invocation.json") is None  # a FIFO: refused, never blocks
    assert safeio.read_own(workdir, "missing.json") is None
    assert safeio.read_own(workdir, "pump.json") == b"ok"
    if os.geteuid() == 0:  # as root, the workdir is the task user's: a hard link is not nymph's own
        os.chown(workdir, 65534, 65534)
        assert safeio.read_own(workdir, "outcome.json") is None
        assert safeio.read_own(workdir, "pump.json") == b"ok"


def test_open_output_reads_the_tasks_files_only(workdir: Path, outside: Path) -> None:
    (workdir / "result.msgpack").symlink_to(outside)
    assert safeio.open_output(workdir, "result.msgpack") is None
    (workdir / "error.json").write_text("{}")
    assert safeio.read_output(workdir, "error.json") == b"{}"
    if os.geteuid() == 0:  # a file of neither the task's user nor nymph's
        os.chown(workdir, 65534, 65534)
        (workdir / "stderr.log").write_text("root's")
        os.chown(workdir / "stderr.log", 1, 1)
        assert safeio.read_output(workdir, "stderr.log") is None
        os.chown(workdir / "stderr.log", 65534, 65534)  # the task's: read
        assert safeio.read_output(workdir, "stderr.log") == b"root's"


def test_open_append_refuses_a_planted_symlink(workdir: Path, outside: Path) -> None:
    (workdir / "stdout.log").symlink_to(outside)
    with pytest.raises(safeio.UnsafeFile):
        safeio.open_append(workdir, "stdout.log")
    fd = safeio.open_append(workdir, "stderr.log")
    os.write(fd, b"x")
    os.close(fd)
    assert (workdir / "stderr.log").read_bytes() == b"x" and outside.read_text() == "untouched"


def test_a_fifo_never_blocks_a_read(workdir: Path) -> None:
    os.mkfifo(workdir / "frames.msgpack")
    done = threading.Event()

    def read() -> None:
        safeio.open_output(workdir, "frames.msgpack")
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(10.0)  # a plain open() would wait for a writer for ever


def test_cgroup2_mount_and_own_cgroup_are_read_from_proc(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "24 30 0:21 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        "30 24 0:26 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n"
    )
    assert cgroup2_mount(mountinfo) == Path("/sys/fs/cgroup/unified")
    mountinfo.write_text("24 30 0:21 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    assert cgroup2_mount(mountinfo) is None  # cgroup v1 only
    self_cgroup = tmp_path / "cgroup"
    self_cgroup.write_text("4:memory:/x\n0::/system.slice/nymph.service\n")
    assert own_cgroup(self_cgroup) == "/system.slice/nymph.service"
    self_cgroup.write_text("4:memory:/x\n")
    assert own_cgroup(self_cgroup) is None


def test_task_cgroups_only_take_task_names_under_their_base(tmp_path: Path) -> None:
    tree = TaskCgroups(tmp_path / "nymph-tasks")
    assert tree.path("nymph-01h-a1") == tmp_path / "nymph-tasks" / "nymph-01h-a1"
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(OSError):
            tree.path(bad)
    assert tree.owns(tmp_path / "nymph-tasks" / "nymph-01h-a1")
    assert not tree.owns(tmp_path / "elsewhere" / "nymph-01h-a1")


def test_strip_token_removes_the_token_and_nothing_else() -> None:
    argv = [
        "/py",
        "-m",
        "nymph",
        "start",
        "--token",
        "s3cret",
        "--queue",
        "q",
        "--token=other",
        "--",
        "--token",
    ]
    assert strip_token(argv) == ["/py", "-m", "nymph", "start", "--queue", "q", "--", "--token"]


def test_reads_give_the_whole_file_its_tail_or_its_head(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000  # past one read's chunk
    (tmp_path / "result.msgpack").write_bytes(data)
    assert safeio.read_output(tmp_path, "result.msgpack") == data
    assert safeio.read_output(tmp_path, "result.msgpack", tail=300) == data[-300:]
    assert safeio.read_output(tmp_path, "result.msgpack", tail=len(data) * 2) == data
    assert safeio.read_own(tmp_path, "result.msgpack", limit=10) == data[:10]
    (tmp_path / "empty.log").touch()
    assert safeio.read_output(tmp_path, "empty.log") == b""
    assert safeio.read_output(tmp_path, "absent.log") is None


def test_try_remove_removes_an_empty_task_cgroup_and_leaves_a_busy_one(tmp_path: Path) -> None:
    mount, own = cgroup2_mount(), own_cgroup()
    if mount is None or own is None:
        pytest.skip("no cgroup v2 here")
    base = mount / own.lstrip("/") / "nymph-tasks"
    try:
        tree = TaskCgroups(base)
        path = tree.create(f"nymph-test-try-remove-{os.getpid()}")
    except OSError as exc:
        pytest.skip(f"cannot create task cgroups here: {exc}")
    proc = subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec sleep 30', str(path)])
    try:
        deadline = time.monotonic() + 10
        while not tree.populated(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tree.populated(path)
        assert tree.try_remove(path) is False and path.exists()  # busy: left for the kill
    finally:
        proc.kill()
        proc.wait()
    assert tree.wait_empty(path, 10.0)
    assert tree.try_remove(path) is True and not path.exists()
    assert tree.try_remove(path) is True  # gone already: fine
