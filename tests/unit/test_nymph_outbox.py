"""The durable outbox and the client's retry rule, faked at the httpx transport seam."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

import nymph.outbox as outbox_mod
from dreamlake.lakeshore.errors import AuthError, BadRequest, Conflict, NotFound, Unavailable
from nymph.client import ControlPlaneClient, is_retryable
from nymph.outbox import HOLD_S, Outbox
from tests.stack.wait import until
from tests.unit.outbox_kit import FakePlane


@pytest.mark.parametrize(
    ("status", "error", "retryable"),
    [
        (500, Unavailable, True),
        (503, Unavailable, True),
        (429, Unavailable, True),
        (401, AuthError, False),
        (403, AuthError, False),
        (409, Conflict, False),
        (404, NotFound, False),
        (400, BadRequest, False),
    ],
)
def test_client_classifies_statuses(status: int, error: type[Exception], retryable: bool) -> None:
    plane = FakePlane([status])
    with pytest.raises(error) as info:
        plane.client().ack({"invocation_id": "x"})
    assert is_retryable(info.value) is retryable
    assert f"status {status}" in str(info.value)


def test_connection_error_is_transient_and_chained() -> None:
    plane = FakePlane()
    plane.down.set()
    with pytest.raises(Unavailable) as info:
        plane.client().heartbeat({})
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def _ack(n: int) -> dict[str, Any]:
    return {"invocation_id": f"inv{n}", "state": "succeeded", "result_blob": b"r", "attempt": 1}


def test_messages_are_on_disk_before_sending_and_survive_a_restart(tmp_path: Path) -> None:
    plane = FakePlane()
    plane.down.set()
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)
    box.start()
    box.chunk({"invocation_id": "inv1", "seq": 0, "bytes": b"f", "final": True})
    box.ack(_ack(1))
    assert len(list((tmp_path / "outbox").glob("*.msg"))) == 2
    assert not box.flush(0.3)  # the control plane is down: nothing is lost, nothing confirmed
    box.stop()
    assert len(list((tmp_path / "outbox").glob("*.msg"))) == 2

    plane.down.clear()
    again = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)  # "restart": replay from disk
    assert again.pending_for("inv1")
    again.start()
    assert again.flush(10.0)
    again.stop()
    assert [route for route, _ in plane.received] == ["/v1/daemon/result-chunk", "/v1/daemon/ack"]
    assert plane.received[1][1]["result_blob"] == b"r"
    assert list((tmp_path / "outbox").glob("*.msg")) == []


def test_transient_failures_are_retried_in_order(tmp_path: Path) -> None:
    plane = FakePlane([503, 500, 429])
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)
    box.start()
    for n in range(3):
        box.ack(_ack(n))
    assert box.flush(10.0)
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv0", "inv1", "inv2"]


def test_a_refused_token_holds_the_acks_until_a_good_one_not_drops_them(tmp_path: Path) -> None:
    """A 401 refuses nymph's token (revoked, expired, a rotation half done), not the ack: the ack
    stays on disk and goes once the token is good again. It was taken for a final refusal (401 is a
    ``Refused``) and dropped: every outcome sent meanwhile was lost. A 403 (another worker holds
    the call's lease) is the ack's own refusal and is still dropped."""

    def delivered(statuses: list[int], acks: list[int]) -> list[str]:
        plane = FakePlane(statuses)
        box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)
        box.start()
        for n in acks:
            box.ack(_ack(n))
        assert box.flush(10.0)
        box.stop()
        return [body["invocation_id"] for _, body in plane.received]

    assert delivered([401, 401, 401], [0, 1]) == ["inv0", "inv1"]
    assert delivered([403], [2, 3]) == ["inv3"]


def test_final_refusals_are_dropped_not_retried(tmp_path: Path) -> None:
    plane = FakePlane([409, 404])
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)
    box.start()
    box.ack(_ack(0))
    box.ack(_ack(1))
    box.ack(_ack(2))
    assert box.flush(10.0)
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv2"]
    assert list((tmp_path / "outbox").glob("*.msg")) == []


def test_a_message_that_cannot_be_sent_is_moved_aside_and_later_ones_still_go(tmp_path: Path) -> None:
    # Before the fix an exception outside PlaneError (here a bug in the transport) killed the
    # sender thread: every later ack stayed on disk until a restart, which died the same way.
    plane = FakePlane()

    def handler(request: httpx.Request) -> httpx.Response:
        if msgpack.unpackb(request.content).get("invocation_id") == "poison":
            raise ValueError("boom")
        return plane(request)

    client = ControlPlaneClient("http://cp", "tok", transport=httpx.MockTransport(handler))
    box = Outbox(tmp_path, client, max_backoff_s=0.05)
    box.start()
    box.ack({**_ack(0), "invocation_id": "poison"})
    box.ack(_ack(1))
    assert box.flush(10.0)
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv1"]
    assert len(list((tmp_path / "outbox").glob("*.bad"))) == 1


def test_a_route_that_is_not_a_url_is_a_final_refusal() -> None:
    client = ControlPlaneClient("http://cp", "tok", transport=httpx.MockTransport(FakePlane()))
    with pytest.raises(BadRequest):
        client.call("/v1/namespaces/a\x00b/jobs/x/result", {})


def test_pending_for_counts_the_message_being_sent(tmp_path: Path) -> None:
    sending = threading.Event()
    release = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        sending.set()
        release.wait(10.0)
        return FakePlane()(request)

    client = ControlPlaneClient("http://cp", "tok", transport=httpx.MockTransport(handler))
    box = Outbox(tmp_path, client, max_backoff_s=0.05)
    box.start()
    box.ack(_ack(7))
    assert sending.wait(10.0)
    assert box.pending_for("inv7") and box.pending() == 1
    release.set()
    assert box.flush(10.0)
    box.stop()
    assert not box.pending_for("inv7")


# --- acks on the poll (the poller takes them; see nymph/outbox.py) ---------------------------------


def test_a_poll_takes_acks_at_the_head_of_their_lanes_and_the_sender_leaves_them_alone(
    tmp_path: Path,
) -> None:
    plane = FakePlane()
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)  # not started: no sender yet
    box.chunk({"invocation_id": "inv1", "seq": 0, "bytes": b"f", "final": True})
    box.ack(_ack(1))  # behind its lane's chunk: not the poll's to take
    box.ack(_ack(2))
    box.ack({**_ack(3), "worker_id": "an-earlier-worker"})  # another worker id's: goes its own way
    riding = box.take_acks("me", 64)
    assert [m.body["invocation_id"] for m in riding] == ["inv2"]
    assert box.take_acks("me", 64) == []  # taken once
    box.start()
    until(lambda: len(plane.received) >= 3, "the sender to send inv1's chunk and ack, and inv3's ack", 10.0)
    box.wake()  # one more pass of the sender, which must leave the riding ack alone
    until(lambda: box.pending() == 1, "the sender to settle all but the riding ack", 10.0)
    sent = [(route, body["invocation_id"]) for route, body in plane.received]
    assert sorted(sent) == [
        ("/v1/daemon/ack", "inv1"),
        ("/v1/daemon/ack", "inv3"),
        ("/v1/daemon/result-chunk", "inv1"),
    ]
    assert sent.index(("/v1/daemon/result-chunk", "inv1")) < sent.index(("/v1/daemon/ack", "inv1"))
    assert box.pending_for("inv2")  # still on disk while the poll carries it
    assert len(list((tmp_path / "outbox").glob("*.msg"))) == 1

    box.acks_answered(riding, [{"invocation_id": "inv2", "status": 200, "ok": True}])
    assert box.flush(5.0)
    box.stop()
    assert list((tmp_path / "outbox").glob("*.msg")) == []
    assert ("/v1/daemon/ack", "inv2") not in [(r, b["invocation_id"]) for r, b in plane.received]


@pytest.mark.parametrize(
    ("answers", "sent_again"),
    [
        (None, True),  # the poll failed: the sender sends it
        ([], True),  # no answer for it
        ([{"invocation_id": "inv0", "status": 500, "ok": False, "error": "store"}], True),
        ([{"invocation_id": "inv0", "status": 409, "ok": False, "error": "superseded"}], False),
        ([{"invocation_id": "inv0", "status": 200, "ok": True, "duplicate": True}], False),
    ],
)
def test_an_ack_a_poll_did_not_settle_goes_back_to_the_sender(
    tmp_path: Path, answers: list[dict[str, Any]] | None, sent_again: bool
) -> None:
    plane = FakePlane()
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)
    box.ack(_ack(0))
    riding = box.take_acks("me", 64)
    assert len(riding) == 1
    box.acks_answered(riding, answers)
    assert box.take_acks("me", 64) == []  # settled, or the sender's now: no poll takes it again
    box.start()
    assert box.flush(10.0)
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == (["inv0"] if sent_again else [])
    assert list((tmp_path / "outbox").glob("*.msg")) == []


def test_an_ack_put_while_a_poll_is_imminent_waits_for_it_briefly_then_goes_by_itself(
    tmp_path: Path,
) -> None:
    plane = FakePlane()
    soon = threading.Event()
    soon.set()
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05, poll_imminent=soon.is_set)
    box.start()
    box.ack(_ack(0))  # held for the poll
    riding = box.take_acks("me", 64)
    assert [m.body["invocation_id"] for m in riding] == ["inv0"]
    time.sleep(HOLD_S * 2)
    assert plane.received == []  # riding: the sender left it alone, past the hold too
    box.acks_answered(riding, [{"invocation_id": "inv0", "status": 200, "ok": True}])

    box.ack(_ack(1))  # held too, but no poll comes: the sender takes it once the hold is over
    began = time.monotonic()
    assert box.flush(5.0)
    waited = time.monotonic() - began
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv1"]
    assert waited < 0.5  # woken when the hold ended, not by the sender's 1 s idle wait

    soon.clear()
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05, poll_imminent=soon.is_set)
    box.start()
    box.ack(_ack(2))  # no poll imminent: not held, the sender's at once
    assert box._held == {}
    assert box.flush(5.0)
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv1", "inv2"]


def _stray_outbox(tmp_path: Path) -> Path:
    """An outbox with one good ack (inv1, written by put) beside every kind of file that is not a
    message nymph wrote; returns the outbox directory."""
    Outbox(tmp_path, FakePlane().client()).ack(_ack(1))  # not started: the ack stays on disk
    box = tmp_path / "outbox"
    good = next(box.glob("*.msg")).read_bytes()
    for name in ("junk.msg", "a.b.msg", "12345.msg", "abc-def.msg", "-x.msg", ".msg"):
        (box / name).write_bytes(good)  # a good body under a name put never writes
    (box / "junk.bad").write_bytes(b"an earlier one")  # never overwritten by a later one
    (box / "00000000000000000001-dir.msg").mkdir()
    (box / "00000000000000000002-link.msg").symlink_to(next(box.glob("0*-inv*.msg")))
    (box / ".#00000000000000000003-lock.msg").symlink_to("nowhere")  # an editor's lock (dangling)
    os.mkfifo(box / "00000000000000000004-fifo.msg")  # read the ordinary way, it hangs the start-up
    (box / "00000000000000000005-unreadable.msg").write_bytes(good)  # open refused (see the test)
    (box / "00000000000000000006-trunc.msg").write_bytes(good[: len(good) // 2])
    (box / "00000000000000000007-garbage.msg").write_bytes(b"\xc1\xc1 not msgpack")
    (box / "00000000000000000008-list.msg").write_bytes(msgpack.packb(["route", "body"]))
    (box / "00000000000000000009-nobody.msg").write_bytes(msgpack.packb({"route": "/v1/daemon/ack"}))
    (box / "00000000000000000010-x.msg.tmp").mkdir()  # a temporary name that cannot be unlinked
    return box


def test_stray_and_corrupt_files_are_moved_aside_and_the_good_message_is_still_delivered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the fix a ``*.msg`` name put never writes (``junk.msg``) raised ValueError out of the
    replay, so nymph could not start at all; a FIFO hung it, and a file that could not be moved
    aside (a directory over a directory) raised too."""
    box = _stray_outbox(tmp_path)
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith("-unreadable.msg"):  # EACCES, as a non-root nymph meets a 000 file
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    plane = FakePlane()
    caplog.set_level(logging.INFO, logger="nymph.outbox")
    again = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)
    monkeypatch.undo()
    assert again.pending() == 1
    again.start()
    assert again.flush(10.0)
    again.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv1"]
    assert sorted(p.name for p in box.glob("*.msg")) == []  # none left to retry at the next start
    bad = {p.name for p in box.glob("*.bad")}
    numbered = ("dir", "link", "", "fifo", "unreadable", "trunc", "garbage", "list", "nobody")
    stems = [f"{n + 1:020d}-{what}" for n, what in enumerate(numbered) if what]
    for stem in ("a.b", "12345", "abc-def", "-x", ".#00000000000000000003-lock", *stems):
        assert f"{stem}.bad" in bad, bad
    assert ".msg.bad" in bad and "00000000000000000010-x.msg.bad" in bad
    assert list(box.glob("*.tmp")) == []
    assert (box / "junk.bad").read_bytes() == b"an earlier one"
    assert len([n for n in bad if n.startswith("junk.") and n != "junk.bad"]) == 1
    aside = [r.getMessage() for r in caplog.records if "moved aside to" in r.getMessage()]
    assert len(aside) == 16 and all("look at it, then delete it" in m for m in aside), aside
    assert any("trunc.msg is corrupt" in m and "00000000000000000006-trunc.bad" in m for m in aside)

    caplog.clear()  # moved aside: the next start neither reads them nor logs them again
    Outbox(tmp_path, plane.client()).stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or "moved aside" in r.getMessage()]


