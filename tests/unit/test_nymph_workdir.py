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
    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []

    def chunk(self, body: dict[str, Any]) -> None:
        self.chunks.append(body)


def test_pump_forwards_complete_frames_in_order_and_resumes_after_restart(tmp_path: Path) -> None:
    journal = tmp_path / "frames.msgpack"
    f0 = wire.encode_frame(wire.FRAME_VALUE, 0, wire.pack("a"), {"ts": 1.0})
    f1 = wire.encode_frame(wire.FRAME_VALUE, 1, wire.pack("b"), {"ts": 2.0})
    f2 = wire.encode_frame(wire.FRAME_END, 2, wire.pack(None), {"ts": 3.0})
    journal.write_bytes(f0 + f1[:3])  # a partial frame at the tail waits
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out)  # type: ignore[arg-type]
    assert pump.poll() == 1
    with open(journal, "ab") as fh:
        fh.write(f1[3:])
    assert pump.poll() == 1
    assert [c["bytes"] for c in out.chunks] == [f0, f1]
    assert [c["final"] for c in out.chunks] == [False, False]

    with open(journal, "ab") as fh:
        fh.write(f2)
    again = _Recorder()
    restarted = Pump(tmp_path, "inv", 1, again)  # type: ignore[arg-type]
    assert restarted.poll() == 1  # only what was not handed over before
    assert again.chunks[0]["seq"] == 2 and again.chunks[0]["final"] is True


def test_script_pump_turns_output_into_log_frames(tmp_path: Path) -> None:
    (tmp_path / "stdout.log").write_bytes(b"hello\n")
    (tmp_path / "stderr.log").write_bytes(b"warn\n")
    out = _Recorder()
    pump = Pump(tmp_path, "inv", 1, out, script=True)  # type: ignore[arg-type]
    assert pump.poll() == 2
    pump.finish(wire.FRAME_END, wire.pack({"exit_code": 0}))
    frames = [wire.decode_frame(c["bytes"]) for c in out.chunks]
    assert [(f.kind, f.seq, f.body, (f.meta or {}).get("stream")) for f in frames[:2]] == [
        (wire.FRAME_LOG, 0, b"hello\n", "stdout"),
        (wire.FRAME_LOG, 1, b"warn\n", "stderr"),
    ]
    assert frames[2].kind == wire.FRAME_END and out.chunks[2]["final"] is True
