"""nymph's side of the workdir contract, the gates before spawning, and the journal pump."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.daemon.entry_outputs import RESULT_DIGEST_FILE, result_digest
from dreamlake.lakeshore.envelope import Envelope, fn_for
from dreamlake.lakeshore.errors import InvalidId
from dreamlake.lakeshore.store import retry
from nymph import outputcheck
from nymph import workdir as wd
from nymph.config import resolve
from nymph.job import GateRefused, Job, JobContext
from nymph.outbox import Outbox
from nymph.pump import Pump
from nymph.runner import Capabilities, ExitStatus
from nymph.slots import Slots
from tests import nymph_fns


@pytest.mark.parametrize("bad", ["../../etc", "/abs", "01ARZ3NDEKTSV4RRFFQ69G5FA/", "", "x" * 26])
def test_ids_are_validated_before_they_become_paths(tmp_path: Path, bad: str) -> None:
    with pytest.raises(InvalidId):
        wd.create(tmp_path, bad, b"", {}, None)
    assert list(tmp_path.iterdir()) == []


def test_workdir_is_private_and_holds_args_verbatim(tmp_path: Path) -> None:
    inv = ids.new_ulid()
    path = wd.create(tmp_path, inv, b"\x81\xa1v\x01", {"attempt": 2}, None)
    assert path == tmp_path / inv
    assert path.stat().st_mode & 0o777 == 0o700
    assert (path / "args.msgpack").read_bytes() == b"\x81\xa1v\x01"
    assert wd.read_meta(path) == {"attempt": 2}


def test_outcome_reading_follows_the_seed(tmp_path: Path) -> None:
    (tmp_path / "result.msgpack").write_bytes(wire.pack([1, 2]))
    ok = wd.read_outcome(tmp_path, ExitStatus(0))
    assert ok.state == "succeeded" and wire.unpack(ok.result_blob) == [1, 2]

    err = {"type": "KeyError", "message": "'k'", "traceback": "Traceback ..."}
    (tmp_path / "error.json").write_text(json.dumps(err))
    failed = wd.read_outcome(tmp_path, ExitStatus(1))
    assert failed.state == "failed" and failed.error == err

    (tmp_path / "error.json").unlink()
    crashed = wd.read_outcome(tmp_path, ExitStatus(-9, "signal 9"))
    assert crashed.error is not None and crashed.error["type"] == "ProcessExited"
    assert "signal 9" in crashed.error["message"]

    script = wd.read_outcome(tmp_path, ExitStatus(0), script=True)
    assert wire.unpack(script.result_blob) == {"exit_code": 0}


_GOOD = wire.pack({"rows": [1, 2.5, "x" * 40, b"\0" * 300], "t": (1, None, True)})


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (_GOOD[:-7], "truncated"),
        (_GOOD[:1], "truncated"),
        (b"", "empty"),
        (b"\xc1" + _GOOD, "not msgpack"),
        (_GOOD + b"\x00junk", "garbage after"),
    ],
)
@pytest.mark.parametrize("status", [ExitStatus(0), None])  # None: collected after a restart
@pytest.mark.parametrize("big", [None, 16])  # in memory, or over the inline threshold: left on disk
def test_a_damaged_result_is_a_retryable_failure_never_a_success(
    tmp_path: Path, data: bytes, says: str, status: ExitStatus | None, big: int | None
) -> None:
    (tmp_path / "result.msgpack").write_bytes(data)
    out = wd.read_outcome(tmp_path, status, big=big)
    assert out.state == "failed" and out.error is not None, out
    assert out.error["type"] == "DamagedOutput"
    assert "result.msgpack is damaged" in out.error["message"] and says in out.error["message"], out
    assert retry.delay({}, out.state, out.error, 1, 3) is not None  # the control plane retries it


@pytest.mark.parametrize("big", [None, 16])
def test_a_sound_result_passes_the_check_in_memory_and_on_disk(tmp_path: Path, big: int | None) -> None:
    (tmp_path / "result.msgpack").write_bytes(_GOOD)
    out = wd.read_outcome(tmp_path, ExitStatus(0), big=big)
    assert out.state == "succeeded", out
    if big is None:
        assert wire.unpack(out.result_blob) == wire.unpack(_GOOD)
    else:
        assert out.extra == {"result_file": "result.msgpack", "result_size": len(_GOOD)}


_VALUES = wire.pack({"name": "caf\u00e9 au lait", "count": 1234567, "pad": b"\0" * 40})


def _flipped(data: bytes, inside: bytes, new: bytes) -> bytes:
    """``data`` with the byte at the first ``inside``'s first byte replaced by ``new``."""
    at = data.index(inside)
    return data[:at] + new + data[at + 1 :]


