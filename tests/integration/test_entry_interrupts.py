"""The entry tells the function it is being stopped (issue 30 item 3): the first SIGTERM becomes
``dls.Interrupted`` in the function's thread, with the reason nymph wrote to ``stop.reason``; a
generator gets it at its current ``yield``; later SIGTERMs do not cut its cleanup short. The entry
runs as a real subprocess in a workdir, as every runner starts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.envelope import Envelope, fn_for
from tests import preempt_fns
from tests.conftest import ROOT
from tests.stack.wait import until

LIMIT_S = 30.0


def _start(
    tmp_path: Path, fn: Any, *args: Any, env: dict[str, str] | None = None
) -> tuple[Path, subprocess.Popen[bytes]]:
    workdir = tmp_path / "inv"
    workdir.mkdir(mode=0o700)
    (workdir / "args.msgpack").write_bytes(Envelope.create(fn_for(fn, transport="ref"), args, {}).to_bytes())
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-s", "-m", "dreamlake.lakeshore.daemon.entry"], cwd=workdir, env=full_env
    )
    return workdir, proc


def test_a_sigterm_is_interrupted_with_nymphs_reason_and_the_finally_runs(tmp_path: Path) -> None:
    marker, started = tmp_path / "marker", tmp_path / "started"
    workdir, proc = _start(tmp_path, preempt_fns.interruptible, str(marker), 60.0, str(started))
    try:
        until(started.exists, "the function to start")
        (workdir / "stop.reason").write_text("timeout")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(LIMIT_S) == 1
    finally:
        proc.kill()
    assert marker.read_text() == "timeout"
    error = json.loads((workdir / "error.json").read_text())
    assert error["type"] == "Interrupted" and "(timeout)" in error["message"]
    assert "BaseException" in error["mro"]


def test_a_generator_paused_at_its_yield_gets_interrupted_there(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    # a window of one frame: the generator stays paused at its first yield until nymph reads it
    workdir, proc = _start(
        tmp_path, preempt_fns.paused_gen, str(marker), env={"LAKESHORE_STREAM_WINDOW": "1:1000000"}
    )
    try:
        until(
            lambda: (workdir / "frames.msgpack").exists() and (workdir / "frames.msgpack").stat().st_size > 0,
            "the first yield",
        )
        (workdir / "stop.reason").write_text("preempted")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(LIMIT_S) == 1
    finally:
        proc.kill()
    assert marker.read_text() == "preempted at yield 0"
    frames = wire.FrameReader().feed((workdir / "frames.msgpack").read_bytes())
    assert [f.kind for f in frames] == [wire.FRAME_VALUE, wire.FRAME_ERROR]


def test_a_second_sigterm_does_not_cut_the_cleanup_short_and_no_reason_says_shutdown(tmp_path: Path) -> None:
    marker, started = tmp_path / "marker", tmp_path / "started"
    workdir, proc = _start(tmp_path, preempt_fns.slow_finally, str(marker), str(started))
    try:
        until(started.exists, "the function to start")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # during the finally: ignored
        assert proc.wait(LIMIT_S) == 1
    finally:
        proc.kill()
    assert marker.read_text() == "cleaned up"
    assert "(shutdown)" in json.loads((workdir / "error.json").read_text())["message"]
