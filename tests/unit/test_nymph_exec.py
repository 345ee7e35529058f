"""The exec path: the payload check (the seed's exact corruption message), and exec leases at the
seams: who publishes under which attempt, what the heartbeat reports, a lost lease."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from nymph.execjob import ExecJob, PayloadError, recover_execs, verify_sha256
from nymph.heartbeat import Heartbeat


def test_sha256_mismatch_raises_the_seeds_exact_message() -> None:
    data = b"payload bytes"
    got = hashlib.sha256(data).hexdigest()
    expected = "0" * 64
    with pytest.raises(PayloadError) as err:
        verify_sha256(data, expected)
    assert str(err.value) == f"payload corrupt: sha256 mismatch (expected {expected}, got {got})"


def test_matching_or_absent_sha256_passes() -> None:
    data = b"payload bytes"
    verify_sha256(data, hashlib.sha256(data).hexdigest())
    verify_sha256(data, None)


# --- exec leases: who publishes, under which attempt, and what the heartbeat reports ---------------

ID = "01HZZZZZZZZZZZZZZZZZZZZZZZ"
WORKER = "01HYYYYYYYYYYYYYYYYYYYYYYY"


def _fakes() -> tuple[Any, Any]:
    from tests.unit.dispatch_kit import FakeOutbox, FakeRunner

    return FakeRunner(), FakeOutbox()


def _job(tmp_path: Path, runner: Any, outbox: Any, **body: Any) -> ExecJob:
    from tests.unit.dispatch_kit import exec_ctx

    return ExecJob(
        exec_ctx(tmp_path, runner, outbox, WORKER),
        {"exec_id": ID, "namespace": "ns", "command": "true", **body},
    )


def test_the_result_names_the_claiming_worker_and_attempt(tmp_path: Path) -> None:
    runner, outbox = _fakes()
    job = _job(tmp_path, runner, outbox, attempt=2)
    assert job.running_entry == {"exec_id": ID, "attempt": 2}
    job.run()
    ((route, body),) = outbox.put_calls
    assert route == f"/v1/namespaces/ns/jobs/{ID}/result"
    assert body["worker_id"] == WORKER and body["attempt"] == 2 and body["exit_code"] == 0


def test_a_job_claimed_again_here_is_adopted_and_publishes_under_the_new_attempt(tmp_path: Path) -> None:
    runner, outbox = _fakes()
    job = _job(tmp_path, runner, outbox, attempt=1)
    assert job.adopt(1) is False and job.adopt("2") is False
    assert job.adopt(2) is True
    assert job.running_entry == {"exec_id": ID, "attempt": 2}
    job.run()
    assert outbox.put_calls[0][1]["attempt"] == 2


def test_a_lost_job_is_stopped_and_publishes_nothing(tmp_path: Path) -> None:
    runner, outbox = _fakes()
    job = _job(tmp_path, runner, outbox, attempt=1)
    job.lose()
    job.run()
    assert outbox.put_calls == []
    assert job.adopt(5) is False  # a lost job does not come back


def test_without_an_attempt_nothing_is_renewed_and_the_publish_names_the_worker(tmp_path: Path) -> None:
    """A control plane from before exec leases sends no attempt."""
    runner, outbox = _fakes()
    job = _job(tmp_path, runner, outbox)
    assert job.running_entry is None
    job.run()
    body = outbox.put_calls[0][1]
    assert body["worker_id"] == WORKER and "attempt" not in body


def test_recovery_publishes_as_the_claimer(tmp_path: Path) -> None:
    runner, outbox = _fakes()
    left = tmp_path / "exec" / ID
    left.mkdir(parents=True)
    (left / "exec.json").write_text(json.dumps({"exec_id": ID, "namespace": "ns", "attempt": 3}))
    assert recover_execs(tmp_path, runner, outbox, WORKER) == 1
    ((_, body),) = outbox.put_calls
    assert (body["worker_id"], body["attempt"], body["exit_code"]) == (WORKER, 3, -1)


def test_the_heartbeat_reports_exec_jobs_and_hands_them_to_on_answer() -> None:
    sent: list[dict[str, Any]] = []
    answers: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []

    class Client:
        def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
            sent.append(body)
            return {"ok": True, "lost": [ID]}

    inv = {"invocation_id": WORKER, "attempt": 1}
    ex = {"exec_id": ID, "attempt": 2}
    hb = Heartbeat(
        Client(),  # type: ignore[arg-type]
        WORKER,
        10.0,
        running=lambda: [inv],
        free_slots=lambda: 0,
        running_exec=lambda: [ex],
        on_answer=lambda answer, reported: answers.append((answer, reported)),
    )
    hb.beat()
    assert sent == [{"worker_id": WORKER, "running": [inv], "running_exec": [ex], "free_slots": 0}]
    assert answers == [({"ok": True, "lost": [ID]}, [inv, ex])]


def test_the_agent_reports_its_exec_jobs_and_stops_one_whose_lease_is_lost(tmp_path: Path) -> None:
    from tests.unit.dispatch_kit import make_agent

    runner, outbox = _fakes()
    agent = make_agent(tmp_path)
    job = _job(tmp_path, runner, outbox, attempt=2)
    agent.jobs._table[job.key] = job
    assert agent.running_exec() == [{"exec_id": ID, "attempt": 2}]
    agent._on_heartbeat({"lost": [ID]}, [{"exec_id": ID, "attempt": 1}])
    assert not job.lost  # attempt 2 was claimed after the beat that reported attempt 1
    agent._on_heartbeat({"lost": [ID]}, [{"exec_id": ID, "attempt": 2}])
    assert job.lost and job.stop_request is not None