# one byte changed inside a value, the msgpack structure untouched: a string no longer UTF-8, an
# int's digit (1234567 is a uint32 0x0012d687: its low byte), a byte of a bin
_FLIPS = {
    "str-utf8": _flipped(_VALUES, "\u00e9".encode(), b"\xff"),
    "int": _flipped(_VALUES, (1234567).to_bytes(4, "big"), b"\x01"),
    "bin": _flipped(_VALUES, b"\0" * 40, b"\x01"),
}


@pytest.mark.parametrize("flip", sorted(_FLIPS))
@pytest.mark.parametrize("status", [ExitStatus(0), None])  # None: collected after a restart
@pytest.mark.parametrize("big", [None, 16])  # in memory, or over the inline threshold: left on disk
def test_a_byte_changed_inside_a_value_after_the_entry_wrote_it_is_damaged_never_a_success(
    tmp_path: Path, flip: str, status: ExitStatus | None, big: int | None
) -> None:
    damaged = _FLIPS[flip]
    assert damaged != _VALUES and len(damaged) == len(_VALUES)
    assert outputcheck.result_damage(damaged) is None  # the structure alone cannot tell
    (tmp_path / RESULT_DIGEST_FILE).write_bytes(result_digest(_VALUES))  # what the entry wrote
    (tmp_path / "result.msgpack").write_bytes(damaged)  # what nymph finds
    out = wd.read_outcome(tmp_path, status, big=big)
    assert out.state == "failed" and out.result_blob == b"" and "result_file" not in out.extra, out
    assert out.error is not None and out.error["type"] == "DamagedOutput", out
    message = out.error["message"]
    assert "result.msgpack is damaged" in message and "do not match the blake2b-256 digest" in message
    assert "changed between the entry writing it and nymph reading it" in message, message
    assert retry.delay({}, out.state, out.error, 1, 3) is not None  # retried, as a crash is

    (tmp_path / "result.msgpack").write_bytes(_VALUES)  # the bytes the entry wrote: a success
    ok = wd.read_outcome(tmp_path, status, big=big)
    assert ok.state == "succeeded", ok


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (b"", "digest record (result.digest) is damaged"),
        (result_digest(_VALUES).replace(b"blake2b", b"blake2c"), "digest record (result.digest) is damaged"),
        (result_digest(_VALUES)[:-3] + b"9\n", "not the 9 the entry wrote"),
        (result_digest(_VALUES) * 2, "digest record (result.digest) is damaged"),
    ],
)
@pytest.mark.parametrize("big", [None, 16])
def test_a_damaged_digest_record_is_damage_too_never_an_unchecked_success(
    tmp_path: Path, record: bytes, says: str, big: int | None
) -> None:
    (tmp_path / RESULT_DIGEST_FILE).write_bytes(record)
    (tmp_path / "result.msgpack").write_bytes(_VALUES)
    out = wd.read_outcome(tmp_path, ExitStatus(0), big=big)
    assert out.state == "failed" and out.error is not None and out.error["type"] == "DamagedOutput", out
    assert says in out.error["message"], out


@pytest.mark.parametrize("big", [None, 16])
def test_a_result_without_a_digest_from_an_older_entry_is_still_accepted(
    tmp_path: Path, big: int | None
) -> None:
    # an entry from before result.digest leaves the result alone: nymph cannot tell which entry its
    # runner ran, so the structural check is all there is, as it was
    (tmp_path / "result.msgpack").write_bytes(_VALUES)
    out = wd.read_outcome(tmp_path, ExitStatus(0), big=big)
    assert out.state == "succeeded", out
    if big is None:
        assert out.result_blob == _VALUES
    (tmp_path / "result.msgpack").write_bytes(_VALUES[:-3])  # and its structural damage still counts
    damaged = wd.read_outcome(tmp_path, ExitStatus(0), big=big)
    assert damaged.error is not None and damaged.error["type"] == "DamagedOutput", damaged


