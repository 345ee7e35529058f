"""Random and mutated bodies to every route: never a 5xx, never a change to an unrelated row."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body

ROUNDS = 300


def _valid_bodies() -> list[tuple[str, str, Any]]:
    inv, worker, job = new_ulid(), new_ulid(), new_ulid()
    frame = wire.encode_frame(1, 0, wire.pack(1), {"ts": 0.0})
    return [
        ("POST", "/v1/producer/submit", submit_body(inv)),
        ("POST", "/v1/producer/await", {"invocation_id": inv, "timeout_s": 0}),
        ("POST", f"/v1/producer/invocations/{inv}/cancel", {}),
        ("GET", f"/v1/producer/invocations/{inv}", None),
        ("GET", f"/v1/producer/invocations/{inv}/result/stream?since=-1&timeout=0", None),
        ("POST", "/v1/producer/topics/fuzz/post", {"body": b"\xc0", "final": False}),
        ("GET", "/v1/producer/topics/fuzz/stream?since=-1&timeout=0", None),
        (
            "POST",
            "/v1/daemon/register",
            {
                "worker_id": worker,
                "hostname": "h",
                "version": "1",
                "runner": "p",
                "queues": ["default"],
                "labels": {},
                "slots": 1,
            },
        ),
        ("POST", "/v1/daemon/poll", {"worker_id": worker, "queues": ["default"], "max": 1, "timeout_s": 0}),
        (
            "POST",
            "/v1/daemon/ack",
            {"invocation_id": inv, "state": "succeeded", "result_blob": b"", "error": None, "attempt": 1},
        ),
        ("POST", "/v1/daemon/result-chunk", {"invocation_id": inv, "seq": 0, "bytes": frame, "final": False}),
        (
            "POST",
            "/v1/daemon/heartbeat",
            {"worker_id": worker, "running": [{"invocation_id": inv, "attempt": 1}], "free_slots": 1},
        ),
        ("POST", "/v1/namespaces/fz/exec", {"command": "true", "payloadInline": "AA==", "queue": "default"}),
        ("GET", f"/v1/namespaces/fz/jobs/{job}/result?wait=0", None),
        ("POST", f"/v1/namespaces/fz/jobs/{job}/result", {"exit_code": 0, "stdout": "", "stderr": ""}),
        ("POST", "/v1/namespaces/fz/payloads/presign", {"op": "put", "size": 1}),
        ("PUT", "/v1/namespaces/fz/pin", {"nymph_version": "1.0"}),
    ]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    choices: list[Any] = [
        None,
        True,
        rng.randint(-(2**63), 2**64 - 1),
        rng.random() * 1e6,
        float("nan"),
        "",
        "x" * rng.randint(0, 40),
        new_ulid(),
        "../etc/passwd",
        rng.randbytes(rng.randint(0, 30)),
        -1,
        0,
        2**40,
    ]
    if depth < 3:
        choices += [
            [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))],
            {
                rng.choice(["invocation_id", "queue", "seq", "body", "x", "error"]): _random_value(
                    rng, depth + 1
                )
                for _ in range(rng.randint(0, 4))
            },
        ]
    return rng.choice(choices)


def _mutate(rng: random.Random, body: Any) -> Any:
    if not isinstance(body, dict) or not body or rng.random() < 0.15:
        return _random_value(rng)
    body = dict(body)
    key = rng.choice(list(body))
    action = rng.randrange(4)
    if action == 0:
        del body[key]
    elif action == 1:
        body[key] = _random_value(rng)
    elif action == 2:
        body[rng.choice(["extra", "attempt", "worker_id", "payloadRef", "since"])] = _random_value(rng)
    else:
        body[key] = {"nested": body[key]}
    return body


def _encode(rng: random.Random, path: str, body: Any) -> bytes:
    as_json = path.startswith("/v1/namespaces/")
    if as_json:
        try:
            data = json.dumps(body, default=lambda b: b.hex() if isinstance(b, bytes) else str(b)).encode()
        except ValueError:
            data = b"{}"
    else:
        data = msgpack.packb(body, use_bin_type=True)
    if rng.random() < 0.15:  # byte-level damage
        cut = rng.randint(0, len(data))
        data = data[:cut] + rng.randbytes(rng.randint(0, 4)) + data[cut + 1 :]
    return data


@pytest.fixture
def fuzz_plane(store_url: str) -> Iterator[ControlPlane]:
    """SQLite and PostgreSQL (``store_url`` is parametrized over both)."""
    config = ServerConfig(poll_max_s=0.05, await_max_s=0.05, stream_max_s=0.05, exec_wait_max_s=0.05)
    with running_control_plane(store_url, config=config) as cp:
        yield cp


def test_fuzzed_bodies_never_5xx_nor_touch_other_rows(fuzz_plane: ControlPlane) -> None:
    cp = fuzz_plane
    keep = cp.submit("untouchable", args_blob=b"precious")
    before = cp.store.get(keep)
    rng = random.Random(20240611)
    routes = _valid_bodies()
    failures: list[str] = []
    with httpx.Client(
        base_url=cp.url, timeout=30, headers={"Authorization": f"Bearer {cp.admin_token}"}
    ) as client:
        for i in range(ROUNDS):
            method, path, valid = rng.choice(routes)
            body = _mutate(rng, valid) if i % 5 else valid
            content = None if method == "GET" else _encode(rng, path, body)
            r = client.request(method, path, content=content)
            if r.status_code >= 500 and r.status_code != 501:  # 501: no payload bucket here
                failures.append(f"{method} {path} {body!r:.200} -> {r.status_code} {r.content[:200]!r}")
    assert failures == []
    assert cp.store.get(keep) == before
