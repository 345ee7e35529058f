"""The control-plane attacks of issue 11, made against the real stack and shown refused.

Each test plays the attacker against ``lakeshore server`` (a subprocess on SQLite, as the README
starts it) over HTTP, asserts what the attacker sees (status and message), and checks that nothing
the attacker aimed at changed. The victim is team A: a producer bound to namespace ``team-a``
and the daemon of the bootstrap token. The attackers hold tokens of their own: a second daemon
token, a producer of ``team-b``, a daemon bound to ``team-b``, a producer without ``may_script``.
"""

from __future__ import annotations

import math
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import submit_body
from tests.security.conftest import Stack


@dataclass
class Tokens:
    victim_producer: str  # team-a
    victim_daemon: str  # the bootstrap daemon token (unbound)
    rogue_daemon: str  # another daemon token, unbound
    other_producer: str  # team-b
    other_daemon: str  # bound to team-b
    no_script_producer: str  # team-a, without --may-script


@pytest.fixture(scope="module")
def tokens(stack: Stack) -> Tokens:
    return Tokens(
        victim_producer=stack.token("producer", "team-a", "--namespace", "team-a", "--may-script"),
        victim_daemon=stack.daemon,
        rogue_daemon=stack.token("daemon", "rogue"),
        other_producer=stack.token("producer", "team-b", "--namespace", "team-b"),
        other_daemon=stack.token("daemon", "team-b-daemon", "--namespace", "team-b"),
        no_script_producer=stack.token("producer", "team-a-plain", "--namespace", "team-a"),
    )


def frame(seq: int, value: Any, kind: int = wire.FRAME_VALUE) -> bytes:
    return wire.encode_frame(kind, seq, wire.pack(value), {"ts": 0.0})


@dataclass
class Running:
    """An invocation of team A, running on the victim's worker."""

    invocation_id: str
    worker_id: str
    attempt: int


@pytest.fixture
def running(stack: Stack, tokens: Tokens) -> Iterator[Running]:
    queue = f"q{new_ulid().lower()[-8:]}"
    inv = new_ulid()
    status, _ = stack.call("/v1/producer/submit", submit_body(inv, queue), tokens.victim_producer)
    assert status == 200
    worker = new_ulid()
    body = {"worker_id": worker, "queues": [queue], "timeout_s": 5}
    assert stack.call("/v1/daemon/register", body, tokens.victim_daemon)[0] == 200
    status, out = stack.call("/v1/daemon/poll", body, tokens.victim_daemon)
    assert status == 200 and out["commands"][0]["body"]["invocation_id"] == inv
    yield Running(inv, worker, out["commands"][0]["body"]["attempt"])


def status_of(stack: Stack, tokens: Tokens, inv: str) -> dict[str, Any]:
    status, out = stack.call(f"/v1/producer/invocations/{inv}", None, tokens.victim_producer, method="GET")
    assert status == 200
    return dict(out)


def ack(inv: str, **lease: Any) -> dict[str, Any]:
    return {"invocation_id": inv, "state": "succeeded", "result_blob": wire.pack("forged"), **lease}


def chunk(inv: str, seq: int, value: Any, **lease: Any) -> dict[str, Any]:
    return {"invocation_id": inv, "seq": seq, "bytes": frame(seq, value), **lease}


# -- who may report what (daemon side) ---------------------------------------------------------


def test_a_forged_ack_without_worker_id_is_refused(stack: Stack, tokens: Tokens, running: Running) -> None:
    status, out = stack.call("/v1/daemon/ack", ack(running.invocation_id, attempt=1), tokens.rogue_daemon)
    assert (status, out["error"]) == (400, "missing field 'worker_id'")
    assert status_of(stack, tokens, running.invocation_id)["state"] == "running"


def test_a_forged_ack_with_the_stolen_worker_id_is_refused(
    stack: Stack, tokens: Tokens, running: Running
) -> None:
    seen = status_of(stack, tokens, running.invocation_id)  # the status route shows the worker id
    lease = {"worker_id": seen["worker_id"], "attempt": seen["attempt"]}
    status, out = stack.call("/v1/daemon/ack", ack(running.invocation_id, **lease), tokens.rogue_daemon)
    assert status == 403 and out["ok"] is False
    assert f"worker {running.worker_id} is registered by another daemon token" in out["error"]
    # registering the stolen id again does not take it over either
    status, out = stack.call(
        "/v1/daemon/register", {"worker_id": running.worker_id, "queues": ["x"]}, tokens.rogue_daemon
    )
    assert status == 403 and "registered by another daemon token" in out["error"]
    assert status_of(stack, tokens, running.invocation_id)["state"] == "running"