@pytest.mark.parametrize(
    ("data", "says"),
    [(b'{"type": "KeyErr', "not JSON"), (b"\xff\xfe", "not JSON"), (b"[1]", "not an error object")],
)
def test_a_damaged_error_json_is_named_not_taken_for_a_missing_one(
    tmp_path: Path, data: bytes, says: str
) -> None:
    (tmp_path / "error.json").write_bytes(data)
    out = wd.read_outcome(tmp_path, ExitStatus(1))
    assert out.error is not None and out.error["type"] == "DamagedOutput", out
    assert "error.json is damaged" in out.error["message"] and says in out.error["message"], out
    assert "left no error.json" not in out.error["message"]
    assert retry.delay({}, out.state, out.error, 1, 3) is not None


class _Caps:
    name = "fake"

    def __init__(self, **caps: bool) -> None:
        self.capabilities = Capabilities(**caps)


def _job(tmp_path: Path, body: dict[str, Any], **cfg: Any) -> Job:
    flags = {"server": "http://x", "token": "t", "workdir": tmp_path, "allow_root_tasks": True, **cfg}
    config = resolve(flags, {})
    outbox = Outbox.__new__(Outbox)  # the gates never touch the outbox
    ctx = JobContext(config, _Caps(as_user=False), outbox, Slots(1), ids.new_ulid())  # type: ignore[arg-type]
    return Job(ctx, ids.new_ulid(), 1, body)


def _ref() -> bytes:
    return Envelope.create(fn_for(nymph_fns.add, "ref"), (1,)).to_bytes()


@pytest.mark.parametrize(
    ("body", "cfg", "refusal"),
    [
        ({"args_blob": Envelope.create(fn_for(lambda: 1, "pickle")).to_bytes()}, {}, "PickleRefused"),
        ({"args_blob": b"not an envelope"}, {}, "EnvelopeError"),
        ({"args_blob": _ref(), "as_user": "mallory"}, {"allow_users": ("alice",)}, "UserNotAllowed"),
        ({"args_blob": _ref(), "as_user": "alice"}, {"allow_users": ("alice",)}, "RunnerCapabilityMissing"),
        ({"args_blob": _ref(), "run_config": {"resources": {"gpus": 1}}}, {}, "RunnerCapabilityMissing"),
        ({"args_blob": _ref(), "run_config": {"image": "python:3.11"}}, {}, "RunnerCapabilityMissing"),
    ],
)
def test_gates_refuse_before_anything_is_spawned(
    tmp_path: Path, body: dict[str, Any], cfg: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(GateRefused) as info:
        _job(tmp_path, body, **cfg)._gates()
    assert info.value.type == refusal


def test_gates_pass_a_pickled_function_when_allowed(tmp_path: Path) -> None:
    body = {"args_blob": Envelope.create(fn_for(lambda: 1, "pickle")).to_bytes()}
    _job(tmp_path, body, allow_pickled=True)._gates()


class _Recorder:
    """The outbox as a pump sees it, recording what :func:`_deliver` confirms."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []

    def wake(self) -> None:
        pass

    def open_stream(self, pump: Pump, *, wake: bool = True) -> None:
        pass

    def close_stream(self, pump: Pump) -> None:
        pass

    def note_undelivered(self, nbytes: int) -> None:
        pass


def _deliver(pump: Pump, out: _Recorder) -> int:
    """What the outbox's sender does: take batches, "post" them, confirm; returns how many frames."""
    sent = 0
    while (batch := pump.take()) is not None:
        for data in batch.frames:
            frame = wire.decode_frame(data)
            out.chunks.append({"seq": frame.seq, "bytes": data, "final": frame.final})
        sent += len(batch.frames)
        pump.confirm(batch)
    return sent


def test_pump_forwards_complete_frames_in_order_and_resumes_after_restart(tmp_path: Path) -> None:
    journal = tmp_path / "frames.msgpack"
    f0 = wire.encode_frame(wire.FRAME_VALUE, 0, wire.pack("a"), {"ts": 1.0})
    f1 = wire.encode_frame(wire.FRAME_VALUE, 1, wire.pack("b"), {"ts": 2.0})
    f2 = wire.encode_frame(wire.FRAME_END, 2, wire.pack(None), {"ts": 3.0})
    journal.write_bytes(f0 + f1[:3])  # a partial frame at the tail waits
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out)  # type: ignore[arg-type]
    assert _deliver(pump, out) == 1
    with open(journal, "ab") as fh:
        fh.write(f1[3:])
    assert _deliver(pump, out) == 1
    assert [c["bytes"] for c in out.chunks] == [f0, f1]
    assert [c["final"] for c in out.chunks] == [False, False]
    assert (tmp_path / "frames.delivered").read_text().split() == ["1", str(len(f0 + f1))]

    with open(journal, "ab") as fh:
        fh.write(f2)
    again = _Recorder()
    restarted = Pump(tmp_path, "inv", 1, again)  # type: ignore[arg-type]
    assert _deliver(restarted, again) == 0  # the final frame waits for the task's end (and output)
    restarted.stop()
    assert _deliver(restarted, again) == 1  # only what was not delivered before
    assert again.chunks[0]["seq"] == 2 and again.chunks[0]["final"] is True
    assert restarted.done


