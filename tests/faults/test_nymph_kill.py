"""``kill -9`` of nymph mid-run (issue 12): restarted, it re-attaches to the tasks that outlived
it; not restarted, the leases lapse and another nymph finishes the work. Nothing is lost or wrong
either way, and each outcome reaches the consumer once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.stack import Nymph, Producer, Tally, ref, stack, until, wait_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]


def _claimed(producer: Producer, tally: Tally) -> int:
    return sum(producer.status(i)["state"] == "running" for i in tally.expected)


@pytest.mark.parametrize("when", ["claimed", "running"])
def test_kill_9_of_nymph_mid_run_then_restart(tmp_path: Path, when: str) -> None:
    """``running``: three tasks run their function (the restart re-attaches to them); ``claimed``:
    killed as soon as three calls are claimed, most of them before their task started (nothing
    ran: the restart acks nothing and they run again once their lease lapses)."""
    with stack(tmp_path) as (server, nymphs, marks):
        first = Nymph(server, tmp_path / "n", "--concurrency", "3")
        nymphs.append(first.start())
        producer = Producer(server)
        gate = tmp_path / "gate"
        tally = Tally(f"kill-nymph-restart-{when}", marks)
        for i in range(6):
            tally.add(producer.submit(ref("hold", str(marks), f"k{i}", i, str(gate))), f"k{i}", 2 * i)
        if when == "running":
            until(lambda: sum(tally.executions(i) for i in tally.expected) == 3, "three calls to run")
        else:
            until(lambda: _claimed(producer, tally) == 3, "three calls to be claimed", step_s=0.01)
        first.kill()
        again = Nymph(server, tmp_path / "n", "--concurrency", "3")  # same workdir and state dir
        nymphs.append(again.start())
        until(lambda: "registered as worker" in again.output(), "the restart")
        gate.touch()
        wait_all(producer, tally, 90.0)
        counts = tally.report()
        assert counts["lost"] == 0 and counts["wrong"] == 0 and counts["duplicated"] == 0, counts
        producer.close()


def test_kill_9_of_nymph_mid_run_without_restart_another_nymph_finishes(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        doomed = Nymph(server, tmp_path / "a", "--concurrency", "3")
        nymphs.append(doomed.start())
        producer = Producer(server)
        tally = Tally("kill-nymph-no-restart", marks)
        for i in range(6):
            tally.add(producer.submit(ref("double", str(marks), f"k{i}", i, 1.5)), f"k{i}", 2 * i)
        until(lambda: sum(tally.executions(i) for i in tally.expected) == 3, "three calls to run")
        doomed.kill()  # never restarted: its leases lapse and the work comes back to the queue
        nymphs.append(Nymph(server, tmp_path / "b", "--concurrency", "3").start())
        wait_all(producer, tally, 90.0)
        counts = tally.report()
        assert counts["lost"] == 0 and counts["wrong"] == 0 and counts["duplicated"] == 0, counts
        producer.close()
