"""nymph's side of the workdir contract, the gates before spawning, and the journal pump."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.envelope import Envelope, fn_for
from dreamlake.lakeshore.errors import InvalidId
from nymph import workdir as wd
from nymph.config import resolve
from nymph.job import Job, JobContext, Refused
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
    with pytest.raises(Refused) as info:
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
    assert _deliver(restarted, again) == 1  # only what was not delivered before
    assert again.chunks[0]["seq"] == 2 and again.chunks[0]["final"] is True
    assert restarted.done


def test_pump_batches_what_built_up_and_adds_the_final_frame(tmp_path: Path) -> None:
    from nymph.pump import StreamLimits

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
