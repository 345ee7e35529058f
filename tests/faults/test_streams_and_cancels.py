"""A stream consumer that drops its connection and resumes from its cursor 100 times, and a cancel
storm (100 cancels while every slot is busy). The stream is delivered exactly once, in order, with
no gap; every cancelled call ends cancelled or killed, none is left hanging, and nymph serves
calls normally after the storm."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

import pytest

from dreamlake.lakeshore import wire
from tests.faults.stack import LIMIT_S, Nymph, Producer, Tally, ref, stack, until, wait_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]

DROPS = 100


def _read_some(producer: Producer, invocation_id: str, since: int, at_most: int) -> list[wire.Frame]:
    """Read at most ``at_most`` frames after ``since``, then drop the connection mid-stream."""
    url = f"{producer.server.url}/v1/producer/invocations/{invocation_id}/result/stream"
    reader = wire.FrameReader()
    got: list[wire.Frame] = []
    with producer.client.stream("GET", url, params={"since": since, "timeout": 10}, timeout=40) as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_raw():
            got += reader.feed(chunk)
            if len(got) >= at_most or any(f.kind != wire.FRAME_VALUE for f in got):
                break
    return got[:at_most]  # frames after these were on the wire, not taken: the cursor says so


def test_a_consumer_that_drops_and_resumes_100_times_gets_every_frame_once(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        nymphs.append(Nymph(server, tmp_path / "n").start())
        producer = Producer(server)
        n = 3 * DROPS
        inv = producer.submit(ref("count", str(marks), "s", n, 0.01))
        cursor, taken, drops = -1, [], 0
        deadline = time.monotonic() + LIMIT_S
        while not taken or taken[-1].kind == wire.FRAME_VALUE:
            assert time.monotonic() < deadline, f"the stream did not end ({len(taken)} frames)"
            frames = _read_some(producer, inv, cursor, 3)
            drops += 1
            taken += frames
            if frames:
                cursor = frames[-1].seq
        seqs = [f.seq for f in taken]
        values = [wire.unpack(f.body) for f in taken if f.kind == wire.FRAME_VALUE]
        dup = sum(c - 1 for c in collections.Counter(seqs).values())
        counts = {
            "calls": 1,
            "frames": len(taken),
            "drops": drops,
            "lost": len(set(range(n + 1)) - set(seqs)),
            "duplicated": dup,
            "wrong": sum(v != i for i, v in enumerate(values)),
        }
        print("\n[fault stream-drops] " + " ".join(f"{k}={v}" for k, v in counts.items()))
        assert drops >= DROPS
        assert seqs == list(range(n + 1)) and taken[-1].kind == wire.FRAME_END  # exactly once, in order
        assert values == list(range(n))
        assert producer.await_(inv)["state"] == "succeeded"
        producer.close()


def test_a_cancel_storm_while_busy_leaves_nothing_hanging(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        nymphs.append(Nymph(server, tmp_path / "n", "--concurrency", "4").start())
        producer = Producer(server)
        never = str(tmp_path / "never")  # the gate stays shut: only a cancel ends these calls
        calls = [producer.submit(ref("hold", str(marks), f"c{i}", i, never, 60.0)) for i in range(25)]
        keys = {inv: f"c{i}" for i, inv in enumerate(calls)}
        until(lambda: sum((marks / k).exists() for k in keys.values()) == 4, "every slot to be busy")
        answers: collections.Counter[str] = collections.Counter()
        lock = threading.Lock()

        def storm(part: list[str]) -> None:
            for inv in part:
                state = producer.cancel(inv)["state"]
                with lock:
                    answers[state] += 1

        threads = [threading.Thread(target=storm, args=(calls[k::4] * 4,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sum(answers.values()) == 100
        outcomes = {inv: producer.await_(inv, 60.0) for inv in calls}
        states = collections.Counter(out["state"] for out in outcomes.values())
        runs = collections.Counter(
            len((marks / keys[i]).read_text().splitlines()) if (marks / keys[i]).exists() else 0
            for i in calls
        )
        counts = {
            "calls": len(calls),
            "cancels": sum(answers.values()),
            "lost": sum(s not in ("cancelled", "killed") for s in states.elements()),
            "duplicated": 0,
            "wrong": states.get("succeeded", 0),
            "executions_per_call": dict(sorted(runs.items())),
            "states": dict(states),
        }
        print("\n[fault cancel-storm] " + " ".join(f"{k}={v}" for k, v in counts.items()))
        assert counts["lost"] == 0 and counts["wrong"] == 0
        assert max(runs) <= 1
        # nymph is not wedged: its slots came back
        tally = Tally("after-cancel-storm", marks)
        for i in range(4):
            tally.add(producer.submit(ref("double", str(marks), f"d{i}", i)), f"d{i}", 2 * i)
        wait_all(producer, tally, 60.0)
        after = tally.report()
        assert after["lost"] == 0 and after["wrong"] == 0
        producer.close()
