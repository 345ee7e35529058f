"""Namespace routes (JSON, seed 003) over real HTTP: exec, job results, presign, pin."""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.payloads import PayloadConfig, PayloadStore
from tests.integration.conftest import ControlPlane, running_control_plane
from tests.integration.s3_fixture import S3Service


@pytest.fixture
def ns_token(sqlite_control_plane: ControlPlane) -> str:
    return sqlite_control_plane.store.create_token("namespace", "ns-a", "ns-a")


def _poll_exec(cp: ControlPlane, worker: str, queue: str = "default") -> dict[str, Any]:
    status, out = cp.daemon("/v1/daemon/poll", {"worker_id": worker, "queues": [queue], "timeout_s": 2})
    assert status == 200
    (cmd,) = out["commands"]
    return cmd  # type: ignore[no-any-return]


def test_exec_inline_round_trip(sqlite_control_plane: ControlPlane, ns_token: str) -> None:
    cp = sqlite_control_plane
    payload = b"\x00\x01binary"
    status, out = cp.json(
        "POST",
        "/v1/namespaces/ns-a/exec",
        {"command": "cat", "payloadInline": base64.b64encode(payload).decode()},
        ns_token,
    )
    assert status == 202 and set(out) == {"exec_id", "worker_id"} and out["worker_id"] is None
    exec_id = out["exec_id"]
    status, out = cp.json("GET", f"/v1/namespaces/ns-a/jobs/{exec_id}/result?wait=0.2", None, ns_token)
    assert (status, out) == (202, {"exec_id": exec_id, "state": "pending"})
    worker = new_ulid()
    cmd = _poll_exec(cp, worker)
    assert cmd["kind"] == "exec"
    assert cmd["body"] == {
        "exec_id": exec_id,
        "namespace": "ns-a",
        "command": "cat",
        "payload_inline": payload,
        "payload_ref": None,
        "timeout_s": None,
        "attempt": 1,
    }
    answer: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: answer.update(
            r=cp.json("GET", f"/v1/namespaces/ns-a/jobs/{exec_id}/result?wait=20", None, ns_token)
        )
    )
    t.start()
    time.sleep(0.2)
    status, out = cp.json(
        "POST",
        f"/v1/namespaces/ns-a/jobs/{exec_id}/result",
        {"exit_code": 0, "stdout": "ok\n", "stderr": "", "worker_id": worker, "attempt": 1},
        cp.daemon_token,
    )
    assert (status, out) == (200, {"ok": True})
    t.join(20)
    assert answer["r"] == (
        200,
        {
            "exec_id": exec_id,
            "state": "done",
            "exit_code": 0,
            "stdout": "ok\n",
            "stderr": "",
            "resultInline": None,
            "resultRef": None,
        },
    )


def test_only_the_claiming_daemon_publishes_an_exec_result(
    sqlite_control_plane: ControlPlane, ns_token: str
) -> None:
    """The review's finding: any unbound daemon token could publish another daemon's result."""
    cp = sqlite_control_plane
    _, out = cp.json("POST", "/v1/namespaces/ns-a/exec", {"command": "true"}, ns_token)
    exec_id = out["exec_id"]
    route = f"/v1/namespaces/ns-a/jobs/{exec_id}/result"
    claimer, intruder = new_ulid(), new_ulid()
    assert _poll_exec(cp, claimer)["body"]["exec_id"] == exec_id
    forged = {"exit_code": 0, "stdout": "forged", "stderr": ""}
    status, out = cp.json("POST", route, {**forged, "worker_id": intruder}, cp.daemon_token)
    assert status == 409 and out["ok"] is False and "only the daemon that claimed it" in out["error"]
    status, out = cp.json("POST", route, forged, cp.daemon_token)  # no worker_id: refused
    assert status == 400 and "worker_id" in out["error"]
    status, out = cp.json("POST", route, {**forged, "worker_id": claimer, "attempt": 2}, cp.daemon_token)
    assert status == 409 and "superseded" in out["error"]
    status, out = cp.json("GET", route, None, ns_token)
    assert (status, out["state"]) == (202, "pending")
    real = {"exit_code": 0, "stdout": "real", "stderr": "", "worker_id": claimer, "attempt": 1}
    assert cp.json("POST", route, real, cp.daemon_token) == (200, {"ok": True})
    assert cp.json("POST", route, real, cp.daemon_token) == (200, {"ok": True, "duplicate": True})
    status, out = cp.json("GET", route, None, ns_token)
    assert (status, out["stdout"]) == (200, "real")
    # an admin publishes without a worker_id (an operator settling a job by hand)
    _, out = cp.json("POST", "/v1/namespaces/ns-a/exec", {"command": "true"}, ns_token)
    admin_route = f"/v1/namespaces/ns-a/jobs/{out['exec_id']}/result"
    _poll_exec(cp, claimer)
    assert cp.json("POST", admin_route, {"exit_code": 3}, cp.admin_token) == (200, {"ok": True})


