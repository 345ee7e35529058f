"""Issue 31's control-plane attacks, made by one tenant against another on the real stack.

Two namespaces, ``team-a`` (the victim) and ``team-b`` (the attacker), each with a producer token
minted by ``lakeshore token create``; ``lakeshore server`` runs as the README starts it (a
subprocess on SQLite). Each test plays team B over HTTP and asserts what B sees and that nothing
of team A changed.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import submit_body
from tests.security.conftest import Stack


@dataclass
class Tenants:
    a: str  # producer of team-a
    b: str  # producer of team-b
    a_ns: str  # namespace token of team-a (seed 003's routes: exec, presign)
    b_ns: str  # namespace token of team-b


@pytest.fixture(scope="module")
def tenants(stack: Stack) -> Tenants:
    return Tenants(
        a=stack.token("producer", "team-a", "--namespace", "team-a"),
        b=stack.token("producer", "team-b", "--namespace", "team-b"),
        a_ns=stack.token("namespace", "team-a-ns", "--namespace", "team-a"),
        b_ns=stack.token("namespace", "team-b-ns", "--namespace", "team-b"),
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


def _presign(stack: Stack, ns: str, token: str, **body: Any) -> tuple[int, Any]:
    return stack.json("POST", f"/v1/namespaces/{ns}/payloads/presign", body, token)


def _stored(stack: Stack, key: str) -> bytes:
    return (stack.data_dir / "blobs" / key).read_bytes()


def test_the_same_job_id_in_another_namespace_names_another_key(stack: Stack, tenants: Tenants) -> None:
    """B presigns A's jobId: B gets a key of its own namespace, its upload lands there, and A's
    payload is intact; B can neither presign a read of A's key nor point a job at it."""
    job = f"job-{new_ulid().lower()}"
    mine = b"A's arguments " * 100
    status, a_put = _presign(stack, "team-a", tenants.a_ns, op="put", size=len(mine), jobId=job)
    assert status == 200 and a_put["key"].startswith("payloads/team-a/")
    assert httpx.put(a_put["url"], content=mine).status_code == 200
    theirs = b"B's forgery!! " * 100
    status, b_put = _presign(stack, "team-b", tenants.b_ns, op="put", size=len(theirs), jobId=job)
    assert status == 200 and b_put["key"].startswith("payloads/team-b/") and b_put["key"] != a_put["key"]
    assert httpx.put(b_put["url"], content=theirs).status_code == 200
    assert _stored(stack, a_put["key"]) == mine
    status, out = _presign(stack, "team-b", tenants.b_ns, op="get", key=a_put["key"])
    assert status == 404 and "team-b" in out["error"]
    ref = {
        "bucket": "local",
        "key": a_put["key"],
        "size": len(mine),
        "sha256": hashlib.sha256(mine).hexdigest(),
    }
    status, out = stack.json(
        "POST", "/v1/namespaces/team-b/exec", {"command": "cat", "payloadRef": ref}, tenants.b_ns
    )
    assert status == 404 and "payloadRef.key" in out["error"]
    body = submit_body(new_ulid(), "q-tenants", args_blob=b"")
    body.pop("args_blob")
    body["args_ref"] = ref
    status, out = stack.call("/v1/producer/submit", body, tenants.b)
    assert status == 404 and "args_ref.key" in out["error"]
    status, got = _presign(stack, "team-a", tenants.a_ns, op="get", key=a_put["key"])
    assert status == 200 and httpx.get(got["url"]).content == mine


def test_a_presigned_put_replayed_with_other_bytes_is_refused(stack: Stack, tenants: Tenants) -> None:
    """A URL presigned for the bytes' sha256 takes only those bytes (403); any URL, once its key
    holds bytes, takes no others (409); the same bytes again are a harmless 200."""
    data, other = b"x" * 1000, b"y" * 1000
    sha = hashlib.sha256(data).hexdigest()
    status, bound = _presign(stack, "team-a", tenants.a_ns, op="put", size=len(data), sha256=sha)
    assert status == 200
    r = httpx.put(bound["url"], content=other)
    assert r.status_code == 403 and "sha256" in r.json()["error"]
    assert not (stack.data_dir / "blobs" / bound["key"]).exists()
    assert httpx.put(bound["url"], content=data).status_code == 200
    status, plain = _presign(stack, "team-a", tenants.a_ns, op="put", size=len(data))
    assert httpx.put(plain["url"], content=data).status_code == 200
    r = httpx.put(plain["url"], content=other)
    assert r.status_code == 409 and "uploaded already" in r.json()["error"]
    assert httpx.put(plain["url"], content=data).status_code == 200
    assert _stored(stack, bound["key"]) == data and _stored(stack, plain["key"]) == data


def test_a_payload_ref_without_its_sha256_is_refused(stack: Stack, tenants: Tenants) -> None:
    data = b"z" * 10
    status, put = _presign(stack, "team-a", tenants.a_ns, op="put", size=len(data))
    assert httpx.put(put["url"], content=data).status_code == 200
    ref = {"bucket": "local", "key": put["key"], "size": len(data)}
    status, out = stack.json(
        "POST", "/v1/namespaces/team-a/exec", {"command": "cat", "payloadRef": ref}, tenants.a_ns
    )
    assert status == 400 and "payloadRef.sha256 is required" in out["error"]


# -- terminals: what a task prints reaches the operator's terminal escaped ----------------------

EVIL = (
    "before "
    "\x1b]52;c;ZWNobyBwd25lZA==\x07"  # OSC 52: write the clipboard
    "\x1b[2J\x1b[H"  # CSI: clear the screen, home the cursor
    "\x1b]8;;https://evil.example/\x1b\\click me\x1b]8;;\x1b\\"  # OSC 8: a link that lies
    "\x9b31m"  # an 8-bit CSI (C1)
    " after\n"
)


