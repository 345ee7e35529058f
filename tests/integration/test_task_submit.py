"""Tasks that submit tasks, on the real stack: a control plane over HTTP, ``nymph start``, real entries.

nymph gives each invocation ``LAKESHORE_URL`` and a task token (server/tasks.py), so the user's
``.submit()`` / ``SyncQueue.result`` / ``.stream`` work inside a task: a fan-out of 50 children
gathered in the parent (process runner, 4 slots, the parent holding one), a cancel of the parent
that reaches its children, and a child's credential refused everywhere outside its scope. The user
code is ``tests/user_code/tasks_udfs.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.store.api import SubmitRequest
from tests import runner_kit as kit
from tests.integration.conftest import ControlPlane, submit_body
from tests.integration.docker_kit import require_kind, suite_image
from tests.stack.nymph import Nymph, UserNymph
from tests.stack.producer import await_result, call
from tests.stack.wait import until

udfs = kit.user_module("tasks_udfs")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LIMIT_S = 300.0


@pytest.fixture
def start_nymph(tmp_path: Path) -> Iterator[Callable[..., UserNymph]]:
    started: list[UserNymph] = []

    def make(cp: ControlPlane, *extra: str, base: Path | None = None) -> UserNymph:
        if base is not None:
            base.mkdir()
        n = UserNymph(cp.url, cp.daemon_token, base or tmp_path, "--concurrency", "4", *extra)
        started.append(n)
        n.start()
        return n

    yield make
    for n in started:
        n.stop()
        if n.proc is not None and n.proc.returncode not in (0, None):
            print(n.output()[-5000:])


def submit(cp: ControlPlane, fn: Any, *args: Any, token: str | None = None, **extra: Any) -> str:
    """Submit ``fn(*args)`` as ``.submit()`` does: the invocation id is the Envelope's."""
    envelope = kit.envelope_of(fn, args, {})
    body = submit_body(envelope.id, run_config={}, args_blob=envelope.to_bytes(), **extra)
    return str(call(cp.url, token or cp.producer_token, "/v1/producer/submit", body)["invocation_id"])


