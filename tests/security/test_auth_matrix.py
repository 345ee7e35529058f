"""The auth matrix, generated from the one table (``server.authz.ROUTES``): every route x every token
kind x an object of the token's own namespace (and worker, and lease) or of another's.

For each case the expected answer is read off the table: a kind the route does not grant gets 403;
a granted kind succeeds on its own objects, and on another namespace's (another token's worker or
lease) gets the route's ``outside`` status (404 or 403) unless its rule is ``any``. The tokens
of the kinds are bound to ``team-a`` (admin and metrics tokens are not bound); "other" objects
belong to ``team-b``, and its workers to a daemon token bound to ``team-b``. The task token is the
one a poll hands out for an invocation of ``team-a`` (kept running: a long lease); its "own"
invocations are children of that invocation.

Also here: every route the app serves has an entry in the table, and docs/security.md shows the
table as it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from starlette.routing import Mount, Route

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server import authz
from dreamlake.lakeshore.server.authz import KINDS, ROUTES, Own, RouteAuth
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.store.api import SubmitRequest
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
OWN, OTHER = "team-a", "team-b"
_queue_ids = itertools.count()


@dataclass
class World:
    """A control plane with one token per kind (bound to team-a) and team-b's producer and daemon."""

    cp: ControlPlane
    tokens: dict[str, str]
    other_daemon: str
    task_invocation: str = ""  # the invocation the task token was handed with

    def queue(self) -> str:
        return f"m{next(_queue_ids)}"

    def invocation(self, ns: str, parent: str | None = None, run_config: dict[str, Any] | None = None) -> str:
        inv = new_ulid()
        fn = {"module": "m", "qualname": "f"}
        self.cp.store.submit(
            SubmitRequest(
                inv, self.queue(), fn, b"\x90", run_config or {}, parent_invocation_id=parent, namespace=ns
            )
        )
        return inv

    def worker(self, token: str) -> str:
        worker = new_ulid()
        status, out = self.cp.call("/v1/daemon/register", {"worker_id": worker, "queues": ["x"]}, token)
        assert status == 200, out
        return worker

    def lease(self, ns: str, token: str) -> tuple[str, str, int]:
        """An invocation of ``ns`` claimed by a worker of ``token``: (invocation, worker, attempt)."""
        queue, inv = self.queue(), new_ulid()
        fn = {"module": "m", "qualname": "f"}
        self.cp.store.submit(SubmitRequest(inv, queue, fn, b"\x90", {}, namespace=ns))
        worker = new_ulid()
        body = {"worker_id": worker, "queues": [queue], "timeout_s": 0, "kinds": ["run"]}
        status, out = self.cp.call("/v1/daemon/poll", body, token)
        assert status == 200 and out["commands"][0]["body"]["invocation_id"] == inv, out
        return inv, worker, 1

    def exec_lease(self, ns: str, token: str) -> tuple[str, str]:
        """An exec job of ``ns`` claimed by a worker of ``token``: (exec id, worker)."""
        queue = self.queue()
        exec_id = self.cp.store.create_exec(
            ns, "true", payload_inline=None, payload_ref=None, queue=queue, worker_id=None, timeout_s=None
        )
        worker = new_ulid()
        status, out = self.cp.call(
            "/v1/daemon/poll", {"worker_id": worker, "queues": [queue], "timeout_s": 0}, token
        )
        assert status == 200 and out["commands"][0]["body"]["exec_id"] == exec_id, out
        return exec_id, worker


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    config = ServerConfig(lease_s=3600.0)  # the task token's invocation keeps running throughout
    with running_control_plane(str(tmp_path_factory.mktemp("matrix") / "m.db"), config=config) as cp:
        store = cp.store
        tokens = {
            kind: store.create_token(kind, f"{kind}-a", None if kind in ("admin", "metrics") else OWN)
            for kind in KINDS
            if kind != "task"
        }
        w = World(cp, tokens, other_daemon=store.create_token("daemon", "daemon-b", OTHER))
        w.task_invocation = w.invocation(OWN)
        queue = store.get(w.task_invocation).queue  # type: ignore[union-attr]
        body = {"worker_id": new_ulid(), "queues": [queue], "timeout_s": 0, "kinds": ["run"]}
        status, out = cp.call("/v1/daemon/poll", body, tokens["daemon"])
        assert status == 200, out
        tokens["task"] = out["commands"][0]["body"]["task_token"]
        yield w