def _run_on_a_terminal(stack: Stack, *args: str) -> bytes:
    """Run the ``lakeshore`` CLI with its stdout on a pseudo-terminal; all it wrote there."""
    import os
    import pty
    import subprocess
    import sys

    from tests.security.conftest import ROOT

    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dreamlake.lakeshore.cli", *args],
            stdin=subprocess.DEVNULL,
            stdout=follower,
            stderr=follower,
            env={**stack.env, "LAKESHORE_URL": stack.url, "LAKESHORE_TOKEN": stack.admin},
            cwd=ROOT,
            start_new_session=True,
        )
        os.close(follower)
        follower = -1
        out = b""
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side closed
                break
            if not data:
                break
            out += data
        assert proc.wait(60) == 0, out
        return out
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)


def _printed_by_a_task(stack: Stack, tenants: Tenants) -> str:
    """A team-a invocation whose task printed EVIL (LOG frames, as nymph journals a task's
    stdout), then failed with EVIL as its error; its id."""
    from dreamlake.lakeshore import wire

    queue = f"q{new_ulid().lower()[-8:]}"
    inv, status, _ = _submit(stack, tenants.a, queue=queue)
    assert status == 200
    worker = {"worker_id": new_ulid(), "queues": [queue], "timeout_s": 5}
    assert stack.call("/v1/daemon/register", worker, stack.daemon)[0] == 200
    _, out = stack.call("/v1/daemon/poll", worker, stack.daemon)
    attempt = out["commands"][0]["body"]["attempt"]
    lease = {"worker_id": worker["worker_id"], "attempt": attempt}
    frames = [
        wire.encode_frame(wire.FRAME_LOG, 0, EVIL.encode(), {"stream": "stdout", "ts": 0.0}),
        wire.encode_frame(wire.FRAME_END, 1, wire.pack(None), {"ts": 0.0}),
    ]
    for seq, data in enumerate(frames):
        body = {"invocation_id": inv, "seq": seq, "bytes": data, **lease}
        assert stack.call("/v1/daemon/result-chunk", body, stack.daemon)[0] == 200
    error = {"type": "Boom", "message": EVIL, "traceback": EVIL}
    ack = {"invocation_id": inv, "state": "failed", "error": error, **lease}
    assert stack.call("/v1/daemon/ack", ack, stack.daemon)[0] == 200
    return inv


def test_control_sequences_a_task_printed_reach_the_terminal_escaped(stack: Stack, tenants: Tenants) -> None:
    """`lakeshore logs` on a terminal shows OSC 52, CSI, OSC 8 and C1 as visible escapes; with
    --raw the bytes are kept."""
    inv = _printed_by_a_task(stack, tenants)
    shown = _run_on_a_terminal(stack, "logs", inv)
    assert (
        b"\x1b" not in shown
        and b"\x9b" not in shown.replace(b"\xc2\x9b", b"")
        and "\x9b" not in shown.decode()
    )
    assert b"before \\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x1b[2J" in shown
    assert b"\\x1b]8;;https://evil.example/" in shown and b"\\x9b31m after" in shown
    raw = _run_on_a_terminal(stack, "logs", "--raw", inv)
    assert b"\x1b]52;c;ZWNobyBwd25lZA==\x07" in raw and b"\x1b[2J" in raw and "\x9b".encode() in raw
    for command in (("show", inv), ("ls", "--limit", "5")):  # the task's error message
        shown = _run_on_a_terminal(stack, *command)
        assert b"\x1b" not in shown and b"\\x1b]52" in shown, command
        assert b"\x1b]52" in _run_on_a_terminal(stack, *command, "--raw"), command
    assert b"\x1b" not in _run_on_a_terminal(stack, "stream", inv)


# -- the dashboard ---------------------------------------------------------------------------------


def test_the_dashboard_refuses_a_foreign_login_and_keeps_the_token_out_of_its_cookie(
    stack: Stack, tenants: Tenants
) -> None:
    """A sign-in posted from another site is refused (login CSRF); a session's cookie is an
    opaque id (not the token, no API credential), ended by signing out; every /ui answer forbids
    framing and sniffing and carries a CSP."""
    form = {"token": tenants.a}
    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
        r = httpx.post(stack.url + "/ui/login", data=form, headers=headers, follow_redirects=False)
        assert r.status_code == 403 and "another site" in r.text, headers
        assert "set-cookie" not in r.headers
    with httpx.Client(base_url=stack.url, follow_redirects=False) as browser:
        r = browser.post(
            "/ui/login", data=form, headers={"Origin": stack.url, "Sec-Fetch-Site": "same-origin"}
        )
        assert r.status_code == 303
        session = browser.cookies["lakeshore_session"]
        assert session.startswith("lss_") and tenants.a not in r.headers["set-cookie"]
        assert stack.json("GET", "/v1/ops/whoami", None, session)[0] == 401  # not an API credential
        for path in ("/ui", "/ui/login", "/ui/invocations", "/ui/static/htmx.min.js"):
            r = browser.get(path)
            assert r.status_code == 200, path
            assert r.headers["x-frame-options"] == "DENY", path
            assert r.headers["x-content-type-options"] == "nosniff", path
            csp = r.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, path
        page = browser.get("/ui").text
        csrf = page.split('name="csrf" value="')[1].split('"')[0]
        assert (
            browser.post("/ui/logout", data={"csrf": csrf}, headers={"Origin": stack.url}).status_code == 303
        )
    with httpx.Client(base_url=stack.url, follow_redirects=False) as replay:
        replay.cookies.set("lakeshore_session", session, path="/ui")
        r = replay.get("/ui")
        assert r.status_code == 303 and r.headers["location"] == "/ui/login"  # signed out everywhere
