"""nymph wakes a thread only when it has something to do: a call with no output needs no pass of the
outbox's sender before its ack can ride a poll, the watcher hears only the files a stream reads (not
the task's entry lock, nor a log closed with nothing written), and free space is not looked at again
on every poll while there is room."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore import wire
from nymph import health
from nymph import watcher as watcher_module
from nymph.health import DiskHealth
from nymph.outbox import Outbox
from nymph.pump import Pump
from nymph.sdnotify import SdNotify
from nymph.watcher import Watcher
from tests.stack.procs import busy_descriptors
from tests.stack.wait import until
from tests.unit.outbox_kit import FakePlane


def _ack(invocation_id: str) -> dict[str, Any]:
    return {"invocation_id": invocation_id, "attempt": 1, "worker_id": "me", "state": "succeeded"}


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for name in ("stdout.log", "stderr.log"):
        (work / name).touch()
    return work


def test_a_call_with_no_output_lets_its_ack_ride_the_next_poll_with_no_sender_pass(tmp_path: Path) -> None:
    """The stream of a call that wrote nothing closes in the job's own thread: no sender runs here
    (the outbox is not started), yet the ack is at the head of its lane for the poll to carry."""
    box = Outbox(tmp_path / "state", FakePlane().client())
    try:
        stream = Pump(_workdir(tmp_path), "inv1", 1, box, worker_id="me")
        stream.start()
        stream.stop()
        assert stream.drain(lambda: False, patience_s=1.0)
        stream.halt()
        box.ack(_ack("inv1"))
        assert [m.body["invocation_id"] for m in box.take_acks("me", 64)] == ["inv1"]
    finally:
        box.stop()


def test_a_stream_with_output_still_waits_for_its_frames_before_the_ack(tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    (work / "stdout.log").write_text("hello\n")  # written before the stream opened (the task starts first)
    plane = FakePlane()
    box = Outbox(tmp_path / "state", plane.client(), max_backoff_s=0.05)
    try:
        stream = Pump(work, "inv1", 1, box, worker_id="me")
        stream.start()
        stream.stop()
        box.ack(_ack("inv1"))
        assert box.take_acks("me", 64) == []  # behind its stream's frames
        box.start()
        assert stream.drain(lambda: False, patience_s=10.0)
        stream.halt()
        assert box.flush(10.0)
        routes = [route for route, _ in plane.received]
        assert routes == ["/v1/daemon/result-chunks", "/v1/daemon/ack"], routes
    finally:
        box.stop()


@pytest.mark.parametrize("busy", [False, True], ids=["few-fds", "fds-past-1023"])
def test_the_watcher_hears_writes_to_a_streams_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    """Busy: the watcher made by a nymph holding over a thousand descriptors (its inotify and wake
    descriptors past 1023, which ``select.select`` refused: the watcher's thread ended unheard)."""
    monkeypatch.setattr(watcher_module, "TICK_S", 600.0)  # no safety tick inside the test
    (tmp_path / "stdout.log").touch()  # nymph creates the logs before the task starts
    heard = threading.Event()
    with busy_descriptors() if busy else contextlib.nullcontext():
        watcher = Watcher()
    assert not busy or min(watcher._wake_r, watcher._fd) > 1023
    if not watcher.inotify:
        watcher.close()
        pytest.skip("no inotify here: the watcher polls every workdir")
    try:
        watcher.add(tmp_path, heard.set, names=("stdout.log", "frames.msgpack"))
        fd = os.open(tmp_path / ".entry.lock", os.O_RDWR | os.O_CREAT, 0o600)  # the task's own file
        os.write(fd, b'{"pid": 1}')
        os.close(fd)
        (tmp_path / ".result.msgpack.1.tmp").write_bytes(b"\xc0")
        # opened and closed with nothing written (as the task's exit closes its logs)
        os.close(os.open(tmp_path / "stdout.log", os.O_WRONLY | os.O_APPEND))
        assert not heard.wait(0.5)
        with open(tmp_path / "stdout.log", "ab") as fh:
            fh.write(b"x")
        assert heard.wait(5.0)
        heard.clear()
        (tmp_path / "frames.tmp").write_bytes(b"f")
        os.replace(tmp_path / "frames.tmp", tmp_path / "frames.msgpack")  # renamed into place
        assert heard.wait(5.0)
    finally:
        watcher.close()


def test_free_space_is_not_looked_at_again_right_after_a_check_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks: list[Path] = []

    def free(path: Path) -> int:
        looks.append(path)
        return 2**40

    monkeypatch.setattr(health, "free_bytes", free)
    disk = DiskHealth([tmp_path / "a", tmp_path / "b"], 2**20, SdNotify())
    assert disk.check() and disk.check() and disk.check()
    assert len(looks) == 2  # one look at each filesystem
    disk.full(OSError(errno.ENOSPC, "No space left on device"))  # a write met a full disk meanwhile
    assert not disk.ok.is_set()
    assert disk.check() and len(looks) == 4  # looked again, found room: claims resume
    disk.min_free_bytes = 2**41  # a new floor is checked at once
    assert not disk.check() and len(looks) == 6
    time.sleep(health.DISK_RECHECK_S)
    disk.min_free_bytes = 0
    assert disk.check() and len(looks) == 8


def test_job_threads_reuse_an_idle_thread_and_never_make_a_body_wait() -> None:
    from nymph.lifecycle import JobThreads

    threads = JobThreads(idle_s=0.3)
    seen: list[int] = []
    done = threading.Semaphore(0)

    def body() -> None:
        seen.append(threading.get_ident())
        done.release()

    for _ in range(20):  # one after another: the same thread each time
        threads.run(body, "nymph-invocation-x")
        assert done.acquire(timeout=5)
    assert len(set(seen)) == 1

    release = threading.Event()
    started = threading.Semaphore(0)

    def blocker() -> None:
        started.release()
        release.wait(10)

    for _ in range(5):  # bodies that block: each gets a thread of its own at once
        threads.run(blocker, "nymph-invocation-y")
    for _ in range(5):
        assert started.acquire(timeout=5)
    threads.run(body, "nymph-invocation-z")  # and one more still runs while all five block
    assert done.acquire(timeout=5)
    before = threading.active_count()
    release.set()
    until(lambda: threading.active_count() <= before - 5, "the idle threads to end (idle_s 0.3)", 10.0)


def test_a_check_that_began_before_a_write_met_a_full_disk_does_not_clear_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskHealth([tmp_path], 0, SdNotify())

    def free(path: Path) -> int:  # the job thread's write fails while the poller's check looks
        disk.full(OSError(errno.ENOSPC, "No space left on device"))
        return 2**40

    monkeypatch.setattr(health, "free_bytes", free)
    assert disk.check() is False
    assert not disk.ok.is_set() and "No space left on device" in (disk.problem or "")
    monkeypatch.setattr(health, "free_bytes", lambda path: 2**40)
    assert disk.check() is True and disk.ok.is_set()  # the next look finds room: claims resume


def test_a_final_frame_after_a_sender_pass_let_go_of_a_done_looking_stream_is_still_streamed(
    tmp_path: Path,
) -> None:
    """A script that wrote nothing: after stop() its stream looks done; a pass of the sender in
    that moment (a watcher tick, another lane's write) lets go of it; the END frame finish() then
    adds goes on the stream anyway, not only through a spill once the drain's patience ran out."""
    plane = FakePlane()
    box = Outbox(tmp_path / "state", plane.client(), max_backoff_s=0.05)
    box.start()
    try:
        stream = Pump(_workdir(tmp_path), "inv1", 1, box, worker_id="me", script=True)
        stream.start()
        stream.stop()
        box.wake()
        until(lambda: "inv1" not in box._lanes, "a pass of the sender to let go of the stream", 10.0)
        stream.finish(wire.FRAME_END, wire.pack({"exit_code": 0}))
        assert stream.drain(lambda: False, patience_s=1.0)
        assert [route for route, _ in plane.received] == ["/v1/daemon/result-chunks"]
    finally:
        box.stop()