def test_exec_max_attempts_is_checked(sqlite_control_plane: ControlPlane, ns_token: str) -> None:
    cp = sqlite_control_plane
    for bad in (0, 101, "3"):
        status, out = cp.json(
            "POST", "/v1/namespaces/ns-a/exec", {"command": "x", "max_attempts": bad}, ns_token
        )
        assert status == 400 and "max_attempts" in out["error"]
    _, out = cp.json("POST", "/v1/namespaces/ns-a/exec", {"command": "x", "max_attempts": 1}, ns_token)
    assert cp.store.get_exec("ns-a", out["exec_id"])["max_attempts"] == 1  # type: ignore[index]


def test_exec_with_payload_ref_and_target_worker(sqlite_control_plane: ControlPlane, ns_token: str) -> None:
    cp = sqlite_control_plane
    worker = new_ulid()
    key = "payloads/ns-a/2026/01/02/" + new_ulid() + "/args"
    ref = {"bucket": "b", "key": key, "size": 10, "sha256": "0" * 64}
    status, out = cp.json(
        "POST",
        "/v1/namespaces/ns-a/exec",
        {"command": "run", "payloadRef": ref, "queue": "batch", "worker_id": worker, "timeout_s": 30},
        ns_token,
    )
    assert status == 202 and out["worker_id"] == worker
    cmd = _poll_exec(cp, worker, "batch")
    assert cmd["body"]["payload_ref"] == ref and cmd["body"]["timeout_s"] == 30


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"command": "x", "payloadInline": "@@not base64@@"}, "base64"),
        (
            {
                "command": "x",
                "payloadInline": "AA==",
                "payloadRef": {"bucket": "b", "key": "payloads/k", "size": 1},
            },
            "mutually exclusive",
        ),
        ({"command": "x", "payloadRef": {"bucket": "b", "key": "exec/2026/out", "size": 1}}, "payloads/"),
        (
            {"command": "x", "payloadRef": {"bucket": "b", "key": "payloads/../exec/x", "size": 1}},
            "payload key",
        ),
        ({"payloadInline": "AA=="}, "missing field 'command'"),
        ({"command": "x", "worker_id": "nope"}, "ULID"),
    ],
)
def test_exec_refuses_bad_bodies(
    sqlite_control_plane: ControlPlane, ns_token: str, body: Any, needle: str
) -> None:
    status, out = sqlite_control_plane.json("POST", "/v1/namespaces/ns-a/exec", body, ns_token)
    assert status == 400 and needle in out["error"]


def test_unknown_job_is_404_and_bad_json_400(sqlite_control_plane: ControlPlane, ns_token: str) -> None:
    cp = sqlite_control_plane
    status, _ = cp.json("GET", f"/v1/namespaces/ns-a/jobs/{new_ulid()}/result", None, ns_token)
    assert status == 404
    status, _ = cp.json(
        "POST",
        f"/v1/namespaces/ns-a/jobs/{new_ulid()}/result",
        {"exit_code": 0, "worker_id": new_ulid()},
        cp.daemon_token,
    )
    assert status == 404
    status, out = cp.json("POST", "/v1/namespaces/ns-a/exec", None, ns_token, raw=b"{not json")
    assert status == 400 and "JSON" in out["error"]


def test_presign_without_bucket_is_501(sqlite_control_plane: ControlPlane, ns_token: str) -> None:
    status, out = sqlite_control_plane.json(
        "POST", "/v1/namespaces/ns-a/payloads/presign", {"op": "put", "size": 10}, ns_token
    )
    assert status == 501 and out["error"].startswith("payload store not configured")


