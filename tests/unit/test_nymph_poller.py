"""The poll loop's side of acks on the poll (nymph/poller.py): a poll carries the acks the outbox
has ready, answered at once, tried once; a failure hands them back and the usual poll follows."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore.errors import AuthError, Unavailable
from nymph.config import NymphConfig
from nymph.poller import Poller
from nymph.slots import Slots


class FakeClient:
    """``poll`` answers from a script: a dict, or an exception to raise; then empty answers."""

    def __init__(self, script: list[Any]) -> None:
        self.script = list(script)
        self.bodies: list[dict[str, Any]] = []

    def poll(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.bodies.append(dict(body))
        step = self.script.pop(0) if self.script else {"commands": []}
        if isinstance(step, BaseException):
            raise step
        return dict(step)


class FakeOutbox:
    def __init__(self, acks: list[dict[str, Any]]) -> None:
        self.ready = [type("Msg", (), {"body": a})() for a in acks]
        self.answered: list[tuple[list[Any], list[Any] | None]] = []

    def take(self, worker_id: str, limit: int) -> list[Any]:
        out, self.ready = self.ready[:limit], self.ready[limit:]
        return out

    def settle(self, msgs: list[Any], answers: list[Any] | None) -> None:
        self.answered.append((msgs, answers))


def _poller(tmp_path: Path, client: FakeClient, outbox: FakeOutbox, **hooks: Any) -> Poller:
    cfg = NymphConfig(server="http://cp", token="t", workdir=tmp_path / "w", state_dir=tmp_path / "s")
    stop = threading.Event()
    return Poller(
        client,  # type: ignore[arg-type]
        cfg,
        Slots(2),
        worker_id=lambda: "W",
        stopping=stop,
        claiming_stopped=lambda: False,
        ready=lambda: True,
        dispatch=hooks.get("dispatch", lambda c: None),
        on_answer=lambda a: None,
        on_auth=hooks.get("on_auth", lambda e: None),
        pet=lambda: None,
        take_acks=outbox.take,
        acks_answered=outbox.settle,
    )


ACK = {"invocation_id": "01J00000000000000000000000", "state": "succeeded", "attempt": 1}


def test_a_poll_carries_the_ready_acks_answered_at_once_and_settles_them(tmp_path: Path) -> None:
    acked = [{"invocation_id": ACK["invocation_id"], "status": 200, "ok": True}]
    client = FakeClient([{"commands": [{"id": "c1", "kind": "run"}], "acked": acked}])
    outbox = FakeOutbox([ACK])
    dispatched: list[Any] = []
    poller = _poller(tmp_path, client, outbox, dispatch=dispatched.append)
    assert poller._poll_once(2)
    (body,) = client.bodies
    assert body["acks"] == [ACK] and body["timeout_s"] == 0.0 and body["max"] == 2
    assert outbox.answered == [(outbox.answered[0][0], acked)]
    assert dispatched == [{"id": "c1", "kind": "run"}]


def test_without_acks_the_poll_waits_as_usual(tmp_path: Path) -> None:
    client = FakeClient([{"commands": [{"id": "c1", "kind": "run"}]}])
    poller = _poller(tmp_path, client, FakeOutbox([]))
    assert poller._poll_once(1)
    (body,) = client.bodies
    assert "acks" not in body and body["timeout_s"] == poller._config.poll_timeout_s > 0


@pytest.mark.parametrize("failure", [Unavailable("down", 503), AuthError("bad token", 401)])
def test_a_failed_poll_with_acks_hands_them_back_and_polls_again_without_them(
    tmp_path: Path, failure: Exception
) -> None:
    client = FakeClient([failure, {"commands": []}])
    outbox = FakeOutbox([ACK])
    poller = _poller(tmp_path, client, outbox)
    assert poller._poll_once(1)
    assert [("acks" in b) for b in client.bodies] == [True, False]  # tried once, then without them
    assert len(outbox.answered) == 1 and outbox.answered[0][1] is None  # handed back


def test_a_poll_that_stops_the_loop_still_hands_its_acks_back(tmp_path: Path) -> None:
    seen: list[Any] = []
    client = FakeClient([KeyboardInterrupt()])
    outbox = FakeOutbox([ACK])
    poller = _poller(tmp_path, client, outbox, on_auth=seen.append)
    with pytest.raises(KeyboardInterrupt):
        poller._poll_once(1)
    assert len(outbox.answered) == 1 and outbox.answered[0][1] is None
    assert not poller.poll_soon()


def test_poll_soon_while_every_slot_is_busy_or_a_poll_follows_a_claim(tmp_path: Path) -> None:
    client = FakeClient([{"commands": [{"id": "c1", "kind": "noop"}]}])
    poller = _poller(tmp_path, client, FakeOutbox([]))
    assert not poller.poll_soon()
    poller.waiting_for_slot = True
    assert poller.poll_soon()
    poller.waiting_for_slot = False
    poller._poll_once(1)  # it claimed: the next poll in flight will be answered at once
    poller._in_flight = True
    assert poller.poll_soon()


def test_a_poll_carries_as_many_acks_as_the_control_plane_says_it_takes(tmp_path: Path) -> None:
    from dreamlake.lakeshore.protocol.limits import ServerLimits

    acks = [{**ACK, "invocation_id": f"01J{n:023d}"} for n in range(300)]
    outbox = FakeOutbox(acks)
    client = FakeClient([])
    poller = _poller(tmp_path, client, outbox)
    # the register answer's limits (a control plane that says nothing: the default, 256)
    poller.limits = ServerLimits.from_answer({"limits": {"acks_per_poll": 256}})
    poller._poll_once(1)
    assert len(client.bodies[0]["acks"]) == 256  # the server's limit, not a smaller one of nymph's
    poller.limits = ServerLimits.from_answer({"limits": {"acks_per_poll": 10}})
    poller._poll_once(1)
    assert len(client.bodies[-1]["acks"]) == 10  # a control plane that takes fewer gets fewer