Request = tuple[str, str, Any, str]  # method, path, body, encoding ("msgpack" | "json" | "none")


def request_for(w: World, route: RouteAuth, kind: str, own: bool) -> Request:
    """A well-formed request to ``route`` for a ``kind`` token, on its own objects or on team-b's."""
    ns = OWN if own else OTHER
    # whose worker: one team-b's daemon registered, or the caller's own (made with an admin token
    # for kinds that cannot register one: they are refused before it matters)
    daemon = w.other_daemon if not own else w.tokens[kind if kind in ("daemon", "admin") else "admin"]
    inv_path = "/v1/producer/invocations/{}"

    def target(run_config: dict[str, Any] | None = None) -> str:
        """An invocation of ``ns``; a task's own ones are children of its invocation."""
        return w.invocation(
            ns, parent=w.task_invocation if kind == "task" and own else None, run_config=run_config
        )

    match route.handler:
        case "metrics":
            return "GET", "/metrics", None, "none"
        case "submit":
            return "POST", "/v1/producer/submit", submit_body(new_ulid(), w.queue()), "msgpack"
        case "submit_batch":
            items = [submit_body(new_ulid(), w.queue()) for _ in range(2)]
            return "POST", "/v1/producer/submit-batch", {"submits": items}, "msgpack"
        case "await_":
            return (
                "POST",
                "/v1/producer/await",
                {"invocation_id": target(), "timeout_s": 0},
                "msgpack",
            )
        case "await_batch":
            return (
                "POST",
                "/v1/producer/await-batch",
                {"invocation_ids": [target(), target()], "timeout_s": 0},
                "msgpack",
            )
        case "status":
            return "GET", inv_path.format(target()), None, "msgpack"
        case "cancel":
            return "POST", inv_path.format(target()) + "/cancel", {}, "msgpack"
        case "result_stream":
            return "GET", inv_path.format(target()) + "/result/stream?timeout=0", None, "msgpack"
        case "send":
            body = {"index": 0, "kind": "value", "body": wire.pack(1)}
            return "POST", inv_path.format(target({"two_way": True})) + "/send", body, "msgpack"
        case "sends_fetch":
            inv, worker, attempt = w.lease(ns, daemon)
            body = {"invocation_id": inv, "worker_id": worker, "attempt": attempt, "since": -1, "wait_s": 0}
            return "POST", "/v1/daemon/sends", body, "msgpack"
        case "topic_post":
            return "POST", "/v1/producer/topics/matrix/post", {"body": wire.pack(1)}, "msgpack"
        case "topic_stream":
            return "GET", "/v1/producer/topics/matrix/stream?timeout=0", None, "msgpack"
        case "register":
            worker = new_ulid() if own else w.worker(daemon)
            return "POST", "/v1/daemon/register", {"worker_id": worker, "queues": ["x"]}, "msgpack"
        case "poll":
            worker = new_ulid() if own else w.worker(daemon)
            return (
                "POST",
                "/v1/daemon/poll",
                {"worker_id": worker, "queues": [w.queue()], "timeout_s": 0},
                "msgpack",
            )
        case "heartbeat":
            worker = new_ulid() if own else w.worker(daemon)
            return "POST", "/v1/daemon/heartbeat", {"worker_id": worker, "running": []}, "msgpack"
        case "deregister":  # another token's worker: 403, and it stays live (test_nymph_deregister)
            worker = new_ulid() if own else w.worker(daemon)
            return "POST", "/v1/daemon/deregister", {"worker_id": worker}, "msgpack"
        case "ack" | "result_chunk" | "result_chunks":
            inv, worker, attempt = w.lease(ns, daemon)
            lease = {"invocation_id": inv, "worker_id": worker, "attempt": attempt}
            if route.handler == "ack":
                return (
                    "POST",
                    "/v1/daemon/ack",
                    {**lease, "state": "succeeded", "result_blob": b""},
                    "msgpack",
                )
            data = wire.encode_frame(wire.FRAME_VALUE, 0, wire.pack(0), {})
            if route.handler == "result_chunks":
                return "POST", "/v1/daemon/result-chunks", {**lease, "frames": [data]}, "msgpack"
            return "POST", "/v1/daemon/result-chunk", {**lease, "seq": 0, "bytes": data}, "msgpack"
        case "checkpoint":
            inv, worker, attempt = w.lease(ns, daemon)
            key = f"payloads/2026/12/04/{inv}.matrix/checkpoint"
            ref = {"bucket": None, "key": key, "size": 1, "sha256": "0" * 64}
            body = {"invocation_id": inv, "worker_id": worker, "attempt": attempt, "checkpoint_ref": ref}
            return "POST", "/v1/daemon/checkpoint", body, "msgpack"
        case "exec_":
            return "POST", f"/v1/namespaces/{ns}/exec", {"command": "true", "queue": w.queue()}, "json"
        case "job_result":
            job = w.cp.store.create_exec(
                ns,
                "true",
                payload_inline=None,
                payload_ref=None,
                queue=w.queue(),
                worker_id=None,
                timeout_s=None,
            )
            return "GET", f"/v1/namespaces/{ns}/jobs/{job}/result?wait=0", None, "json"
        case "job_publish":
            job, worker = w.exec_lease(ns, daemon)
            body = {"worker_id": worker, "attempt": 1, "exit_code": 0}
            return "POST", f"/v1/namespaces/{ns}/jobs/{job}/result", body, "json"
        case "job_output_put":
            job, worker = w.exec_lease(ns, daemon)
            path = f"/v1/namespaces/{ns}/jobs/{job}/output/stdout?worker_id={worker}&attempt=1"
            return "PUT", path, None, "json"
        case "job_output":
            job = w.cp.store.create_exec(
                ns,
                "true",
                payload_inline=None,
                payload_ref=None,
                queue=w.queue(),
                worker_id=None,
                timeout_s=None,
            )
            return "GET", f"/v1/namespaces/{ns}/jobs/{job}/output/stdout", None, "json"
        case "presign":
            return "POST", f"/v1/namespaces/{ns}/payloads/presign", {"op": "put", "size": 1}, "json"
        case "pin":
            return "PUT", f"/v1/namespaces/{ns}/pin", {"nymph_version": "1.0"}, "json"
        case "secret_list":
            return "GET", f"/v1/namespaces/{ns}/secrets", None, "json"
        case "secret_put" | "secret_delete":
            path = f"/v1/namespaces/{ns}/secrets/MATRIX_{next(_queue_ids)}"
            if route.handler == "secret_put":
                return "PUT", path, {"value": "x"}, "json"
            status, out = w.cp.json("PUT", path, {"value": "x"}, w.tokens["admin"])  # one to remove
            assert status == 200, out
            return "DELETE", path, None, "json"
        case "secrets_fetch":
            if kind == "task":  # its own invocation's (running), or another's
                inv = w.task_invocation if own else w.invocation(ns)
                return "POST", "/v1/daemon/secrets", {"invocation_id": inv, "attempt": 1}, "msgpack"
            inv, worker, attempt = w.lease(ns, daemon)
            body = {"invocation_id": inv, "worker_id": worker, "attempt": attempt}
            return "POST", "/v1/daemon/secrets", body, "msgpack"
        case "ops.whoami":
            return route.method, "/v1/ops/whoami", None if route.method == "GET" else {}, "json"
        case "ops.info":
            return "GET", "/v1/ops/info", None, "json"
        case "ops.queues" | "ops.workers" | "ops.invocations":
            return "GET", "/v1/ops/" + route.handler.removeprefix("ops.") + f"?namespace={ns}", None, "json"
        case "ops.invocation":
            return "GET", f"/v1/ops/invocations/{w.invocation(ns)}", None, "json"
        case "ops.cancel":
            return "POST", f"/v1/ops/invocations/{w.invocation(ns)}/cancel", {}, "json"
        case "ops.queue_limit":
            return "PUT", f"/v1/ops/queues/{w.queue()}/limit", {"max_running": 3}, "json"
        case "ops.queue_limit_clear":
            return "DELETE", f"/v1/ops/queues/{w.queue()}/limit", None, "json"
    raise AssertionError(f"no request for route {route.handler}: add one when adding a route to ROUTES")