def test_pump_batches_what_built_up_and_adds_the_final_frame(tmp_path: Path) -> None:
    from nymph.flow import StreamLimits

    frames = [wire.encode_frame(wire.FRAME_VALUE, i, wire.pack(i), None) for i in range(7)]
    (tmp_path / "frames.msgpack").write_bytes(b"".join(frames))
    limits = StreamLimits(batch_frames=3, window_bytes=1024, max_bytes=4096)
    pump = Pump(tmp_path, "inv", 1, _Recorder(), limits=limits)  # type: ignore[arg-type]
    first = pump.take()
    assert first is not None and first.frames == frames[:3]
    assert pump.take() is first  # the same batch until it is confirmed
    pump.confirm(first)
    assert pump.undelivered() == (4, len(b"".join(frames[3:])))
    pump.finish(wire.FRAME_ERROR, {"type": "Cancelled", "message": "m"})  # no final in the journal
    out = _Recorder()
    assert _deliver(pump, out) == 5
    assert [c["seq"] for c in out.chunks] == [3, 4, 5, 6, 7]
    assert wire.decode_frame(out.chunks[-1]["bytes"]).kind == wire.FRAME_ERROR
    assert pump.done and pump.drain(lambda: False)


def test_script_pump_turns_output_into_log_frames(tmp_path: Path) -> None:
    (tmp_path / "stdout.log").write_bytes(b"hello\n")
    (tmp_path / "stderr.log").write_bytes(b"warn\n")
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out, script=True)  # type: ignore[arg-type]
    assert _deliver(pump, out) == 2
    pump.finish(wire.FRAME_END, wire.pack({"exit_code": 0}))
    assert _deliver(pump, out) == 1
    frames = [wire.decode_frame(c["bytes"]) for c in out.chunks]
    assert [(f.kind, f.seq, f.body, (f.meta or {}).get("stream")) for f in frames[:2]] == [
        (wire.FRAME_LOG, 0, b"hello\n", "stdout"),
        (wire.FRAME_LOG, 1, b"warn\n", "stderr"),
    ]
    assert frames[2].kind == wire.FRAME_END and out.chunks[2]["final"] is True


def _decoded(out: _Recorder) -> list[wire.Frame]:
    return [wire.decode_frame(c["bytes"]) for c in out.chunks]


