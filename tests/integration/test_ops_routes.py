"""The operator routes (``/v1/ops/*``), the store gauges of ``/metrics``, the ``metrics`` token kind,
text error bodies and submit's "no worker" warning, over real HTTP on SQLite and PostgreSQL.

Most tests take the attacker's side too: a token of the wrong kind, another namespace's objects.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import ControlPlane, submit_body


def _get(cp: ControlPlane, path: str, token: str | None, **params: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(cp.url + path, params=params, headers=headers, timeout=30)
    return r.status_code, r.json()


def _submit(cp: ControlPlane, token: str, queue: str = "q") -> tuple[str, dict[str, Any]]:
    inv = new_ulid()
    status, out = cp.call("/v1/producer/submit", submit_body(inv, queue), token)
    assert status == 200, out
    return inv, out


def _poll(cp: ControlPlane, worker: str, queues: list[str], token: str | None = None) -> list[Any]:
    status, out = cp.call(
        "/v1/daemon/poll", {"worker_id": worker, "queues": queues, "timeout_s": 0}, token or cp.daemon_token
    )
    assert status == 200, out
    return list(out["commands"])


def _register(cp: ControlPlane, queues: list[str], token: str | None = None, **info: Any) -> str:
    worker = new_ulid()
    body = {"worker_id": worker, "hostname": "node-1", "version": "0.1.0", "runner": "process",
            "queues": queues, "labels": {"zone": "a"}, "slots": 4, **info}  # fmt: skip
    status, out = cp.call("/v1/daemon/register", body, token or cp.daemon_token)
    assert status == 200, out
    return worker


def test_queues_workers_and_invocations_for_an_admin(control_plane: ControlPlane) -> None:
    cp = control_plane
    worker = _register(cp, ["q", "spare"])
    first, _ = _submit(cp, cp.producer_token)
    second, _ = _submit(cp, cp.producer_token)
    (run,) = _poll(cp, worker, ["q"])
    assert run["body"]["invocation_id"] == first

    status, out = _get(cp, "/v1/ops/queues", cp.admin_token)
    assert status == 200
    by_name = {q["name"]: q for q in out["queues"]}
    assert by_name["q"]["queued"] == 1 and by_name["q"]["running"] == 1
    assert by_name["q"]["counts"]["succeeded"] == 0 and by_name["q"]["workers_live"] == 1
    assert by_name["q"]["oldest_queued_age_s"] is not None and by_name["q"]["oldest_queued_age_s"] >= 0
    assert by_name["spare"]["queued"] == 0 and by_name["spare"]["workers_live"] == 1

    status, out = _get(cp, "/v1/ops/workers", cp.admin_token)
    assert status == 200
    (w,) = out["workers"]
    assert w["worker_id"] == worker and w["hostname"] == "node-1" and w["runner"] == "process"
    assert w["queues"] == ["q", "spare"] and w["slots"] == 4 and w["busy"] == 1
    assert w["version"] == "0.1.0" and w["labels"] == {"zone": "a"} and w["live"] is True

    status, out = _get(cp, "/v1/ops/invocations", cp.admin_token)
    assert status == 200 and [i["invocation_id"] for i in out["invocations"]] == [second, first]
    status, out = _get(cp, "/v1/ops/invocations", cp.admin_token, state="running")
    assert [(i["invocation_id"], i["worker_id"]) for i in out["invocations"]] == [(first, worker)]
    status, out = _get(cp, "/v1/ops/invocations", cp.admin_token, queue="spare")
    assert status == 200 and out["invocations"] == []
    status, out = _get(cp, "/v1/ops/invocations", cp.admin_token, since=time.time() + 3600)
    assert status == 200 and out["invocations"] == []


def test_invocation_listing_pages_with_a_cursor(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    ids = [_submit(cp, cp.producer_token)[0] for _ in range(5)]
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        status, out = _get(cp, "/v1/ops/invocations", cp.producer_token, **params)
        assert status == 200 and len(out["invocations"]) <= 2
        seen += [i["invocation_id"] for i in out["invocations"]]
        pages += 1
        cursor = out["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True) and pages == 3


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({"state": "sleeping"}, "unknown state 'sleeping'"),
        ({"limit": "many"}, "must be a number"),
        ({"cursor": "not-a-ulid"}, "invalid invocation cursor"),
        ({"queue": "bad queue"}, "invalid queue"),
    ],
)
def test_bad_listing_parameters_are_400(
    sqlite_control_plane: ControlPlane, params: dict[str, str], fragment: str
) -> None:
    status, out = _get(
        sqlite_control_plane, "/v1/ops/invocations", sqlite_control_plane.admin_token, **params
    )
    assert status == 400 and fragment in out["error"]


def test_detail_has_attempts_timings_and_the_traceback(control_plane: ControlPlane) -> None:
    cp = control_plane
    worker = _register(cp, ["q"])
    inv, _ = _submit(cp, cp.producer_token)
    _poll(cp, worker, ["q"])
    cp.store.expire_leases(now=time.time() + 3600)  # attempt 1 lapses: requeued
    (run,) = _poll(cp, worker, ["q"])
    assert run["body"]["attempt"] == 2
    status, out = cp.call(
        "/v1/daemon/result-chunk",
        {
            "invocation_id": inv,
            "seq": 0,
            "bytes": b"\x94\x01\x00\xc4\x00\x80",
            "final": False,
            "attempt": 2,
            "worker_id": worker,
        },
        cp.daemon_token,
    )
    assert status == 200, out
    error = {"type": "ValueError", "message": "boom", "traceback": "Traceback ...\nValueError: boom\n"}
    status, out = cp.daemon(
        "/v1/daemon/ack",
        {"invocation_id": inv, "state": "failed", "result_blob": b"", "error": error,
         "worker_id": worker, "attempt": 2},
    )  # fmt: skip
    assert status == 200, out

    status, out = _get(cp, f"/v1/ops/invocations/{inv}", cp.producer_token)
    assert status == 200
    assert out["state"] == "failed" and out["terminal"] is True and out["error"] == error
    assert [(a["attempt"], a["outcome"]) for a in out["attempts"]] == [(1, "lease_expired"), (2, "failed")]
    assert out["attempts"][1]["worker_id"] == worker
    t = out["timings"]
    assert t["wait_s"] >= 0 and t["run_s"] >= 0 and t["total_s"] >= t["run_s"]
    assert out["frames"]["count"] == 1 and out["frames"]["last_seq"] == 0
    assert out["run_config"]["queue"] == "q" and out["namespace"] == "default"
    status, out = _get(cp, "/v1/ops/invocations", cp.producer_token)
    assert out["invocations"][0]["error"] == {"type": "ValueError", "message": "boom"}  # no traceback


def test_namespaces_see_only_their_own(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    producer_a = cp.store.create_token("producer", "prod-a", "team-a")
    ns_a = cp.store.create_token("namespace", "ns-a", "team-a")
    ns_b = cp.store.create_token("namespace", "ns-b", "team-b")
    daemon_b = cp.store.create_token("daemon", "daemon-b", "team-b")
    mine, _ = _submit(cp, producer_a, "shared")
    theirs, _ = _submit(cp, cp.producer_token, "secret-queue")  # namespace "default"
    worker_b = _register(cp, ["b-only"], daemon_b, namespace="team-b")
    shared = _register(cp, ["shared"])

    for token in (producer_a, ns_a):
        status, out = _get(cp, "/v1/ops/invocations", token)
        assert status == 200 and [i["invocation_id"] for i in out["invocations"]] == [mine]
        status, out = _get(cp, f"/v1/ops/invocations/{theirs}", token)
        assert status == 404 and out["error"] == f"unknown invocation '{theirs}'"
        status, out = cp.json("POST", f"/v1/ops/invocations/{theirs}/cancel", {}, token)
        assert status == 404
        status, out = _get(cp, "/v1/ops/queues", token)
        assert [q["name"] for q in out["queues"]] == ["shared"]
        status, out = _get(cp, "/v1/ops/workers", token)
        assert [w["worker_id"] for w in out["workers"]] == [shared]  # not team-b's worker
        status, out = _get(cp, "/v1/ops/invocations", token, namespace="default")
        assert status == 403 and "team-a" in out["error"]
    assert cp.store.get(theirs).state == "queued"  # type: ignore[union-attr]

    status, out = _get(cp, "/v1/ops/workers", ns_b)
    assert sorted(w["worker_id"] for w in out["workers"]) == sorted([worker_b, shared])
    status, out = _get(cp, "/v1/ops/invocations", ns_b)
    assert out["invocations"] == []

    status, out = _get(cp, "/v1/ops/invocations", cp.admin_token)
    assert sorted(i["invocation_id"] for i in out["invocations"]) == sorted([mine, theirs])
    status, out = _get(cp, "/v1/ops/invocations", cp.admin_token, namespace="team-a")
    assert [i["invocation_id"] for i in out["invocations"]] == [mine]

    status, out = cp.json("POST", f"/v1/ops/invocations/{mine}/cancel", {}, ns_a)
    assert status == 200 and out == {"invocation_id": mine, "state": "cancelled"}


@pytest.mark.parametrize("kind", ["daemon", "metrics"])
def test_daemon_and_metrics_tokens_may_not_list(sqlite_control_plane: ControlPlane, kind: str) -> None:
    cp = sqlite_control_plane
    token = cp.store.create_token(kind, f"a-{kind}")
    inv, _ = _submit(cp, cp.producer_token)
    for path in ("/v1/ops/queues", "/v1/ops/workers", "/v1/ops/invocations", f"/v1/ops/invocations/{inv}"):
        status, out = _get(cp, path, token)
        assert status == 403 and f"is a {kind} token" in out["error"], path
    status, out = cp.json("POST", f"/v1/ops/invocations/{inv}/cancel", {}, token)
    assert status == 403
    status, _ = _get(cp, "/v1/ops/queues", None)
    assert status == 401
    assert cp.store.get(inv).state == "queued"  # type: ignore[union-attr]


def test_whoami_names_the_token(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    status, out = _get(cp, "/v1/ops/whoami", cp.admin_token)
    assert status == 200 and out == {"kind": "admin", "name": "test-admin", "namespace": None}
    status, out = cp.json("POST", "/v1/ops/whoami", {}, cp.daemon_token)
    assert status == 200 and out["kind"] == "daemon"


def test_metrics_token_scrapes_store_gauges(control_plane: ControlPlane) -> None:
    cp = control_plane
    token = cp.store.create_token("metrics", "prometheus")
    worker = _register(cp, ["q"])
    _submit(cp, cp.producer_token)
    _submit(cp, cp.producer_token)
    _submit(cp, cp.producer_token, "other")
    _poll(cp, worker, ["q"])
    r = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = set(r.text.splitlines())
    assert 'lakeshore_queue_depth{queue="q",state="queued"} 1.0' in lines
    assert 'lakeshore_queue_depth{queue="q",state="running"} 1.0' in lines
    assert 'lakeshore_queue_depth{queue="other",state="queued"} 1.0' in lines
    assert 'lakeshore_queue_workers_live{queue="q"} 1.0' in lines
    assert 'lakeshore_queue_workers_live{queue="other"} 0.0' in lines
    assert "lakeshore_workers_live 1.0" in lines
    assert 'lakeshore_invocations{queue="q",state="succeeded"} 0.0' in lines
    age = next(line for line in lines if line.startswith('lakeshore_queue_oldest_queued_seconds{queue="q"}'))
    assert float(age.split()[-1]) >= 0
    # read-only: the metrics token reaches nothing else
    status, _ = cp.call("/v1/producer/submit", submit_body(new_ulid()), token)
    assert status == 403


def _samples(cp: ControlPlane, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_claim_latency_and_frames_appended_by_kind_over_http(control_plane: ControlPlane) -> None:
    """``lakeshore_claim_latency_seconds`` observes submit -> first claim per queue;
    ``lakeshore_frames_appended_total`` counts journaled frames by kind (repeats not counted)."""
    from dreamlake.lakeshore import wire

    cp = control_plane
    token = cp.store.create_token("metrics", "prometheus")
    worker = _register(cp, ["lat"])
    invs = [_submit(cp, cp.producer_token, "lat")[0] for _ in range(2)]
    time.sleep(0.3)
    claimed = [c["body"]["invocation_id"] for c in _poll(cp, worker, ["lat"])]
    claimed += [c["body"]["invocation_id"] for c in _poll(cp, worker, ["lat"])]
    assert sorted(claimed) == sorted(invs)
    got = _samples(cp, token)
    assert got[("lakeshore_claim_latency_seconds_count", (("queue", "lat"),))] == 2
    assert got[("lakeshore_claim_latency_seconds_sum", (("queue", "lat"),))] >= 0.6  # both waited >= 0.3 s
    assert got[("lakeshore_claim_latency_seconds_bucket", (("le", "0.1"), ("queue", "lat")))] == 0
    # the group commit's time per kind of write: these two submits and the polls that claimed them
    assert got[("lakeshore_write_seconds_count", (("kind", "submit"),))] >= 2
    assert got[("lakeshore_write_seconds_count", (("kind", "poll"),))] >= 2
    assert got[("lakeshore_write_seconds_sum", (("kind", "submit"),))] > 0

    frames = [
        wire.encode_frame(wire.FRAME_LOG, 0, b"out\n", {"stream": "stdout"}),
        wire.encode_frame(wire.FRAME_LOG, 1, b"err\n", {"stream": "stderr"}),
        wire.encode_frame(wire.FRAME_VALUE, 2, wire.pack(1)),
        wire.encode_frame(wire.FRAME_END, 3, wire.pack(None)),
    ]
    body = {"invocation_id": invs[0], "attempt": 1, "worker_id": worker, "frames": frames}
    for _ in range(2):  # the second time every frame is a repeat
        status, out = cp.call("/v1/daemon/result-chunks", body, cp.daemon_token)
        assert status == 200, out
    got = _samples(cp, token)

    def appended(kind: str, owner: str = "invocation") -> float:
        return got.get(("lakeshore_frames_appended_total", (("kind", kind), ("owner", owner))), 0.0)

    assert (appended("log"), appended("value"), appended("end"), appended("error")) == (2, 1, 1, 0)
    status, out = cp.call("/v1/producer/topics/ticks/post", {"body": wire.pack(1)}, cp.producer_token)
    assert status == 200, out
    got = _samples(cp, token)
    assert appended("value", "topic") == 1 and appended("value") == 1


def test_text_clients_get_text_errors(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    r = httpx.get(cp.url + "/metrics", headers={"Accept": "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
    assert r.status_code == 401 and r.headers["content-type"].startswith("text/plain")
    assert r.text.startswith("missing bearer token")
    r = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.producer_token}"})
    assert r.status_code == 403 and "needs admin or metrics" in r.text
    r = httpx.get(cp.url + f"/v1/producer/invocations/{new_ulid()}", headers={"Accept": "text/plain"})
    assert r.status_code == 401 and r.headers["content-type"].startswith("text/plain")
    r = httpx.get(cp.url + f"/v1/producer/invocations/{new_ulid()}", headers={"Accept": "application/json"})
    assert r.status_code == 401 and "missing bearer token" in r.json()["error"]
    status, out = cp.call(f"/v1/producer/invocations/{new_ulid()}", None, None, method="GET")
    assert status == 401 and "missing bearer token" in out["error"]  # msgpack clients keep msgpack


def test_submit_to_an_unserved_queue_warns(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    _register(cp, ["demo"])
    inv, out = _submit(cp, cp.producer_token, "mnie")
    assert out["warning"] == "no worker has polled queue 'mnie' in the last 5 min; known queues: demo"
    status, out = cp.producer("/v1/producer/await", {"invocation_id": inv, "timeout_s": 0})
    assert status == 200 and out["state"] == "pending" and "queue 'mnie'" in out["warning"]
    _, out = _submit(cp, cp.producer_token, "demo")
    assert "warning" not in out
    _register(cp, ["mnie"])  # a worker for it appears: no more warning, at once
    _, out = _submit(cp, cp.producer_token, "mnie")
    assert "warning" not in out


@pytest.mark.parametrize(
    "kind,ok,says",
    [
        ("daemon", True, "accepted as a daemon token"),
        ("admin", True, "it is an admin token"),
    ],
)
def test_nymph_doctor_names_the_token_kind(
    sqlite_control_plane: ControlPlane, tmp_path: Any, kind: str, ok: bool, says: str
) -> None:
    from nymph import config as nymph_config
    from nymph.doctor import run_checks

    cp = sqlite_control_plane
    token = {"daemon": cp.daemon_token, "admin": cp.admin_token}[kind]
    cfg = nymph_config.resolve(
        {"server": cp.url, "token": token, "workdir": tmp_path / "w", "state_dir": tmp_path / "s"}, environ={}
    )
    (check,) = [c for c in run_checks(cfg) if c.name == "token"]
    assert check.ok is ok and says in check.detail
    assert "accepted as a daemon token" not in check.detail or kind == "daemon"
