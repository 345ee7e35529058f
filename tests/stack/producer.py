"""The producer routes over HTTP, as a producer calls them: submit, await, status, stream, any route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import msgpack

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.envelope import Envelope, fn_for
from tests.stack.wait import LIMIT_S, until


def submit_body(
    invocation_id: str,
    queue: str = "default",
    *,
    run_config: dict[str, Any] | None = None,
    args_blob: bytes = b"\x90",
    **extra: Any,
) -> dict[str, Any]:
    """The seed's Submit body."""
    rc = {"queue": queue, "priority": 0.0, "key": None, **(run_config or {})}
    return {
        "invocation_id": invocation_id,
        "queue": queue,
        "function": {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"},
        "args_blob": args_blob,
        "run_config": rc,
        "code_context": {},
        **extra,
    }


def envelope(fn: Callable[..., Any], *args: Any, transport: str = "ref", **kwargs: Any) -> bytes:
    """The Envelope of ``fn(*args, **kwargs)`` (by reference unless ``transport`` says otherwise)."""
    return Envelope.create(fn_for(fn, transport), args, kwargs).to_bytes()


def call(url: str, token: str, path: str, body: Any, timeout: float = 90.0) -> Any:
    """POST ``body`` as msgpack to ``url + path``; the decoded answer (asserts a 200)."""
    resp = httpx.post(
        url + path,
        content=msgpack.packb(body, use_bin_type=True),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-msgpack"},
        timeout=timeout,
    )
    assert resp.status_code == 200, (resp.status_code, resp.content[:300])
    return msgpack.unpackb(resp.content, raw=False)


def submit(url: str, token: str, args_blob: bytes = b"", **run_config: Any) -> str:
    """Submit to the ``default`` queue; the invocation id."""
    body = submit_body(ids.new_ulid(), "default", run_config=run_config, args_blob=args_blob)
    out = call(url, token, "/v1/producer/submit", body)
    return str(out["invocation_id"])


def await_result(url: str, token: str, invocation_id: str, limit_s: float = LIMIT_S) -> dict[str, Any]:
    """The outcome of ``invocation_id`` (asserts it finished within ``limit_s``)."""
    out = call(url, token, "/v1/producer/await", {"invocation_id": invocation_id, "timeout_s": limit_s})
    assert out["state"] != "pending", f"invocation {invocation_id} did not finish"
    return dict(out)


def status_of(url: str, token: str, invocation_id: str) -> dict[str, Any]:
    """The status route's body (``GET /v1/producer/invocations/:id``)."""
    resp = httpx.get(
        f"{url}/v1/producer/invocations/{invocation_id}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    return dict(msgpack.unpackb(resp.content, raw=False))


def state_of(url: str, token: str, invocation_id: str) -> str:
    return str(status_of(url, token, invocation_id)["state"])


def preempted_back_in_queue(url: str, token: str, invocation_id: str) -> dict[str, Any]:
    """Wait until the call is queued again after a preempted attempt; its status."""
    return dict(
        until(
            lambda: (
                (s := status_of(url, token, invocation_id))["state"] == "queued"
                and s["preemptions"] >= 1
                and s
            ),
            f"{invocation_id} to be requeued as preempted",
        )
    )


def frames_of(url: str, token: str, invocation_id: str, timeout: float = 5.0) -> list[wire.Frame]:
    """The result stream's frames so far (one request, from the start)."""
    resp = httpx.get(
        f"{url}/v1/producer/invocations/{invocation_id}/result/stream",
        params={"since": -1, "timeout": timeout},
        headers={"Authorization": f"Bearer {token}"},
        timeout=timeout + 30,
    )
    return wire.FrameReader().feed(resp.content)