def test_python_output_and_journal_share_one_seq_space(tmp_path: Path) -> None:
    """A Python invocation's prints become LOG frames beside its values: one run of seqs for the
    control plane, the journal's frames renumbered, ``frames.delivered`` still in the entry's seqs."""
    journal = tmp_path / "frames.msgpack"
    (tmp_path / "stdout.log").write_bytes(b"starting\n")
    (tmp_path / "stderr.log").write_bytes(b"")
    f0 = wire.encode_frame(wire.FRAME_VALUE, 0, wire.pack("a"), {"ts": 1.0})
    journal.write_bytes(f0)
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out)  # type: ignore[arg-type]
    assert _deliver(pump, out) == 2
    with open(tmp_path / "stderr.log", "ab") as fh:
        fh.write(b"careful\n")
    f1 = wire.encode_frame(wire.FRAME_VALUE, 1, wire.pack("b"), {"ts": 2.0})
    f2 = wire.encode_frame(wire.FRAME_END, 2, wire.pack("done"), {"ts": 3.0})
    with open(journal, "ab") as fh:
        fh.write(f1 + f2)
    assert _deliver(pump, out) == 2  # the END waits: the task has not ended
    assert (tmp_path / "frames.delivered").read_text().split() == ["1", str(len(f0 + f1))]
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"bye\n")  # written after the END frame, before the process exited
    pump.stop()
    assert _deliver(pump, out) == 2
    frames = _decoded(out)
    assert [f.seq for f in frames] == list(range(6))
    assert [(f.kind, f.body if f.kind == wire.FRAME_LOG else wire.unpack(f.body)) for f in frames] == [  # type: ignore[arg-type]
        (wire.FRAME_LOG, b"starting\n"),
        (wire.FRAME_VALUE, "a"),
        (wire.FRAME_LOG, b"careful\n"),
        (wire.FRAME_VALUE, "b"),
        (wire.FRAME_LOG, b"bye\n"),
        (wire.FRAME_END, "done"),
    ]
    assert [(f.meta or {}).get("stream") for f in frames if f.kind == wire.FRAME_LOG] == [
        "stdout",
        "stderr",
        "stdout",
    ]
    assert frames[1].meta == {"ts": 1.0}  # the journal frame's own meta, unchanged
    assert out.chunks[-1]["final"] is True and pump.done

    # a restarted nymph resumes both files and the numbering where delivery stood
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"late\n")
    again = _Recorder()
    restarted = Pump(tmp_path, "inv", 1, again)  # type: ignore[arg-type]
    restarted.stop()
    assert _deliver(restarted, again) == 0  # the stream was closed by END: nothing after it


def test_a_restarted_pump_keeps_the_numbering(tmp_path: Path) -> None:
    journal = tmp_path / "frames.msgpack"
    (tmp_path / "stdout.log").write_bytes(b"one\n")
    (tmp_path / "stderr.log").write_bytes(b"")
    f0 = wire.encode_frame(wire.FRAME_VALUE, 0, wire.pack(0), None)
    journal.write_bytes(f0)
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out)  # type: ignore[arg-type]
    assert _deliver(pump, out) == 2
    pump.halt()  # nymph goes away
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"two\n")
    f1 = wire.encode_frame(wire.FRAME_VALUE, 1, wire.pack(1), None)
    with open(journal, "ab") as fh:
        fh.write(f1 + wire.encode_frame(wire.FRAME_END, 2, wire.pack(None), None))
    again = _Recorder()
    restarted = Pump(tmp_path, "inv", 1, again)  # type: ignore[arg-type]
    restarted.stop()
    assert _deliver(restarted, again) == 3
    frames = _decoded(again)
    assert [(f.seq, f.kind) for f in frames] == [
        (2, wire.FRAME_LOG),
        (3, wire.FRAME_VALUE),
        (4, wire.FRAME_END),
    ]
    assert frames[0].body == b"two\n" and wire.unpack(frames[1].body) == 1  # type: ignore[arg-type]


def _settled(workdir: Path) -> None:
    """Make the logs' last write a second old (a partial line that recent would wait for its end)."""
    past = time.time() - 1
    for name in ("stdout.log", "stderr.log"):
        os.utime(workdir / name, (past, past))


def test_a_line_written_in_two_writes_goes_as_one_frame(tmp_path: Path) -> None:
    (tmp_path / "stdout.log").write_bytes(b"first\nstep 5 of 12")  # the newline is not written yet
    (tmp_path / "stderr.log").write_bytes(b"")
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out, script=True)  # type: ignore[arg-type]
    assert _deliver(pump, out) == 1  # the whole line; the partial one waits for its newline
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"\nprogress 10%")
    assert _deliver(pump, out) == 1
    _settled(tmp_path)  # a partial line nothing completes goes after a moment
    assert _deliver(pump, out) == 1
    assert [wire.decode_frame(c["bytes"]).body for c in out.chunks] == [
        b"first\n",
        b"step 5 of 12\n",
        b"progress 10%",
    ]