@pytest.mark.parametrize(
    ("where", "code"),
    [("write", errno.EIO), ("open", errno.EROFS), ("open", errno.EACCES), ("rename", errno.EIO)],
)
def test_a_write_that_fails_other_than_disk_full_keeps_the_message_in_memory_and_delivers_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
    code: int,
) -> None:
    """Before the fix only ENOSPC/EDQUOT were kept in memory: EIO, EROFS or EACCES left put as a
    raw OSError, so the caller's ack was lost (and the job's thread failed)."""
    full: list[BaseException] = []
    plane = FakePlane()
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05, on_full=full.append)
    failure = OSError(code, os.strerror(code))

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise failure

    if where == "write":
        monkeypatch.setattr(outbox_mod, "write_all", fail)
    elif where == "rename":
        monkeypatch.setattr(outbox_mod.os, "replace", fail)
    else:
        real_open = os.open

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if str(path).endswith(".tmp"):
                raise failure
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(outbox_mod.os, "open", open_)
    box.ack(_ack(1))  # raised OSError before the fix
    monkeypatch.undo()
    assert list((tmp_path / "outbox").iterdir()) == []  # no partial file, no temporary file
    assert full == []  # not a full disk: claims are not paused for it
    lines = [r.getMessage() for r in caplog.records if "kept in memory, not on disk" in r.getMessage()]
    assert len(lines) == 1 and os.strerror(code) in lines[0] and "check that filesystem" in lines[0]
    box.ack(_ack(2))  # the state dir works again: durable as before
    assert len(list((tmp_path / "outbox").glob("*.msg"))) == 1
    box.start()
    assert box.flush(10.0)
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv1", "inv2"]
    assert list((tmp_path / "outbox").iterdir()) == []


