"""``HttpDispatch``: the plane as a client of the control plane's HTTP routes (docs/protocol.md).

Bodies are msgpack both ways. One classifier (:func:`_transient`) decides what is retried:
connection errors, 5xx and 429, with exponential backoff and jitter (tenacity); a 4xx never is.
401/403 become :class:`AuthError`, 404 :class:`NotFound`, the rest :class:`PlaneError`, each with
the server's ``error`` text. Every request that can be retried is idempotent on the server: submit
carries its invocation id, chunks their seq, acks their attempt.

Streams follow ``GET .../result/stream?since=`` and reassemble frames with ``wire.FrameReader``; a
dropped connection resumes from the last seq seen, so a consumer never sees a gap or a duplicate.

An HTTP plane is outside the local trust domain: ``trusted = False``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import msgpack
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.dispatch import Claim
from dreamlake.lakeshore.errors import AuthError, NotFound, PlaneError
from dreamlake.lakeshore.store.api import TERMINAL_STATES

if TYPE_CHECKING:
    from dreamlake.lakeshore.wire import Frame

__all__ = ["HttpDispatch"]

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"
_FUNCTION_STUB = {"module": "_native_wire", "qualname": "_native_wire.envelope", "version": "v1"}
_SLACK_S = 10.0  # read-timeout margin over a server-side long poll
_STREAM_RECONNECTS = 5
_KEPT_CANCELS = 1024
_WARNED: set[tuple[str, str]] = set()  # (control plane, queue) whose no-worker warning was logged


def _transient(exc: BaseException) -> bool:
    """Retry connection failures, 5xx and 429; never another 4xx (or an auth failure)."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, PlaneError) and not isinstance(exc, (AuthError, NotFound)):
        return exc.status is not None and (exc.status >= 500 or exc.status == 429)
    return False


