"""Issue 31's control-plane attacks, made by one tenant against another on the real stack.

Two namespaces, ``team-a`` (the victim) and ``team-b`` (the attacker), each with a producer token
minted by ``lakeshore token create``; ``lakeshore server`` runs as the README starts it (a
subprocess on SQLite). Each test plays team B over HTTP and asserts what B sees and that nothing
of team A changed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import submit_body
from tests.security.conftest import Stack


@dataclass
class Tenants:
    a: str  # producer of team-a
    b: str  # producer of team-b


@pytest.fixture(scope="module")
def tenants(stack: Stack) -> Tenants:
    return Tenants(
        a=stack.token("producer", "team-a", "--namespace", "team-a"),
        b=stack.token("producer", "team-b", "--namespace", "team-b"),
    )


def _deep(levels: int) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    cur = doc
    for _ in range(levels):
        cur["x"] = {}
        cur = cur["x"]
    return doc


def _submit(stack: Stack, token: str, **extra: Any) -> tuple[str, int, Any]:
    inv = new_ulid()
    body = submit_body(inv, "q-tenants")
    body.update(extra)
    status, out = stack.call("/v1/producer/submit", body, token)
    return inv, status, out


def test_a_deep_document_is_a_400_naming_its_field_and_fails_no_other_tenants_submit(
    stack: Stack, tenants: Tenants
) -> None:
    """B's run_config nested 500 deep (and a deep code_context, resources, labels) answers 400
    naming the field, logs one line without a traceback, and 30 concurrent submits of A, made
    while B's land, all commit."""
    before = stack.log.read_text()
    for field, value in (
        ("run_config", {"queue": "q-tenants", "deep": _deep(500)}),
        ("run_config", {"queue": "q-tenants", "resources": _deep(500)}),
        ("code_context", _deep(500)),
        ("run_config", {"queue": "q-tenants", "big": "x" * 300_000}),
    ):
        _, status, out = _submit(stack, tenants.b, **{field: value})
        assert status == 400, out
        assert f"field '{field}" in out["error"]
        assert "deeper than 32 levels" in out["error"] or "over the limit" in out["error"]
    _, status, out = _submit(stack, tenants.b, run_config={"queue": "q-tenants", "resources": _deep(500)})
    assert "run_config.resources" in out["error"]
    worker = {"worker_id": new_ulid(), "queues": ["q-tenants"], "labels": _deep(500)}
    status, out = stack.call("/v1/daemon/register", worker, stack.daemon)
    assert status == 400 and "field 'labels.x'" in out["error"]

    answers: list[tuple[str, int]] = []
    lock = threading.Lock()

    def victim() -> None:
        inv, status, _ = _submit(stack, tenants.a)
        with lock:
            answers.append((inv, status))

    def attacker() -> None:
        _submit(stack, tenants.b, run_config={"deep": _deep(500)})

    threads = [threading.Thread(target=victim) for _ in range(30)]
    threads += [threading.Thread(target=attacker) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [s for _, s in answers] == [200] * 30
    for inv, _ in answers:
        status, out = stack.call(f"/v1/producer/invocations/{inv}", None, tenants.a, method="GET")
        assert status == 200 and out["state"] == "queued"
    logged = stack.log.read_text()[len(before) :]
    assert "Traceback" not in logged
    refusals = [line for line in logged.splitlines() if "nests deeper than" in line]
    assert len(refusals) == 15  # one line per refused request (4 + 1 register + 10 concurrent)
    assert all(len(line) < 400 for line in refusals)


def test_a_parent_of_another_namespace_is_unknown_to_the_submitter(stack: Stack, tenants: Tenants) -> None:
    """B submits with A's invocation as its parent: 404 as for an unknown id; A's status lists
    no child of B's, and A's cancel cancels nothing of B's. B's own parent is accepted."""
    victim, status, _ = _submit(stack, tenants.a)
    assert status == 200
    _, status, out = _submit(stack, tenants.b, parent_invocation_id=victim)
    assert status == 404 and "unknown parent_invocation_id" in out["error"]
    _, status, out = _submit(stack, tenants.b, parent_invocation_id=new_ulid())
    assert status == 404 and "unknown parent_invocation_id" in out["error"]
    batch = {"submits": [submit_body(new_ulid(), "q-tenants", parent_invocation_id=victim)]}
    status, out = stack.call("/v1/producer/submit-batch", batch, tenants.b)
    assert status == 200 and out["results"][0]["status"] == 404
    status, out = stack.call(f"/v1/producer/invocations/{victim}", None, tenants.a, method="GET")
    assert status == 200 and not out.get("children")
    own, status, _ = _submit(stack, tenants.b)
    _, status, out = _submit(stack, tenants.b, parent_invocation_id=own)
    assert status == 200, out