def _request(cp: ControlPlane, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    resp = httpx.request(
        method,
        cp.url + path,
        content=msgpack.packb(body, use_bin_type=True) if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-msgpack"},
        params={"since": -1, "timeout": 1} if path.endswith("/stream") else None,
        timeout=60,
    )
    try:
        decoded = msgpack.unpackb(resp.content, raw=False)
    except Exception:
        decoded = resp.content[:300]
    return resp.status_code, decoded


def _status(cp: ControlPlane, inv: str) -> dict[str, Any]:
    code, out = _request(cp, cp.producer_token, "GET", f"/v1/producer/invocations/{inv}")
    assert code == 200, out
    return dict(out)


def _result(cp: ControlPlane, inv: str, n: Nymph) -> Any:
    out = await_result(cp.url, cp.producer_token, inv, LIMIT_S)
    assert out["state"] == "succeeded", (out, n.output()[-3000:])
    return wire.unpack(out["result_blob"])


def test_a_task_fans_out_50_children_and_gathers_them(
    control_plane: ControlPlane, start_nymph: Callable[..., UserNymph]
) -> None:
    cp = control_plane
    n = start_nymph(cp)
    parent = submit(cp, udfs.fan_out, 50)
    out = _result(cp, parent, n)
    assert out["id"] == parent
    assert out["results"] == [i * i for i in range(50)]
    assert out["streamed"] == [0, 1, 2]
    children = _status(cp, parent)["children"]
    assert len(children) == 51 and {c["state"] for c in children} == {"succeeded"}
    assert [c["invocation_id"] for c in children[:50]] == out["children"]
    for child in out["children"]:
        inv = cp.store.get(child)
        assert inv is not None
        assert (inv.parent_invocation_id, inv.root_invocation_id, inv.namespace) == (
            parent,
            parent,
            "default",
        )
    assert _status(cp, out["children"][0])["children"] == []


def test_cancelling_the_parent_cancels_its_running_children(
    sqlite_control_plane: ControlPlane, start_nymph: Callable[..., UserNymph]
) -> None:
    cp = sqlite_control_plane
    n = start_nymph(cp)
    parent = submit(cp, udfs.parent_of_sleepers, 3)

    def three() -> list[dict[str, Any]] | None:
        kids: list[dict[str, Any]] = _status(cp, parent)["children"]
        return kids if len(kids) == 3 else None

    children = until(three, "three children submitted by the parent")
    until(
        lambda: all(_status(cp, c["invocation_id"])["state"] == "running" for c in children),
        "the three children running beside their parent (4 slots)",
    )
    code, out = _request(cp, cp.producer_token, "POST", f"/v1/producer/invocations/{parent}/cancel", {})
    assert code == 200 and out["descendants_cancelled"] == 3, out
    for inv in (parent, *(c["invocation_id"] for c in children)):
        done = await_result(cp.url, cp.producer_token, inv, LIMIT_S)
        assert done["state"] == "killed", (inv, done, n.output()[-3000:])
        assert done["error"]["type"] == "Cancelled"


def test_a_child_credential_is_refused_outside_its_scope(
    sqlite_control_plane: ControlPlane, start_nymph: Callable[..., UserNymph]
) -> None:
    cp = sqlite_control_plane
    n = start_nymph(cp)
    parent = submit(cp, udfs.spawn_holder, "gate")
    child = until(lambda: (_status(cp, parent)["children"] or [{}])[0].get("invocation_id"), "the child")
    token = until(lambda: _read(n.workdir / child / "token"), "the child's credential")
    assert token.startswith("lst_")

    # its own scope: submit (a grandchild, recorded under it), then read and cancel that
    grandchild = submit(cp, udfs.square, 3, token=token)
    inv = cp.store.get(grandchild)
    assert inv is not None and (inv.parent_invocation_id, inv.root_invocation_id) == (child, parent)
    assert _request(cp, token, "GET", f"/v1/producer/invocations/{grandchild}")[0] == 200
    # presign in its namespace (big arguments of its children; this plane has no store: 501), not elsewhere
    assert _presign(cp, token, "default") == 501
    assert _presign(cp, token, "other") == 403
    assert (
        _request(cp, token, "POST", "/v1/producer/await", {"invocation_id": grandchild, "timeout_s": 0})[0]
        == 200
    )
    assert _request(cp, token, "GET", f"/v1/producer/invocations/{grandchild}/result/stream")[0] == 200

    # another invocation's children, its own parent, another namespace: 404 on every route, as an
    # unknown id (the auth table's "outside the rule"; nothing is disclosed)
    other = cp.submit("elsewhere")  # a queue no worker serves: they stay queued
    other_child = cp.submit("elsewhere", parent_invocation_id=other)
    foreign = ids.new_ulid()
    cp.store.submit(
        SubmitRequest(
            invocation_id=foreign,
            queue="elsewhere",
            function={"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"},
            args_blob=b"",
            run_config={},
            code_context={},
            namespace="other",
        )
    )
    for target in (other_child, other, parent, foreign):
        for method, path, payload in (
            ("GET", f"/v1/producer/invocations/{target}", None),
            ("POST", f"/v1/producer/invocations/{target}/cancel", {}),
            ("GET", f"/v1/producer/invocations/{target}/result/stream", None),
            ("POST", "/v1/producer/await", {"invocation_id": target, "timeout_s": 0}),
        ):
            assert _request(cp, token, method, path, payload)[0] == 404, (target, path)
    stolen = submit_body(ids.new_ulid(), run_config={}, parent_invocation_id=other)
    assert _request(cp, token, "POST", "/v1/producer/submit", stolen)[0] == 403
    for method, path, payload in (
        ("POST", "/v1/namespaces/other/exec", {"command": "true"}),
        ("POST", "/v1/namespaces/default/exec", {"command": "true"}),
        ("POST", "/v1/producer/topics/t1/post", {"body": b"x"}),
        ("POST", "/v1/daemon/poll", {"worker_id": ids.new_ulid(), "queues": ["default"], "timeout_s": 0}),
        ("POST", "/v1/daemon/ack", {"invocation_id": child, "state": "succeeded", "attempt": 1}),
        ("GET", "/v1/ops/invocations", None),
        ("GET", f"/v1/ops/invocations/{child}", None),
        ("GET", "/metrics", None),
    ):
        assert _request(cp, token, method, path, payload)[0] == 403, path
    assert cp.store.get(other_child).state == "queued"  # type: ignore[union-attr]  # not cancelled

    # a forged token is nobody; once the child is acked its token is dead too (401)
    assert _request(cp, token[:-2] + "AA", "GET", f"/v1/producer/invocations/{grandchild}")[0] == 401
    (n.workdir / child / "gate").touch()
    assert _result(cp, child, n) == "released"
    assert _result(cp, parent, n) == {"child": child, "result": "released"}
    assert _request(cp, token, "GET", f"/v1/producer/invocations/{grandchild}")[0] == 401
    assert _presign(cp, token, "default") == 401
    again = kit.envelope_of(udfs.square, (3,), {})
    body = submit_body(again.id, run_config={}, args_blob=again.to_bytes())
    assert _request(cp, token, "POST", "/v1/producer/submit", body)[0] == 401


def _presign(cp: ControlPlane, token: str, namespace: str) -> int:
    body = {"op": "put", "size": 10}
    headers = {"Authorization": f"Bearer {token}"}
    url = f"{cp.url}/v1/namespaces/{namespace}/payloads/presign"
    return httpx.post(url, json=body, headers=headers, timeout=30).status_code


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# --- the containers and Slurm ------------------------------------------------------------------------

CLIENT_PACKAGES = ("httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "tenacity")


def _client_deps(root: Path) -> Path:
    """httpx and tenacity with their dependencies (pure Python), copied from this interpreter's site:
    what a bring-your-own image adds so that its tasks can talk to the control plane."""
    import importlib
    import shutil

    out = root / "client-deps"
    out.mkdir()
    for name in CLIENT_PACKAGES:
        module = importlib.import_module(name)
        shutil.copytree(Path(str(module.__file__)).parent, out / name, ignore=shutil.ignore_patterns("*.so"))
    typing_extensions = importlib.import_module("typing_extensions")
    shutil.copy(str(typing_extensions.__file__), out)
    return out


def _failure(cp: ControlPlane, inv: str, n: Nymph) -> dict[str, Any]:
    out = await_result(cp.url, cp.producer_token, inv, LIMIT_S)
    assert out["state"] == "failed", (out, n.output()[-3000:])
    return dict(out["error"])


@pytest.mark.parametrize("kind", ["docker", "gvisor"])
def test_the_readme_module_and_tasks_that_submit_in_a_bare_image(
    kind: str, sqlite_control_plane: ControlPlane, start_nymph: Callable[..., UserNymph], tmp_path: Path
) -> None:
    """The bare image (python3 and msgpack; no repository mounted): the README's module runs; a task
    that submits is told what the image lacks; with httpx mounted and the host's network allowed it
    fans out (docker), or is told its sandbox has no route (gvisor: runsc's own network is off here)."""
    image = suite_image()
    require_kind(kind)
    cp = sqlite_control_plane
    readme = kit.user_module("readme_udfs")
    deps = _client_deps(tmp_path)
    bare = start_nymph(
        cp, "--runner", kind, "--runner-opt", f"image={image}", "--runner-opt", "pull=never",
        "--runner-opt", "mount_pythonpath=false", "--runner-opt", f"code_dirs={kit.USER_CODE}",
        "--runner-opt", "allowed_networks=host", base=tmp_path / "bare",
    )  # fmt: skip
    top = submit(cp, readme.topk, [3, 1, 2], 2)
    assert _result(cp, top, bare) == [2, 3]
    keys = submit(cp, readme.keys, "x.png")
    print(f"[{kind}, bare image] readme_udfs.topk([3, 1, 2], 2) -> [2, 3]; keys -> {_result(cp, keys, bare)}")
    error = _failure(cp, submit(cp, udfs.fan_out, 2), bare)
    print(f"[{kind}, bare image] {error['type']}: {error['message']}")
    assert error["type"] == "ModuleNotFoundError"
    assert error["message"].startswith("submitting from inside a task")
    assert "needs httpx and tenacity in the image" in error["message"]
    bare.stop()

    with_client = start_nymph(
        cp, "--runner", kind, "--runner-opt", f"image={image}", "--runner-opt", "pull=never",
        "--runner-opt", "mount_pythonpath=false", "--runner-opt", f"code_dirs={kit.USER_CODE},{deps}",
        "--runner-opt", "network=host", base=tmp_path / "client",
    )  # fmt: skip
    parent = submit(cp, udfs.fan_out, 3)
    if kind == "docker":
        out = _result(cp, parent, with_client)
        print(f"[{kind}, network=host] fan_out(3) -> {out['results']}, streamed {out['streamed']}")
        assert out["results"] == [0, 1, 4] and out["streamed"] == [0, 1, 2]
        assert len(_status(cp, parent)["children"]) == 4
    else:
        error = _failure(cp, parent, with_client)
        print(f"[{kind}, network=host] {error['type']}: {error['message']}")
        assert error["type"] == "Unavailable"
        assert "give a task no network by default (network none)" in error["message"]
        assert "--runner-opt network=host" in error["message"]


def test_tasks_submit_tasks_on_slurm(
    sqlite_control_plane: ControlPlane, start_nymph: Callable[..., UserNymph], tmp_path: Path
) -> None:
    from tests.conftest import require
    from tests.runner_kit import slurm_answers

    require(slurm_answers(), 'needs a Slurm controller: eval "$(scripts/services/slurm.sh)"')
    cp = sqlite_control_plane
    n = start_nymph(cp, "--runner", "slurm", base=tmp_path / "slurm")
    parent = submit(cp, udfs.fan_out, 3)
    out = _result(cp, parent, n)
    assert out["results"] == [0, 1, 4] and out["streamed"] == [0, 1, 2]