class HttpDispatch:
    """A control plane at ``url`` (``http://host:8470``), authenticated with a bearer ``token``."""

    trusted = False

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"control plane url must start with http:// or https://, got {url!r}")
        if not isinstance(token, str) or not token:
            raise ValueError("a token is required: mint one with `lakeshore token create --kind producer`")
        self.url = url.rstrip("/")
        self.retries = max(1, retries)
        self._client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}", "Accept": MSGPACK},
            timeout=httpx.Timeout(timeout, connect=5.0),
            transport=transport,
        )
        self._registered: set[str] = set()
        self._cancels: dict[str, dict[str, bool]] = {}  # worker id -> cancels a poll delivered

    # -- plumbing -----------------------------------------------------------------------------------

    def _raise_for(self, resp: httpx.Response, what: str) -> None:
        try:
            detail = msgpack.unpackb(resp.read(), raw=False)
            message = str(detail.get("error", detail)) if isinstance(detail, dict) else str(detail)
        except Exception:
            message = resp.text[:300]
        status = resp.status_code
        if status in (401, 403):
            raise AuthError(
                f"the control plane at {self.url} refused the token for {what} (HTTP {status}): {message}. "
                "Pass a valid token of the right kind (producer for submit/stream, daemon for workers): "
                "`lakeshore token create --kind producer --name me`",
                status,
            )
        if status == 404:
            raise NotFound(f"{what}: {message}", status)
        raise PlaneError(f"{what} failed with HTTP {status}: {message}", status)

    def _call(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """One request with retries on transient failures; returns the decoded msgpack answer."""
        what = f"{method} {path}"
        content = msgpack.packb(body, use_bin_type=True) if body is not None else None
        headers = {"Content-Type": MSGPACK} if content is not None else None
        extra: dict[str, Any] = {}
        if timeout is not None:
            extra["timeout"] = httpx.Timeout(timeout + _SLACK_S, connect=5.0)

        def once() -> Any:
            resp = self._client.request(method, path, content=content, headers=headers, **extra)
            if resp.status_code >= 400:
                self._raise_for(resp, what)
            return msgpack.unpackb(resp.content, raw=False) if resp.content else {}

        try:
            for attempt in Retrying(
                retry=retry_if_exception(_transient),
                stop=stop_after_attempt(self.retries),
                wait=wait_exponential_jitter(multiplier=0.1, max=5.0, jitter=0.2),
                reraise=True,
            ):
                with attempt:
                    return once()
        except httpx.TransportError as exc:
            raise PlaneError(
                f"cannot reach the control plane at {self.url} ({what}): {type(exc).__name__}: {exc}. "
                "Is `lakeshore server` running there?"
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    # -- producer side ------------------------------------------------------------------------------

    def submit(
        self, envelope: bytes, queue: str, run_config: dict[str, Any], parent: str | None = None
    ) -> str:
        from dreamlake.lakeshore.envelope import Envelope

        body: dict[str, Any] = {
            "invocation_id": Envelope.header(envelope)["id"],
            "queue": queue,
            "function": dict(_FUNCTION_STUB),
            "args_blob": bytes(envelope),
            "run_config": {**run_config, "queue": queue},
            "code_context": {},
        }
        if parent:
            body["parent_invocation_id"] = parent
        out = self._call("POST", "/v1/producer/submit", body)
        warning = out.get("warning")
        if warning and (self.url, queue) not in _WARNED:  # "no worker has polled queue ...": once
            _WARNED.add((self.url, queue))
            log.warning("%s", warning)
        return str(out["invocation_id"])

    def status(self, invocation_id: str) -> dict[str, Any]:
        inv = ids.validate(invocation_id, "invocation id")
        return dict(self._call("GET", f"/v1/producer/invocations/{inv}"))

    def await_result(self, invocation_id: str, timeout: float) -> dict[str, Any]:
        inv = ids.validate(invocation_id, "invocation id")
        body = {"invocation_id": inv, "timeout_s": max(0.0, timeout)}
        return dict(self._call("POST", "/v1/producer/await", body, timeout=timeout))

    def cancel(self, invocation_id: str) -> str:
        inv = ids.validate(invocation_id, "invocation id")
        return str(self._call("POST", f"/v1/producer/invocations/{inv}/cancel", {})["state"])

    def frames(
        self, owner: str, since: int = -1, timeout: float = 30.0, *, topic: bool = False
    ) -> Iterator[Frame]:
        from dreamlake.lakeshore import wire

        if topic:
            path = f"/v1/producer/topics/{owner}/stream"
        else:
            path = f"/v1/producer/invocations/{ids.validate(owner, 'invocation id')}/result/stream"
        last_frame = time.monotonic()
        drops = 0
        terminal = False
        while True:
            patience = max(0.05, timeout - (time.monotonic() - last_frame))
            got_any = False
            try:
                with self._client.stream(
                    "GET",
                    path,
                    params={"since": since, "timeout": patience},
                    timeout=httpx.Timeout(patience + _SLACK_S, connect=5.0),
                ) as resp:
                    if resp.status_code >= 400:
                        self._raise_for(resp, f"GET {path}")
                    reader = wire.FrameReader()
                    for chunk in resp.iter_bytes():
                        for frame in reader.feed(chunk):
                            if frame.seq <= since:
                                continue  # never hand a consumer the same seq twice
                            got_any = True
                            yield frame
                            since = frame.seq
                            last_frame = time.monotonic()
                            if frame.kind in (wire.FRAME_END, wire.FRAME_ERROR):
                                return
            except httpx.TransportError as exc:
                drops += 1
                if drops > _STREAM_RECONNECTS:
                    raise PlaneError(
                        f"lost the stream {path} at seq {since} {drops} times: {exc}; "
                        f"resume later with since={since}"
                    ) from exc
                log.info("stream %s dropped at seq %s (%s); resuming", path, since, exc)
                time.sleep(min(2.0, 0.1 * 2**drops))
                continue
            if got_any:
                drops = 0
            if not topic:
                if terminal and not got_any:
                    return
                if self.status(owner)["state"] in TERMINAL_STATES:
                    terminal = True  # one more replay picks up frames that raced the state check
                    continue
            if time.monotonic() - last_frame >= timeout - 0.05:
                what = f"topic {owner}" if topic else f"invocation {owner}"
                raise TimeoutError(
                    f"no frame from {what} after seq {since} for {timeout} s; resume with since={since} "
                    "and a longer timeout"
                )

    def topic_post(self, name: str, body: bytes, final: bool = False) -> int:
        out = self._call("POST", f"/v1/producer/topics/{name}/post", {"body": bytes(body), "final": final})
        return int(out["seq"])

    # -- worker side --------------------------------------------------------------------------------

    def _register(self, worker_id: str, queues: list[str]) -> None:
        from dreamlake.lakeshore import __version__

        info = {
            "worker_id": worker_id,
            "hostname": socket.gethostname(),
            "version": __version__,
            "runner": "in-process",
            "queues": list(queues),
            "labels": {},
            "slots": 1,
        }
        self._call("POST", "/v1/daemon/register", info)
        self._registered.add(worker_id)

    def claim(self, worker_id: str, queues: list[str], timeout: float) -> Claim | None:
        from dreamlake.lakeshore import __version__

        if worker_id not in self._registered:
            self._register(worker_id, queues)
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            left = max(0.0, deadline - time.monotonic())
            body = {
                "worker_id": worker_id,
                "queues": list(queues),
                "max": 1,
                "kinds": ["run"],  # this worker cannot run exec jobs: never claim one
                "timeout_s": left,
                "version": __version__,
            }
            out = self._call("POST", "/v1/daemon/poll", body, timeout=left)
            for cmd in out.get("commands") or []:
                if cmd.get("kind") == "run":
                    b = cmd["body"]
                    return Claim(
                        b["invocation_id"],
                        b["args_blob"],
                        dict(b.get("run_config") or {}),
                        int(b.get("attempt") or 1),
                    )
                if cmd.get("kind") == "cancel":
                    self._keep_cancel(worker_id, str((cmd.get("body") or {}).get("invocation_id", "")))
                else:
                    log.warning("worker %s ignoring a %s command", worker_id, cmd.get("kind"))
            if time.monotonic() >= deadline:
                return None

    def append_frame(self, invocation_id: str, seq: int, data: bytes, final: bool, attempt: int) -> None:
        body = {
            "invocation_id": invocation_id,
            "seq": seq,
            "bytes": bytes(data),
            "final": final,
            "attempt": attempt,
        }
        self._call("POST", "/v1/daemon/result-chunk", body)

    def ack(
        self,
        invocation_id: str,
        state: str,
        *,
        attempt: int,
        worker_id: str,
        result_blob: bytes | None = None,
        error: dict[str, Any] | None = None,
    ) -> bool:
        body = {
            "invocation_id": invocation_id,
            "state": state,
            "result_blob": bytes(result_blob or b""),
            "error": error,
            "worker_id": worker_id,
            "attempt": attempt,
        }
        try:
            self._call("POST", "/v1/daemon/ack", body)
        except PlaneError as exc:
            if exc.status == 409:
                log.warning("ack of %s refused: %s", invocation_id, exc)
                return False
            raise
        return True

    def heartbeat(self, worker_id: str, running: list[tuple[str, int]]) -> list[str]:
        body = {
            "worker_id": worker_id,
            "running": [{"invocation_id": i, "attempt": a} for i, a in running],
            "free_slots": 0,
        }
        out = self._call("POST", "/v1/daemon/heartbeat", body)
        cancels = [c["body"]["invocation_id"] for c in out.get("commands") or [] if c.get("kind") == "cancel"]
        kept = self._cancels.get(worker_id)
        if kept:
            for inv, _attempt in running:
                if kept.pop(inv, False) and inv not in cancels:
                    cancels.append(inv)
        return cancels

    def _keep_cancel(self, worker_id: str, invocation_id: str) -> None:
        """A cancel a poll delivered: the server hands each command out once, so keep it for the
        next heartbeat that reports that invocation running (bounded: old ones are stale)."""
        kept = self._cancels.setdefault(worker_id, {})
        kept[invocation_id] = True
        while len(kept) > _KEPT_CANCELS:
            kept.pop(next(iter(kept)))
        log.info(
            "worker %s: cancel for %s arrived by poll; kept for the next heartbeat", worker_id, invocation_id
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpDispatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HttpDispatch {self.url}>"
