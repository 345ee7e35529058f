# ruff: noqa: F811  (the fixtures are imported from tests.security.nymph_stack)
"""A task's memory holds nothing of another namespace's requests (the process runner's warm fork).

Before: one root zygote forked every tenant's tasks, and each request (the arguments, base64, and
the per-task ``LAKESHORE_*`` variables) passed through its heap, so a task forked after another
namespace's found that task's argument bytes and invocation id by reading its own memory. After:
a namespace's tasks fork only from a zygote that only ever handled that namespace's requests, and
the arguments never pass through a zygote at all (the child reads ``args.msgpack`` as its user).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from dreamlake.lakeshore import ids, wire
from tests.security.nymph_stack import (  # noqa: F401  (fixtures)
    ControlPlane,
    RootNymph,
    await_result,
    call,
    plane,
    readable_runtime,
    ref,
    root_nymph,
    task_user,
)
from tests.stack.producer import submit_body

ZYGOTE = "nymph_process/zygote.py"  # in a zygote's command line
ANCHOR = 12  # characters a scan looks for before it hashes what follows


def _needle(text: bytes) -> tuple[str, int, str]:
    return text[:ANCHOR].decode(), len(text), hashlib.sha256(text).hexdigest()


def needles(secret: str) -> list[tuple[str, int, str]]:
    """``secret`` as plain bytes and as base64 at each of the three alignments it can have in a
    longer base64 text (the characters that depend on the secret alone)."""
    raw = secret.encode()
    out = [_needle(raw)]
    for pad in range(3):
        enc = base64.b64encode(b"\0" * pad + raw)
        out.append(_needle(enc[4 if pad else 0 : (pad + len(raw)) // 3 * 4]))
    return out


def _submit(cp: ControlPlane, token: str, blob: bytes, invocation_id: str | None = None) -> str:
    body = submit_body(
        invocation_id or ids.new_ulid(), "default", run_config={"max_attempts": 1}, args_blob=blob
    )
    return str(call(cp, "/v1/producer/submit", body, token)["invocation_id"])


def _value(out: dict[str, Any]) -> Any:
    assert out["state"] == "succeeded", out
    return wire.unpack(out["result_blob"])


def test_a_task_finds_nothing_of_another_namespaces_requests_in_its_memory(
    plane: ControlPlane, root_nymph: Callable[..., RootNymph]
) -> None:
    n = root_nymph()  # prefork on (the default), its tasks run as the pool users
    team_a = plane.store.create_token("producer", "p-a", "team-a")
    team_b = plane.store.create_token("producer", "p-b", "team-b")
    secret = "TEAM-A-PRIVATE-" + uuid.uuid4().hex
    # a few of A's calls, of a few sizes: what is left of a freed request in a heap depends on the
    # sizes of those after it (a shared zygote leaked A's argument in every run this way)
    inv_a = []
    for pad in (130, 90, 60, 40, 25, 15, 7, 0):
        argument = "." * pad + secret
        inv_a.append(_submit(plane, team_a, ref("tests.security.attack_fns", "echo", argument)))
        assert _value(await_result(plane, inv_a[-1])) == argument, n.output()[-3000:]

    inv_b = ids.new_ulid()
    hunted = {
        "A's argument": needles(secret),
        # what every per-task LAKESHORE_* variable of A's names (LAKESHORE_CODE_PATH aside)
        "A's invocation ids": [needle for inv in inv_a for needle in needles(inv)],
        "B's own invocation id": needles(inv_b),  # in B's environment: the scan does find things
    }
    # in a file B's task reads (only digests), so B's own request stays small
    readable = Path(tempfile.mkdtemp(prefix="nymph-sec-needles-"))
    try:
        os.chmod(readable, 0o755)  # B's task runs as a pool user
        needles_file = readable / "needles.json"
        needles_file.write_text(json.dumps([needle for group in hunted.values() for needle in group]))
        os.chmod(needles_file, 0o644)
        scan = ref("tests.security.attack_fns", "scan_memory", str(needles_file))
        assert _submit(plane, team_b, scan, inv_b) == inv_b
        hits = _value(await_result(plane, inv_b))
    finally:
        shutil.rmtree(readable, ignore_errors=True)
    found = {what: sum(hits[d] for _a, _n, d in group) for what, group in hunted.items()}
    assert found["B's own invocation id"] > 0, found
    assert found["A's argument"] == found["A's invocation ids"] == 0, (found, n.output()[-3000:])
    # both were forked (not spawned), each namespace's tasks by a zygote of its own
    assert n.proc is not None
    zygotes = [p for p in psutil.Process(n.proc.pid).children() if ZYGOTE in " ".join(p.cmdline())]
    assert len(zygotes) == 2, n.output()[-3000:]
