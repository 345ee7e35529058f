"""The control plane goes away (issue 12, items 3 and 6 as nymph and a producer meet them): a 20 s
outage, ``kill -9`` of the server during submits and during runs. Nothing is lost or wrong, each
outcome reaches the consumer once, and nymph logs one ``control plane went away`` line and one
``reconnected`` line per outage, not a traceback per poll."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.faults.stack import Nymph, Producer, Tally, ref, stack, until, wait_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]

OUTAGE_S = 20.0


def _running(producer: Producer, invocation_ids: list[str]) -> int:
    return sum(producer.status(i)["state"] == "running" for i in invocation_ids)


def _check(tally: Tally) -> dict[str, object]:
    counts = tally.report()
    assert counts["lost"] == 0 and counts["wrong"] == 0 and counts["duplicated"] == 0, counts
    return counts


def test_a_20s_outage_costs_latency_not_calls_and_nymph_logs_it_once(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        n = Nymph(server, tmp_path / "n", "--concurrency", "3")
        nymphs.append(n.start())
        producer = Producer(server)
        gate = tmp_path / "gate"
        tally = Tally("outage-20s", marks)
        for i in range(6):
            tally.add(producer.submit(ref("hold", str(marks), f"k{i}", i, str(gate))), f"k{i}", 2 * i)
        until(lambda: _running(producer, list(tally.expected)) == 3, "three calls to run")
        server.stop()  # SIGTERM with long polls in flight
        gate.touch()  # the running calls end while the control plane is away: their acks wait
        until(lambda: len(list((n.state_dir / "outbox").glob("*.msg"))) >= 1, "acks in the outbox", 30.0)
        time.sleep(OUTAGE_S)  # the outage itself: nymph keeps retrying, quietly
        _, health = n.health()
        assert health.get("control_plane_ok") is False, health
        server.start()
        wait_all(producer, tally, 90.0)
        _check(tally)
        until(lambda: "reconnected to the control plane" in n.output(), "the reconnected line")
        log = n.output()
        assert log.count("control plane went away") == 1, log[-5000:]
        assert log.count("reconnected to the control plane") == 1, log[-5000:]
        assert "Traceback" not in log, log[-5000:]
        producer.close()


def test_kill_9_of_the_server_during_submits_loses_no_call(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        nymphs.append(Nymph(server, tmp_path / "n", "--concurrency", "4").start())
        producer = Producer(server)
        tally = Tally("kill-server-during-submits", marks)
        submitted = threading.Event()

        def submit_all() -> None:
            for i in range(40):
                # a submit the dead server may or may not have stored is sent again, same id
                tally.add(producer.submit(ref("double", str(marks), f"k{i}", i)), f"k{i}", 2 * i)
                if i == 10:
                    submitted.set()

        producing = threading.Thread(target=submit_all)
        producing.start()
        assert submitted.wait(60)
        server.kill()
        server.start()
        producing.join(120)
        assert not producing.is_alive()
        wait_all(producer, tally, 90.0)
        counts = _check(tally)
        print(f"[fault kill-server-during-submits] submit retries={producer.retries}")
        assert counts["calls"] == 40
        producer.close()


def test_kill_9_of_the_server_during_runs_loses_no_call(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        nymphs.append(Nymph(server, tmp_path / "n", "--concurrency", "4").start())
        producer = Producer(server)
        tally = Tally("kill-server-during-runs", marks)
        for i in range(12):
            tally.add(producer.submit(ref("double", str(marks), f"k{i}", i, 0.5)), f"k{i}", 2 * i)
        until(lambda: _running(producer, list(tally.expected)) >= 2, "calls to run")
        server.kill()
        server.start()
        wait_all(producer, tally, 90.0)
        _check(tally)
        producer.close()
