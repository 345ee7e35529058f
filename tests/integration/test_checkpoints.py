"""Checkpoints carried from one attempt to the next (issue 30 item 4), with real ``nymph start``
processes and a control plane with a payload store (the local blob directory), on SQLite and
PostgreSQL; and the checkpoint route played from the attacker's side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from tests import preempt_fns
from tests.integration.conftest import ControlPlane, local_blobs, running_control_plane, submit_body
from tests.stack.nymph import Nymph
from tests.stack.producer import await_result, envelope, status_of, submit
from tests.stack.wait import until

ROUTE = "/v1/daemon/checkpoint"


@pytest.fixture
def blob_plane(store_url: str, tmp_path: Path) -> Iterator[ControlPlane]:
    config = ServerConfig(expire_every_s=0.2, recheck_s=0.5)
    with running_control_plane(store_url, config=config, payloads=local_blobs(tmp_path / "blobs")) as cp:
        yield cp


def _base(path: Path) -> Path:
    path.mkdir()
    return path


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_ten_step_loop_preempted_twice_does_each_step_once(
    blob_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = blob_plane
    log = tmp_path / "steps.log"
    inv = submit(cp.url, cp.producer_token, envelope(preempt_fns.stepper, str(log), 10, 0.3), max_attempts=1)
    for n, (name, after) in enumerate((("a", 2), ("b", 5))):
        node = nymph_factory(cp.url, cp.daemon_token, "--grace-s", "0.5", base=_base(tmp_path / name))
        until(lambda after=after: len(_lines(log)) >= after, f"{after} steps on nymph {name}")
        node.signal(15)
        assert node.wait() == 0
        until(
            lambda n=n: status_of(cp.url, cp.producer_token, inv)["preemptions"] == n + 1,
            f"attempt {n + 1} to be preempted",
        )
        assert f"checkpoint of attempt {n + 1} carried" in node.output(), node.output()[-3000:]
    last = nymph_factory(cp.url, cp.daemon_token, base=_base(tmp_path / "c"))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", last.output()[-3000:]
    assert wire.unpack(out["result_blob"]) == 10
    steps = [int(line.split()[0]) for line in _lines(log)]
    assert steps == list(range(10)), _lines(log)  # each step once, in order, across 3 attempts
    attempts = [int(line.split()[1]) for line in _lines(log)]
    assert attempts[0] == 1 and attempts[-1] == 3 and sorted(attempts) == attempts
    assert "restored" in last.output()
    history = status_of(cp.url, cp.producer_token, inv)["attempts"]
    assert [a["state"] for a in history] == ["preempted", "preempted", "succeeded"]


def test_a_checkpoint_over_the_control_planes_max_payload_bytes_is_skipped_saying_what_to_raise(
    store_url: str, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    """nymph's checkpoint_max_mb (1024) is over the control plane's MAX_PAYLOAD_BYTES (here 64 KiB;
    100 MiB by default): the register answer says the latter, so a checkpoint between the two is
    skipped by nymph with a line naming the setting to raise, not packed whole and then refused
    by the presign (HTTP 413)."""
    blobs = local_blobs(tmp_path / "blobs", max_payload_bytes=64 << 10)
    with running_control_plane(store_url, payloads=blobs) as cp:
        node = nymph_factory(cp.url, cp.daemon_token, base=_base(tmp_path / "n"))
        inv = submit(
            cp.url, cp.producer_token, envelope(preempt_fns.big_checkpoint, 100 << 10), max_attempts=1
        )
        assert await_result(cp.url, cp.producer_token, inv)["state"] == "failed"
        until(lambda: "checkpoint not carried" in node.output(), "the checkpoint to be skipped")
        out = node.output()
        assert "raise MAX_PAYLOAD_BYTES on the control plane" in out, out[-3000:]
        assert "HTTP 413" not in out, out[-3000:]  # decided before packing it all and asking for an upload


def _claimed(cp: ControlPlane, token: str, queue: str, worker: str) -> dict[str, object]:
    body = {"worker_id": worker, "queues": [queue], "timeout_s": 5}
    assert cp.call("/v1/daemon/register", body, token)[0] == 200
    status, out = cp.call("/v1/daemon/poll", body, token)
    assert status == 200 and out["commands"], out
    return dict(out["commands"][0]["body"])


def _ref(inv: str, tag: str = "abc") -> dict[str, object]:
    return {
        "bucket": None,
        "key": f"payloads/2026/12/04/{inv}.{tag}/checkpoint",
        "size": 1,
        "sha256": "0" * 64,
    }


@pytest.fixture
def sqlite_blob_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    config = ServerConfig(expire_every_s=0.2, recheck_s=0.5)
    store = str(tmp_path / "lakeshore.db")
    with running_control_plane(store, config=config, payloads=local_blobs(tmp_path / "blobs")) as cp:
        yield cp


def test_a_nymph_killed_while_it_stops_a_call_acks_that_stop_and_its_checkpoint_after_a_restart(
    sqlite_blob_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    """SIGTERM preempts the call (``max_attempts=1``); nymph is SIGKILLed after the ladder told the
    function (its Interrupted says ``preempted``) but before the ack. The restarted nymph acks the
    preemption it recorded, with the checkpoint, and attempt 2 resumes from it. Before, it acked
    ``failed``/``Interrupted`` from the task's error.json: the call failed, its checkpoint lost."""
    cp = sqlite_blob_plane
    marker, started = tmp_path / "marker", tmp_path / "started"
    a = nymph_factory(cp.url, cp.daemon_token, "--grace-s", "0.2", base=_base(tmp_path / "a"))
    fn = envelope(preempt_fns.stopped_slowly, str(marker), str(started))
    inv = submit(cp.url, cp.producer_token, fn, max_attempts=1)
    until(started.exists, "the function to run")
    a.signal(15)
    until(marker.exists, "the ladder's SIGTERM to reach the function")
    a.kill()  # the function takes a second more to end: nothing is acked yet
    assert marker.read_text() == "preempted"
    assert status_of(cp.url, cp.producer_token, inv)["state"] == "running"
    a.start()
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", a.output()[-3000:]
    assert wire.unpack(out["result_blob"]) == "resumed on attempt 2 from attempt 1"
    history = status_of(cp.url, cp.producer_token, inv)["attempts"]
    assert [(h["attempt"], h["state"]) for h in history] == [(1, "preempted"), (2, "succeeded")]
    assert history[0]["error"]["type"] == "Preempted" and "started" not in history[0]["error"]


