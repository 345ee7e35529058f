"""Concurrency keys from the attacker's side: a key belongs to the namespace that submits it.

``@dls.udf(concurrency_key="db", max_concurrency=1)`` caps how many of a tenant's calls run at once
(a database that takes one writer). Another tenant that submits with the same key name must
neither take that room (its calls counted against tenant A's one slot, or A's against its own) nor
set A's ``max_concurrency`` (the latest submit's value wins, so a B submit with 100 would have
lifted A's cap). Through a real control plane over HTTP, with each tenant's own producer token;
``GET /v1/ops/queues`` shows each namespace its own keys only, and ``waiting`` names the key as the
tenant gave it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body

QUEUE = "writers"


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlPlane]:
    with running_control_plane(str(tmp_path / "keys.db")) as plane:
        yield plane


def _submit(cp: ControlPlane, token: str, **run_config: Any) -> str:
    inv = new_ulid()
    status, out = cp.call(
        "/v1/producer/submit", submit_body(inv, QUEUE, run_config={"queue": QUEUE, **run_config}), token
    )
    assert status == 200, out
    return inv


def _running(cp: ControlPlane, invs: list[str]) -> int:
    return sum(1 for i in invs if cp.store.get(i).state == "running")  # type: ignore[union-attr]


def test_another_tenants_key_of_the_same_name_is_a_key_of_its_own(cp: ControlPlane) -> None:
    a = cp.store.create_token("producer", "p-a", "team-a")
    b = cp.store.create_token("producer", "p-b", "team-b")
    ours = [_submit(cp, a, concurrency_key="db", max_concurrency=1) for _ in range(3)]
    # the attack: the same key name with a far larger cap, submitted after A's
    theirs = [_submit(cp, b, concurrency_key="db", max_concurrency=100) for _ in range(3)]

    status, out = cp.call(
        "/v1/daemon/register", {"worker_id": new_ulid(), "queues": [QUEUE]}, cp.daemon_token
    )
    assert status == 200, out  # a live worker serves the queue: what holds A back is its key alone
    claimed = cp.store.claim("w-1", [QUEUE], limit=10)
    assert len(claimed) == 4
    assert _running(cp, ours) == 1  # A's cap held: B's 100 did not lift it
    assert _running(cp, theirs) == 3  # and B's calls were not held back by A's one slot
    assert cp.store.claim("w-2", [QUEUE], limit=10) == []  # A's other two wait for its slot
    assert sorted(cp.store.key_limit_use()) == [("team-a/db", 1, 1), ("team-b/db", 100, 3)]

    # each tenant sees its own key by the name it gave; the admin sees both, by namespace
    seen_a = cp.client(a).get("/v1/ops/queues").json()["key_limits"]
    assert seen_a == [{"key": "db", "max_concurrency": 1, "running": 1}]
    seen_b = cp.client(b).get("/v1/ops/queues").json()["key_limits"]
    assert seen_b == [{"key": "db", "max_concurrency": 100, "running": 3}]
    admin = cp.client(cp.admin_token).get("/v1/ops/queues").json()["key_limits"]
    assert {k["key"] for k in admin} == {"team-a/db", "team-b/db"}

    # A's waiting call says which of its keys holds it back, in A's words
    held = next(i for i in ours if cp.store.get(i).state == "queued")  # type: ignore[union-attr]
    waiting = cp.client(a).get(f"/v1/ops/invocations/{held}").json()["waiting"]
    assert waiting["reason"] == "limit", waiting
    assert "concurrency key 'db' is at its max_concurrency: 1 of 1 running" in waiting["message"]