def test_output_past_the_cap_is_cut_with_one_line_and_the_task_runs_on(tmp_path: Path) -> None:
    from nymph.flow import StreamLimits

    (tmp_path / "stdout.log").write_bytes(b"x" * 700)
    (tmp_path / "stderr.log").write_bytes(b"")
    _settled(tmp_path)
    limits = StreamLimits(log_max_bytes=1000, window_bytes=1024, max_bytes=4096)
    overflowed: list[str] = []
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out, script=True, limits=limits, on_overflow=overflowed.append)  # type: ignore[arg-type]
    assert _deliver(pump, out) == 1
    with open(tmp_path / "stderr.log", "ab") as fh:
        fh.write(b"y" * 500)
    _settled(tmp_path)
    assert _deliver(pump, out) == 2  # 300 bytes fit, then the line that says the rest is cut
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"z" * 100_000)  # far past every limit: skipped, never an overflow
    pump.take()
    assert _deliver(pump, out) == 0 and overflowed == []
    frames = _decoded(out)
    assert [len(f.body) for f in frames[:2]] == [700, 300]  # type: ignore[arg-type]
    note = frames[2]
    assert note.kind == wire.FRAME_LOG and (note.meta or {}).get("truncated") is True
    assert (note.meta or {}).get("stream") == "stderr"
    assert b"output truncated" in note.body and b"log_max_bytes=1000" in note.body  # type: ignore[operator]
    pump.finish(wire.FRAME_END, wire.pack({"exit_code": 0}))
    assert _deliver(pump, out) == 1 and pump.done
    assert [f.seq for f in _decoded(out)] == [0, 1, 2, 3]


def test_a_flood_of_output_never_starves_the_values(tmp_path: Path) -> None:
    """While journal frames wait, output takes at most half of each batch."""
    from nymph.flow import StreamLimits

    (tmp_path / "stdout.log").write_bytes(b"line\n" * 200_000)  # 1 MB of prints, 16 reads of it
    (tmp_path / "stderr.log").write_bytes(b"")
    values = [wire.encode_frame(wire.FRAME_VALUE, i, wire.pack(i), None) for i in range(3)]
    (tmp_path / "frames.msgpack").write_bytes(b"".join(values))
    limits = StreamLimits(batch_frames=8)
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out, limits=limits)  # type: ignore[arg-type]
    batch = pump.take()
    assert batch is not None
    kinds = [wire.decode_frame(f).kind for f in batch.frames]
    assert kinds == [wire.FRAME_LOG] * 4 + [wire.FRAME_VALUE] * 3  # the values ride in the first batch
    assert pump.undelivered()[0] == 7  # the batch in flight: 4 LOG frames and the 3 journal frames
    assert all(bytes(wire.decode_frame(f).body).endswith(b"\n") for f in batch.frames[:4])  # type: ignore[arg-type]


def test_output_taken_or_skipped_is_released_from_the_disk(tmp_path: Path) -> None:
    """A task that prints past the cap without end: the logs' blocks are punched out as the pump
    goes, but for their last 64 KiB (what a failure record quotes)."""
    from nymph.flow import LOG_TAIL_KEEP, StreamLimits, punch_hole

    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 8192)
    with open(probe, "r+b") as fh:
        if not punch_hole(fh.fileno(), 4096):
            pytest.skip("this filesystem cannot punch holes")
    (tmp_path / "stdout.log").write_bytes(b"line\n" * 100_000)  # 500 kB
    (tmp_path / "stderr.log").write_bytes(b"")
    limits = StreamLimits(log_max_bytes=100_000)
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out, script=True, limits=limits)  # type: ignore[arg-type]
    _deliver(pump, out)
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"more\n" * 1_000_000)  # 5 MB past the cap
    pump._on_write()  # what the watcher calls on a write
    log = tmp_path / "stdout.log"
    size = log.stat().st_size
    assert log.stat().st_blocks * 512 <= LOG_TAIL_KEEP + 2 * 4096  # only the tail keeps its blocks
    with open(log, "rb") as fh:
        fh.seek(size - 5)
        assert fh.read() == b"more\n"
    assert wd.tail(log, 10) == "more\nmore\n"
