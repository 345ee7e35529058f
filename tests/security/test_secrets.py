"""Secrets from the attacker's side (issue 33): a real control plane over HTTP (SQLite file),
``nymph start`` as a real process, the CLI as a real subprocess.

The value reaches the task's environment and nowhere else: not the database file (nor its WAL),
the invocation's row, ``lakeshore show``, the ops routes, the dashboard's page of the invocation,
nymph's log at DEBUG or the server's. Another namespace's secret answers 404 on every secret
route; a submit naming an unknown secret is refused (400 naming it) and stores nothing; the values
go to no token but the worker holding the running attempt's lease and that attempt's own task
credential: not a producer, not an admin, not another daemon, not a task credential whose attempt
ended.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import ids
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.errors import PlaneError
from tests import env_fns
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body
from tests.stack.nymph import Nymph
from tests.stack.producer import await_result

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
VALUE = "s3cr3t-" + hashlib.sha256(os.urandom(16)).hexdigest()[:24]  # unique: any hit is a leak
SECRET = "LS_TEST_SECRET"


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlPlane]:
    with running_control_plane(str(tmp_path / "lakeshore.db")) as plane:
        yield plane


def _put(cp: ControlPlane, token: str, ns: str, name: str, value: str) -> tuple[int, Any]:
    return cp.json("PUT", f"/v1/namespaces/{ns}/secrets/{name}", {"value": value}, token)


def _cli(
    cp: ControlPlane, token: str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LAKESHORE_URL": cp.url, "LAKESHORE_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "dreamlake.lakeshore.cli", *args],
        capture_output=True, text=True, timeout=60, env=env, input=stdin,
    )  # fmt: skip


def _files_hold(root: Path, needle: bytes) -> list[str]:
    hits = []
    for here, _dirs, files in os.walk(root):
        for name in files:
            path = Path(here) / name
            try:
                if needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
    return hits


def test_a_secret_reaches_the_task_and_no_stored_or_shown_place(
    cp: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    setting = _cli(cp, cp.producer_token, "secret", "set", SECRET, stdin=VALUE)  # piped: not on argv
    assert setting.returncode == 0, setting.stderr
    listed = _cli(cp, cp.producer_token, "secret", "ls")
    assert SECRET in listed.stdout and VALUE not in listed.stdout
    n = nymph_factory(cp.url, cp.daemon_token, "--log-level", "DEBUG")
    plane = HttpDispatch(cp.url, cp.producer_token)
    inv = env_fns.secret_digest.submit(_dispatch=plane)
    got = dls.SyncQueue("default", plane).result(inv, timeout=120)
    assert got["sha256"] == hashlib.sha256(VALUE.encode()).hexdigest(), n.output()[-3000:]

    row = cp.store.get(inv)
    assert row is not None and row.run_config["secrets"] == [SECRET]
    assert VALUE.encode() not in repr(row).encode() and VALUE.encode() not in bytes(row.args_blob)
    shown = _cli(cp, cp.producer_token, "show", inv, "--json")
    assert shown.returncode == 0 and SECRET in shown.stdout and VALUE not in shown.stdout
    for path in (f"/v1/ops/invocations/{inv}", "/v1/ops/invocations"):
        status, body = cp.json("GET", path, None, cp.admin_token)
        assert status == 200 and VALUE not in str(body)
    with cp.client() as web:  # the dashboard's page of the invocation, logged in as an admin
        assert web.post("/ui/login", data={"token": cp.admin_token}).status_code in (200, 303)
        page = web.get(f"/ui/invocations/{inv}")
        assert page.status_code == 200 and inv in page.text and VALUE not in page.text
    n.stop()
    assert VALUE not in n.output(), "nymph's log holds the secret's value"
    assert not any(VALUE in r.getMessage() for r in caplog.records), "the server's log holds it"
    cp.store.close()  # every page on disk: the database file and its WAL hold sealed bytes only
    assert _files_hold(tmp_path, VALUE.encode()) == []


def test_secrets_of_another_namespace_are_404_and_unknown_names_refuse_the_submit(cp: ControlPlane) -> None:
    mine = cp.store.create_token("producer", "team-a", namespace="team-a")
    theirs = cp.store.create_token("producer", "team-b", namespace="team-b")
    assert _put(cp, mine, "team-a", SECRET, VALUE)[0] == 200
    for method, path, body in (
        ("GET", "/v1/namespaces/team-a/secrets", None),
        ("PUT", f"/v1/namespaces/team-a/secrets/{SECRET}", {"value": "overwritten"}),
        ("DELETE", f"/v1/namespaces/team-a/secrets/{SECRET}", None),
    ):
        status, out = cp.json(method, path, body, theirs)
        assert status == 404, (method, path, status, out)
    status, listed = cp.json("GET", "/v1/namespaces/team-a/secrets", None, mine)
    assert status == 200 and [s["name"] for s in listed["secrets"]] == [SECRET] and VALUE not in str(listed)
    # team-b asking for team-a's secret by name: its namespace has none of that name
    body = submit_body(ids.new_ulid(), run_config={"secrets": [SECRET]})
    status, out = cp.call("/v1/producer/submit", body, theirs)
    assert status == 400 and SECRET in out["error"] and "team-b" in out["error"], out
    assert cp.store.get(body["invocation_id"]) is None  # refused before it was stored
    batch = {
        "submits": [
            submit_body(ids.new_ulid(), run_config={"secrets": ["NOPE"]}),
            submit_body(ids.new_ulid()),
        ]
    }
    status, out = cp.call("/v1/producer/submit-batch", batch, mine)
    assert status == 200 and out["results"][0]["status"] == 400 and "NOPE" in out["results"][0]["error"]
    assert "invocation_id" in out["results"][1] and "error" not in out["results"][1]
    with pytest.raises(PlaneError, match=f"unknown secret '{SECRET}' in namespace 'team-b'"):
        env_fns.secret_digest.submit(_dispatch=HttpDispatch(cp.url, theirs))  # the SDK's error says so


def test_only_the_lease_holder_and_the_running_task_read_values(
    cp: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    assert _put(cp, cp.producer_token, "default", SECRET, VALUE)[0] == 200
    nymph_factory(cp.url, cp.daemon_token)
    plane = HttpDispatch(cp.url, cp.producer_token)
    inv = env_fns.secret_digest.submit(_dispatch=plane)
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", out
    got = dls.SyncQueue("default", plane).result(inv, timeout=30)
    row = cp.store.get(inv)
    assert row is not None
    body = {"invocation_id": inv, "attempt": row.attempt, "worker_id": row.worker_id}
    # the finished attempt's own credential: refused
    status, answer = cp.call("/v1/daemon/secrets", body, got["token"])
    assert status == 401 and VALUE not in str(answer), answer
    # other kinds: refused before anything is read
    for token in (cp.producer_token, cp.admin_token):
        status, answer = cp.call("/v1/daemon/secrets", body, token)
        assert status == 403 and VALUE not in str(answer), answer
    # the worker that held the lease, once the attempt ended: no value
    status, answer = cp.call("/v1/daemon/secrets", body, cp.daemon_token)
    assert status == 409 and VALUE not in str(answer), answer
    # another daemon token, acting as that worker: refused
    other = cp.store.create_token("daemon", "another-daemon")
    status, answer = cp.call("/v1/daemon/secrets", body, other)
    assert status == 403 and VALUE not in str(answer), answer