def test_presign_delegates_to_payload_store(tmp_path: Any) -> None:
    config = PayloadConfig(
        bucket="lake", endpoint="http://127.0.0.1:9", access_key="ak", secret_key="sk", max_payload_bytes=1000
    )
    with running_control_plane(str(tmp_path / "s.db"), payloads=PayloadStore(config)) as cp:
        job = new_ulid()
        status, out = cp.json(
            "POST",
            "/v1/namespaces/ns-a/payloads/presign",
            {"op": "put", "size": 10, "jobId": job, "kind": "args"},
            cp.daemon_token,
        )
        assert status == 200 and set(out) == {"url", "bucket", "key", "expires_at"}
        assert (
            out["bucket"] == "lake"
            and out["key"].startswith("payloads/")
            and out["key"].endswith(f"/{job}/args")
        )
        status, out = cp.json(
            "POST", "/v1/namespaces/ns-a/payloads/presign", {"op": "put", "size": 1001}, cp.admin_token
        )
        assert status == 413
        status, out = cp.json(
            "POST", "/v1/namespaces/ns-a/payloads/presign", {"op": "get", "key": "exec/x"}, cp.admin_token
        )
        assert status == 400
        status, out = cp.json(
            "POST", "/v1/namespaces/ns-a/payloads/presign", {"op": "delete"}, cp.admin_token
        )
        assert status == 400


def test_pin_sets_and_clears(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    status, out = cp.json("PUT", "/v1/namespaces/ns-a/pin", {"nymph_version": "0.1.4"}, cp.admin_token)
    assert (status, out) == (200, {"namespace": "ns-a", "nymph_version": "0.1.4"})
    assert cp.store.pinned_version("ns-a") == "0.1.4"
    status, _ = cp.json("PUT", "/v1/namespaces/ns-a/pin", {"nymph_version": None}, cp.admin_token)
    assert status == 200 and cp.store.pinned_version("ns-a") is None
    status, _ = cp.json("PUT", "/v1/namespaces/ns-a/pin", {"nymph_version": 3}, cp.admin_token)
    assert status == 400


def test_presign_route_against_a_signature_checking_s3(tmp_path: Any, s3_service: S3Service) -> None:
    """Flows 2 and 3 of seed 003 through the HTTP routes, with a real S3 that checks signatures."""
    import httpx

    payloads = PayloadStore(PayloadConfig.from_env(s3_service.env(MAX_PAYLOAD_BYTES="4096")))
    with running_control_plane(str(tmp_path / "s.db"), payloads=payloads) as cp:
        ns_tok = cp.store.create_token("namespace", "ns-s3", "ns-s3")
        data = b"\x93\x01\x02\x03" * 100
        status, put = cp.json(
            "POST", "/v1/namespaces/ns-s3/payloads/presign", {"op": "put", "size": len(data)}, ns_tok
        )
        assert status == 200 and put["bucket"] == s3_service.bucket and put["key"].startswith("payloads/")
        assert put["key"].endswith("/args") and put["expires_at"].endswith("Z")
        assert httpx.put(put["url"], content=data + b"x").status_code == 403  # signed Content-Length
        assert httpx.put(put["url"].replace("Signature=", "Signature=0"), content=data).status_code == 403
        assert httpx.put(put["url"], content=data).status_code == 200
        ref = {"bucket": put["bucket"], "key": put["key"], "size": len(data), "sha256": "0" * 64}
        status, out = cp.json(
            "POST", "/v1/namespaces/ns-s3/exec", {"command": "true", "payloadRef": ref}, ns_tok
        )
        assert status == 202
        cmd = _poll_exec(cp, new_ulid())
        assert cmd["body"]["payload_ref"] == ref and cmd["body"]["payload_inline"] is None
        status, got = cp.json(
            "POST", "/v1/namespaces/ns-s3/payloads/presign", {"op": "get", "key": ref["key"]}, cp.daemon_token
        )
        assert status == 200 and got["key"] == ref["key"]
        assert httpx.get(got["url"]).content == data
        assert httpx.get(got["url"].replace(ref["key"], ref["key"] + "x")).status_code == 403
        status, out = cp.json(
            "POST", "/v1/namespaces/ns-s3/payloads/presign", {"op": "put", "size": 4097}, ns_tok
        )
        assert status == 413 and "MAX_PAYLOAD_BYTES" in out["error"]
        status, out = cp.json(
            "POST", "/v1/namespaces/ns-s3/payloads/presign", {"op": "get", "key": "exec/2024/x/out"}, ns_tok
        )
        assert status == 400 and "payloads/" in out["error"]