def test_the_checkpoint_route_takes_only_the_lease_holders_checkpoint(blob_plane: ControlPlane) -> None:
    cp = blob_plane
    queue = f"q{new_ulid().lower()[-8:]}"
    inv = new_ulid()
    assert cp.call("/v1/producer/submit", submit_body(inv, queue), cp.producer_token)[0] == 200
    worker = new_ulid()
    run = _claimed(cp, cp.daemon_token, queue, worker)
    mine = {"invocation_id": inv, "attempt": 1, "worker_id": worker, "checkpoint_ref": _ref(inv)}
    # the wrong kinds of token: a producer, the task's own credential
    assert cp.call(ROUTE, mine, cp.producer_token)[0] == 403
    assert cp.call(ROUTE, mine, str(run["task_token"]))[0] == 403
    # another daemon token claiming the victim's worker id
    rogue = cp.store.create_token("daemon", "rogue")
    status, out = cp.call(ROUTE, mine, rogue)
    assert status == 403 and "registered by another daemon token" in out["error"]
    # a blob that is not this invocation's checkpoint
    other = {**mine, "checkpoint_ref": _ref(new_ulid())}
    status, out = cp.call(ROUTE, other, cp.daemon_token)
    assert status == 400 and "minted for" in out["error"]
    wrong_kind = {**mine, "checkpoint_ref": {**_ref(inv), "key": f"payloads/2026/12/04/{inv}.abc/result"}}
    assert cp.call(ROUTE, wrong_kind, cp.daemon_token)[0] == 400
    assert cp.call(ROUTE, mine, cp.daemon_token) == (200, {"ok": True})
    # attempt 1 is preempted; attempt 2 runs on another worker: attempt 1's upload is stale
    preempted = {"invocation_id": inv, "state": "preempted", "attempt": 1, "worker_id": worker}
    assert cp.call("/v1/daemon/ack", preempted, cp.daemon_token)[0] == 200
    second = new_ulid()
    again = _claimed(cp, cp.daemon_token, queue, second)
    assert again["attempt"] == 2 and again["checkpoint_ref"] == _ref(inv)
    stale = {**mine, "checkpoint_ref": _ref(inv, "stale")}
    status, out = cp.call(ROUTE, stale, cp.daemon_token)
    assert status == 409 and "superseded" in out["error"]
    assert cp.store.get(inv).checkpoint_ref == _ref(inv)  # type: ignore[union-attr]
    # the finished attempt's task credential and its worker: refused once the call is done
    done = {
        "invocation_id": inv,
        "state": "succeeded",
        "attempt": 2,
        "worker_id": second,
        "result_blob": b"\xc0",
    }
    assert cp.call("/v1/daemon/ack", done, cp.daemon_token)[0] == 200
    late = {"invocation_id": inv, "attempt": 2, "worker_id": second, "checkpoint_ref": _ref(inv, "late")}
    assert cp.call(ROUTE, late, cp.daemon_token)[0] == 409
    assert cp.call(ROUTE, late, str(again["task_token"]))[0] == 403
