"""Damaged outputs after a ``kill -9`` of nymph (issue 32, item 1).

nymph is killed while four tasks run; they finish while it is dead, and the test then damages
what three of them left, as a power loss can (a file renamed before its data reached the disk) or
a bad disk: ``result.msgpack`` truncated, ``result.msgpack`` garbled, ``error.json`` garbled. The
restarted nymph reconciles them: it checks each output before it acks, so a damaged one is a
``DamagedOutput`` failure (retried, as a crash is), never a success the caller cannot decode, nor
a "left no error.json". Each call ends in one correct outcome; the damaged ones ran twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dreamlake.lakeshore import wire
from tests.faults.stack import Nymph, Producer, Tally, ref, stack, until, wait_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(180)]


def test_truncated_and_garbled_outputs_found_after_a_nymph_kill_are_retried(tmp_path: Path) -> None:
    # a lease long enough for the restart to find the attempts still its own (the damage is the
    # subject here, not a lapsed lease: test_nymph_kill.py covers that)
    with stack(tmp_path, "--lease-s", "30") as (server, nymphs, marks):
        first = Nymph(server, tmp_path / "n", "--concurrency", "4")
        nymphs.append(first.start())
        producer = Producer(server)
        gate = tmp_path / "gate"
        tally = Tally("damaged-outputs", marks)
        calls = {}
        big = 2**40  # a result of several bytes (a uint64), so that a truncated one is not empty
        for key in ("intact", "truncated", "garbled"):
            calls[key] = producer.submit(ref("hold", str(marks), key, big, str(gate)))
            tally.add(calls[key], key, 2 * big)
        calls["error"] = producer.submit(ref("hold_then_fail", str(marks), "error", str(gate)))
        tally.keys[calls["error"]] = "error"
        runs = [*tally.expected, calls["error"]]
        until(lambda: all(tally.executions(i) == 1 for i in runs), "the four calls to run")
        first.kill()
        gate.touch()  # they finish while nymph is dead, leaving their outputs in the workdirs
        work = first.workdir
        until(lambda: all((work / calls[k] / "result.msgpack").exists() for k in tally.keys.values()
                          if k != "error"), "the results on disk")  # fmt: skip
        until(lambda: (work / calls["error"] / "error.json").exists(), "the error on disk")
        result = (work / calls["truncated"] / "result.msgpack").read_bytes()
        assert wire.unpack(result) == 2 * big and len(result) == 9
        (work / calls["truncated"] / "result.msgpack").write_bytes(result[:-1])
        (work / calls["garbled"] / "result.msgpack").write_bytes(b"\xc1" + result[1:])
        (work / calls["error"] / "error.json").write_bytes(b'{"type": "ValueError", "mess\x00\xff')

        again = Nymph(server, tmp_path / "n", "--concurrency", "4")  # same workdir and state dir
        nymphs.append(again.start())
        wait_all(producer, tally, 90.0)
        counts = tally.report()
        assert counts["lost"] == 0 and counts["wrong"] == 0 and counts["duplicated"] == 0, counts
        assert {k: tally.executions(calls[k]) for k in ("intact", "truncated", "garbled")} == {
            "intact": 1, "truncated": 2, "garbled": 2,
        }, again.output()[-4000:]  # fmt: skip
        failed = producer.await_(calls["error"], 60.0)
        assert failed["state"] == "failed" and failed["error"]["type"] == "ValueError", failed
        assert "error failed on purpose" in failed["error"]["message"], failed
        assert tally.executions(calls["error"]) == 2
        log = again.output()
        for key, name, says in (("truncated", "result.msgpack", "truncated"),
                                ("garbled", "result.msgpack", "not msgpack"),
                                ("error", "error.json", "not JSON")):  # fmt: skip
            lines = [line for line in log.splitlines() if calls[key] in line and f"{name} is damaged" in line]
            assert lines and says in lines[0], (key, log[-4000:])
        producer.close()