def test_an_ack_from_the_attackers_own_worker_is_refused(
    stack: Stack, tokens: Tokens, running: Running
) -> None:
    mine = new_ulid()
    assert (
        stack.call("/v1/daemon/register", {"worker_id": mine, "queues": ["x"]}, tokens.rogue_daemon)[0] == 200
    )
    body = ack(running.invocation_id, worker_id=mine, attempt=running.attempt)
    status, out = stack.call("/v1/daemon/ack", body, tokens.rogue_daemon)
    assert status == 403 and out["error"].startswith(
        f"attempt {running.attempt} of {running.invocation_id} is held by another worker"
    )
    stale = ack(running.invocation_id, worker_id=running.worker_id, attempt=running.attempt + 1)
    status, out = stack.call("/v1/daemon/ack", stale, tokens.victim_daemon)  # even its own token
    assert status == 409 and "superseded" in out["error"]
    assert status_of(stack, tokens, running.invocation_id)["state"] == "running"


def test_heartbeats_for_another_workers_lease_are_refused(
    stack: Stack, tokens: Tokens, running: Running
) -> None:
    beat = {
        "worker_id": running.worker_id,
        "running": [{"invocation_id": running.invocation_id, "attempt": 1}],
    }
    status, out = stack.call("/v1/daemon/heartbeat", beat, tokens.rogue_daemon)
    assert status == 403 and "registered by another daemon token" in out["error"]


def test_injected_frames_from_another_worker_are_refused_and_never_reach_a_consumer(
    stack: Stack, tokens: Tokens, running: Running
) -> None:
    inv, real = running.invocation_id, {"worker_id": running.worker_id, "attempt": running.attempt}
    for seq in range(3):
        assert (
            stack.call("/v1/daemon/result-chunk", chunk(inv, seq, seq, **real), tokens.victim_daemon)[0]
            == 200
        )
    mine = new_ulid()
    stack.call("/v1/daemon/register", {"worker_id": mine, "queues": ["x"]}, tokens.rogue_daemon)
    for lease, status_wanted, text in [
        ({"worker_id": running.worker_id, "attempt": 1}, 403, "registered by another daemon token"),
        ({"worker_id": mine, "attempt": 1}, 403, "held by another worker"),
        ({"attempt": 1}, 400, "missing field 'worker_id'"),
    ]:
        status, out = stack.call(
            "/v1/daemon/result-chunk", chunk(inv, 3, "injected", **lease), tokens.rogue_daemon
        )
        assert status == status_wanted and text in out["error"], out
    # the real worker goes on; a consumer sees its values only, in order
    for seq in range(3, 5):
        status, _ = stack.call("/v1/daemon/result-chunk", chunk(inv, seq, seq, **real), tokens.victim_daemon)
        assert status == 200
    end = {"invocation_id": inv, "seq": 5, "bytes": frame(5, None, wire.FRAME_END), **real}
    assert stack.call("/v1/daemon/result-chunk", end, tokens.victim_daemon)[0] == 200
    url = f"{stack.url}/v1/producer/invocations/{inv}/result/stream?since=-1&timeout=10"
    reader = wire.FrameReader()
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {tokens.victim_producer}"}) as r:
        got = [f for chunk_ in r.iter_bytes() for f in reader.feed(chunk_)]
    assert [(f.seq, wire.unpack(f.body) if f.kind == wire.FRAME_VALUE else None) for f in got] == [
        (0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, None),
    ]  # fmt: skip


@pytest.fixture
def chunks(running: Running) -> dict[str, Any]:
    return {"worker_id": running.worker_id, "attempt": running.attempt}


def test_a_gap_in_the_frames_is_refused_with_the_expected_seq(
    stack: Stack, tokens: Tokens, running: Running, chunks: dict[str, Any]
) -> None:
    inv = running.invocation_id
    assert stack.call("/v1/daemon/result-chunk", chunk(inv, 0, 0, **chunks), tokens.victim_daemon)[0] == 200
    status, out = stack.call("/v1/daemon/result-chunk", chunk(inv, 5, 5, **chunks), tokens.victim_daemon)
    assert (status, out["expected_seq"]) == (409, 1)
    assert (
        out["error"] == f"frame 5 of {inv} skips ahead: the next frame is 1; send frames in order, each once"
    )
    # a duplicate of a journaled frame is the seed's duplicate answer, and keeps the first bytes
    status, out = stack.call(
        "/v1/daemon/result-chunk", chunk(inv, 0, "again", **chunks), tokens.victim_daemon
    )
    assert (status, out) == (200, {"ok": True, "seq": 0, "duplicate": True})
    assert stack.call("/v1/daemon/result-chunk", chunk(inv, 1, 1, **chunks), tokens.victim_daemon)[0] == 200


def test_frames_after_the_final_frame_are_refused(
    stack: Stack, tokens: Tokens, running: Running, chunks: dict[str, Any]
) -> None:
    inv = running.invocation_id
    end = {"invocation_id": inv, "seq": 0, "bytes": frame(0, None, wire.FRAME_END), **chunks}
    assert stack.call("/v1/daemon/result-chunk", end, tokens.victim_daemon)[0] == 200
    status, out = stack.call("/v1/daemon/result-chunk", chunk(inv, 1, "late", **chunks), tokens.victim_daemon)
    assert (status, out["expected_seq"]) == (409, 1) and "ended with final frame 0" in out["error"]