def send(w: World, req: Request, token: str) -> tuple[int, Any]:
    """(status, the decoded error answer or None)."""
    method, path, body, encoding = req
    headers = {"Authorization": f"Bearer {token}"}
    if encoding == "msgpack":
        headers["Content-Type"] = "application/x-msgpack"
        content = None if body is None else msgpack.packb(body, use_bin_type=True)
        r = httpx.request(method, w.cp.url + path, content=content, headers=headers, timeout=30)
    else:
        r = httpx.request(method, w.cp.url + path, json=body, headers=headers, timeout=30)
    if r.status_code < 400:
        return r.status_code, None
    media = r.headers.get("content-type", "")
    if "msgpack" in media:
        return r.status_code, msgpack.unpackb(r.content)
    return r.status_code, r.json() if "json" in media else {"error": r.text}


def expected(route: RouteAuth, kind: str, own: bool) -> int | None:
    """The status the table promises; None: success (2xx, or 501 for presign without a bucket)."""
    rule = route.grants.get(kind)
    if rule is None:
        return 403
    if own or rule is Own.ANY or route.outside is None:  # None: a submit lands in the caller's namespace
        return None
    return route.outside


CASES = [
    (route, kind, own)
    for route in ROUTES
    if not route.public and not route.session
    for kind in KINDS
    for own in (True, False)
]


