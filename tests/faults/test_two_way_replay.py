"""A two-way generator whose nymph dies mid-conversation (docs/protocol.md, "Two-way streams"): the
new attempt replays the journaled answers in order, so its body gets the same values at the same
yields and reaches the point where the consumer left it; the consumer meets ``StreamRestarted``,
then the replayed yields, whose answers are already there (re-sending the same value is a no-op,
a different one a 409), and the conversation goes on to its end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.errors import Conflict
from dreamlake.lakeshore.queue import restart_of, send_index
from tests.faults.stack import Nymph, Producer, kill_leftovers, ref, stack, until

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]


def _conversation(producer: Producer, inv: str) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
    """The journal read raw, split at the RESTART marker: ``(send index, value)`` of each VALUE
    frame before it (the first attempt's) and after it (the new attempt's)."""
    before: list[tuple[int, Any]] = []
    after: list[tuple[int, Any]] | None = None
    for f in producer.frames(inv, -1, timeout=0.5):
        if restart_of(f) is not None:
            after = []
        elif f.kind == wire.FRAME_VALUE:
            index = send_index(f)
            assert index is not None, f"a two-way body's value without meta.send: {f}"
            (before if after is None else after).append((index, wire.unpack(f.body)))
    return before, after or []


def test_a_new_attempt_replays_the_journaled_sends_in_order(tmp_path: Path) -> None:
    with stack(tmp_path) as (server, nymphs, marks):
        first = Nymph(server, tmp_path / "a")
        nymphs.append(first.start())
        producer = Producer(server)
        plane = HttpDispatch(server.url, producer.token)
        q = dls.SyncQueue("default", dispatch=plane)
        inv = producer.submit(ref("accumulate", str(marks), "acc", 4), two_way=True)
        runs = marks / "acc"

        s = q.stream(inv, timeout=60)
        assert next(s) == []
        assert s.send("a") == ["a"]
        assert s.send("b") == ["a", "b"]  # the first attempt waits at its yield 2
        (pid,) = runs.read_text().split()

        first.kill()  # kill -9 of nymph, then of its task: nothing of the first attempt is left
        kill_leftovers(tmp_path / "a")
        until(lambda: not _alive(int(pid)), "the first attempt's task to die")
        nymphs.append(Nymph(server, tmp_path / "b").start())  # takes the call once the lease lapses

        # the new attempt's body got the two journaled answers, in order, with nobody sending
        # anything: it waits at yield 2 again, where the consumer left it
        until(lambda: len(_conversation(producer, inv)[1]) >= 3, "the new attempt to reach yield 2")
        first_attempt, replay = _conversation(producer, inv)
        assert first_attempt == [(0, []), (1, ["a"]), (2, ["a", "b"])]
        assert replay == [(0, []), (1, ["a"]), (2, ["a", "b"])]
        assert len(runs.read_text().split()) == 2 and runs.read_text().split()[0] == pid

        # a different value into a replayed yield is refused (409; None is what next() sends),
        # the same value is a no-op
        url = f"{server.url}/v1/producer/invocations/{inv}/send"
        headers = {"Content-Type": "application/x-msgpack"}
        for index, value, status in [(1, "x", 409), (0, None, 409), (1, "b", 200), (0, "a", 200)]:
            body = msgpack.packb({"index": index, "kind": "value", "body": wire.pack(value)})
            resp = producer.client.post(url, content=body, headers=headers)
            assert resp.status_code == status, (index, value, resp.status_code, resp.content[:300])
            if status == 409:
                assert b"already sent a different value" in resp.content
            else:
                assert msgpack.unpackb(resp.content)["duplicate"] is True

        # the consumer: its third send (the first since the crash) answers yield 2, then meets the restart
        with pytest.raises(dls.StreamRestarted) as restarted:
            s.send("c")
        assert restarted.value.attempt == 2
        # then the replayed yields: their answers are there; re-sent, they change nothing
        assert next(s) == []
        with pytest.raises(Conflict, match="already sent a different value"):
            s.send("x")
        assert s.send("a") == ["a"]
        assert s.send("b") == ["a", "b"]
        assert s.send("c") == ["a", "b", "c"]  # the new attempt got the third answer too: its yield 3
        with pytest.raises(StopIteration):
            s.send("d")  # a new answer, into the new attempt: the body returns, the stream ends
        assert q.result(inv, timeout=30) == ["a", "b", "c", "d"]
        assert _conversation(producer, inv)[1] == [(0, []), (1, ["a"]), (2, ["a", "b"]), (3, ["a", "b", "c"])]
        executions = runs.read_text().split()
        print(f"\n[fault two-way-replay] calls=1 attempts={restarted.value.attempt} executions={len(executions)} "
              f"replayed_sends=2 result={q.result(inv, timeout=30)}")  # fmt: skip
        assert len(executions) == 2
        plane.close()
        producer.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