# -- who may run what (producer side) ----------------------------------------------------------


def test_a_daemon_bound_to_another_namespace_claims_nothing_of_team_a(stack: Stack, tokens: Tokens) -> None:
    queue = f"shared{new_ulid().lower()[-8:]}"
    inv = new_ulid()
    assert stack.call("/v1/producer/submit", submit_body(inv, queue), tokens.victim_producer)[0] == 200
    body = {"worker_id": new_ulid(), "queues": [queue], "max": 8, "timeout_s": 0}
    status, out = stack.call("/v1/daemon/poll", body, tokens.other_daemon)
    assert (status, out["commands"]) == (200, [])
    assert status_of(stack, tokens, inv)["state"] == "queued"
    status, out = stack.call("/v1/daemon/register", {**body, "namespace": "team-a"}, tokens.other_daemon)
    assert (status, out["error"]) == (
        403,
        "token 'team-b-daemon' is bound to namespace 'team-b', not 'team-a'",
    )


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/v1/producer/invocations/{inv}", None),
        ("POST", "/v1/producer/await", {"invocation_id": "{inv}", "timeout_s": 0}),
        ("GET", "/v1/producer/invocations/{inv}/result/stream?timeout=0", None),
        ("POST", "/v1/producer/invocations/{inv}/cancel", {}),
    ],
)
def test_another_namespaces_invocation_is_unknown_to_a_producer(
    stack: Stack, tokens: Tokens, method: str, path: str, body: Any
) -> None:
    inv = new_ulid()
    assert stack.call("/v1/producer/submit", submit_body(inv, "idle"), tokens.victim_producer)[0] == 200
    filled = {k: (v.format(inv=inv) if isinstance(v, str) else v) for k, v in (body or {}).items()}
    status, out = stack.call(path.format(inv=inv), filled, tokens.other_producer, method=method)
    assert (status, out["error"]) == (404, f"unknown invocation '{inv}'")  # as for an id that never existed
    assert status_of(stack, tokens, inv)["state"] == "queued"


def test_a_script_from_a_token_without_may_script_is_refused(stack: Stack, tokens: Tokens) -> None:
    inv = new_ulid()
    body = submit_body(inv, "scripts", run_config={"script": "id > owned.txt"})
    status, out = stack.call("/v1/producer/submit", body, tokens.no_script_producer)
    assert status == 403
    assert out["error"].startswith(
        "token 'team-a-plain' may not submit script invocations (its may_script flag is off)"
    )
    status, _ = stack.call(f"/v1/producer/invocations/{inv}", None, tokens.victim_producer, method="GET")
    assert status == 404  # nothing was queued
    assert stack.call("/v1/producer/submit", body, tokens.victim_producer)[0] == 200  # minted --may-script


@pytest.mark.parametrize(
    "run_config,message",
    [
        ({"timeout_s": -1}, "run_config.timeout_s must be a number of seconds above 0 and at most 2592000"),
        ({"timeout_s": math.nan}, "run_config.timeout_s must be a number of seconds above 0"),
        ({"timeout_s": 1e9}, "run_config.timeout_s must be a number of seconds above 0 and at most 2592000"),
        ({"max_attempts": -5}, "run_config.max_attempts must be a whole number from 1 to 100, got -5"),
        ({"max_attempts": 1e9}, "run_config.max_attempts must be a whole number from 1 to 100"),
        ({"priority": math.nan}, "run_config.priority must be a finite number from -9007199254740992"),
        ({"priority": 1e300}, "run_config.priority must be a finite number from -9007199254740992"),
        ({"resources": {"memory": -1}}, "run_config.resources.memory must be a positive size such as 512m"),
        ({"resources": {"memory": 0}}, "run_config.resources.memory must be a positive size such as 512m"),
        ({"resources": ["cpus"]}, "run_config.resources must be a map of at most 16 limits"),
        ({"resources": {"gpus": -1}}, "run_config.resources.gpus must be a whole number of GPUs from 0"),
        ({"selector": {"pool": "a\nb"}}, "run_config.selector entry 'pool'='a\\nb' is not a label a nymph"),
    ],
)
def test_bad_submit_values_are_400_naming_the_field_and_range(
    stack: Stack, tokens: Tokens, run_config: dict[str, Any], message: str
) -> None:
    inv = new_ulid()
    status, out = stack.call(
        "/v1/producer/submit", submit_body(inv, "checked", run_config=run_config), tokens.victim_producer
    )
    assert status == 400 and out["error"].startswith(message), out


# -- what the host keeps private ---------------------------------------------------------------


def test_the_store_and_its_directory_are_private(stack: Stack) -> None:
    def mode(name: str) -> int:
        return stat.S_IMODE((stack.data_dir / name).stat().st_mode)

    assert stat.S_IMODE(stack.data_dir.stat().st_mode) == 0o700
    files = ["lakeshore.db", "lakeshore.db-wal", "lakeshore.db-shm", "tokens.json"]
    assert {n: mode(n) for n in files} == dict.fromkeys(files, 0o600)