@pytest.mark.parametrize(
    ("route", "kind", "own"),
    CASES,
    ids=[f"{r.method} {r.path} {k} {'own' if o else 'other'}" for r, k, o in CASES],
)
def test_the_table_decides(world: World, route: RouteAuth, kind: str, own: bool) -> None:
    status, out = send(world, request_for(world, route, kind, own), world.tokens[kind])
    want = expected(route, kind, own)
    if want is None:
        # no payload store in this world: presign, checkpoint and the exec output archive answer
        # 501 once the caller passed
        assert status < 400 or (
            route.handler in ("presign", "checkpoint", "job_output_put", "job_output") and status == 501
        ), (status, out)
    else:
        assert status == want, (status, out)
        assert out["error"]  # the attacker is told why, not shown anything


@pytest.mark.parametrize("kind", KINDS)
def test_the_dashboard_admits_the_kinds_of_its_entry(world: World, kind: str) -> None:
    r = httpx.post(world.cp.url + "/ui/login", data={"token": world.tokens[kind]}, follow_redirects=False)
    assert r.status_code == (303 if kind in authz.UI.grants else 403)


def test_every_served_route_is_in_the_table(world: World) -> None:
    table = {(r.path, r.method) for r in ROUTES}
    for route in world.cp.app.routes:
        if isinstance(route, Mount) or route.path.startswith("/ui"):
            continue  # the dashboard: one entry (session cookie); its static files need no token
        assert isinstance(route, Route)
        for method in route.methods or ():
            if method != "HEAD":
                assert (route.path, method) in table, (
                    f"{method} {route.path} is served but not in authz.ROUTES"
                )


def test_docs_security_md_shows_the_table_as_it_is() -> None:
    text = DOC.read_text()
    assert authz.render_into(text) == text, (
        "docs/security.md's auth matrix is stale: run "
        "python -m dreamlake.lakeshore.server.authz docs/security.md"
    )