def test_a_full_disk_still_tells_on_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full: list[BaseException] = []
    plane = FakePlane()
    box = Outbox(tmp_path, plane.client(), max_backoff_s=0.05, on_full=full.append)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outbox_mod, "write_all", fail)
    box.ack(_ack(1))
    monkeypatch.undo()
    assert len(full) == 1 and list((tmp_path / "outbox").iterdir()) == []
    box.start()
    assert box.flush(10.0)
    box.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv1"]


def test_files_set_aside_are_kept_within_bounds_at_each_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A poison message that recurs is set aside each time: the ``.bad`` files stay for a look, but
    each start deletes the oldest past ``BAD_KEEP`` and those older than ``BAD_MAX_AGE_S``;
    directories are not touched, and a good message beside them is still sent."""
    Outbox(tmp_path, FakePlane().client()).ack(_ack(1))  # not started: the ack stays on disk
    box = tmp_path / "outbox"
    now = time.time()
    names = [f"{n:020d}-poison.bad" for n in range(outbox_mod.BAD_KEEP + 6)]
    for n, name in enumerate(names):  # the later the name, the newer
        (box / name).write_bytes(b"x")
        os.utime(box / name, (now - 3600 + n, now - 3600 + n))
    old = box / "00000000000000009999-ancient.bad"
    old.write_bytes(b"x")
    os.utime(old, (now - outbox_mod.BAD_MAX_AGE_S - 60,) * 2)
    (box / "kept-dir.bad").mkdir()
    plane = FakePlane()
    caplog.set_level(logging.WARNING, logger="nymph.outbox")
    again = Outbox(tmp_path, plane.client(), max_backoff_s=0.05)
    left = sorted(p.name for p in box.glob("*.bad") if p.is_file())
    assert left == names[6:]  # the newest BAD_KEEP; the ancient one too is gone
    assert (box / "kept-dir.bad").is_dir()
    assert any("deleted 7 file(s) set aside" in r.getMessage() for r in caplog.records), caplog.text
    again.start()
    assert again.flush(10.0)
    again.stop()
    assert [body["invocation_id"] for _, body in plane.received] == ["inv1"]
