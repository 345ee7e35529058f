"""``ProducerClient``: the ``/v1/producer/*`` routes (and the operator routes a producer reads).

``HttpDispatch``'s producer plane speaks through it; what the plane adds (payloads by reference,
a batch split in requests, an older control plane's fallbacks, the no-worker warning once) stays
in the plane. Transport, token, retry rule and error tree are the one control-plane client's
(:class:`~dreamlake.lakeshore.client.PlaneClient`). A route that waits on the server (submit with
``wait_s``, await) reads for that long plus :data:`~dreamlake.lakeshore.protocol.daemon.SLACK_S`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from dreamlake.lakeshore.client import PlaneClient
from dreamlake.lakeshore.errors import NotFound
from dreamlake.lakeshore.protocol import routes
from dreamlake.lakeshore.protocol.daemon import SLACK_S
from dreamlake.lakeshore.protocol.limits import ServerLimits

if TYPE_CHECKING:
    from dreamlake.lakeshore.protocol.shapes import (
        AwaitAnswer,
        SubmitAnswer,
        SubmitBatchAnswer,
        SubmitBody,
    )

__all__ = ["ProducerClient"]


def _wait(wait_s: float | None) -> float | None:
    return None if wait_s is None else max(0.0, wait_s) + SLACK_S


# A request that waits (submit with ``wait_s``, await) retries a failure only while its caller
# still waits (``f.call(timeout=1)`` against a control plane answering 503 took the whole retry
# window, 60 s by default), but never for less than this: a dropped connection is still retried.
RETRY_AT_LEAST_S = 2.0


def _within(wait_s: float | None) -> float | None:
    return None if wait_s is None else max(RETRY_AT_LEAST_S, wait_s)


class ProducerClient(PlaneClient):
    """The producer routes over one :class:`PlaneClient` (thread-safe, as it is)."""

    def submit(self, body: SubmitBody | dict[str, Any], *, wait_s: float | None = None) -> SubmitAnswer:
        """Queue one call (``wait_s``: and await it for up to that long, in the same request)."""
        if wait_s is not None:
            body = cast("SubmitBody", {**body, "wait_s": wait_s})
        answer = self.request("POST", routes.SUBMIT, body, timeout_s=_wait(wait_s), within_s=_within(wait_s))
        return cast("SubmitAnswer", answer)

    def submit_batch(self, common: dict[str, Any], submits: Sequence[dict[str, Any]]) -> SubmitBatchAnswer:
        """Many calls in one request (one transaction); ``common`` holds what every call shares."""
        body = {"common": common, "submits": list(submits)}
        return cast("SubmitBatchAnswer", self.request("POST", routes.SUBMIT_BATCH, body))

    def status(self, invocation_id: str) -> dict[str, Any]:
        return dict(self.request("GET", routes.invocation(invocation_id)))

    def await_result(self, invocation_id: str, timeout: float) -> AwaitAnswer:
        body = {"invocation_id": invocation_id, "timeout_s": max(0.0, timeout)}
        answer = self.request("POST", routes.AWAIT, body, timeout_s=_wait(timeout), within_s=_within(timeout))
        return cast("AwaitAnswer", dict(answer))

    def await_batch(self, invocation_ids: Sequence[str], timeout: float) -> dict[str, Any]:
        body = {"invocation_ids": list(invocation_ids), "timeout_s": max(0.0, timeout)}
        return dict(self.request("POST", routes.AWAIT_BATCH, body, timeout_s=_wait(timeout)))

    def cancel(self, invocation_id: str, descendants: bool = True) -> dict[str, Any]:
        body = {"descendants": bool(descendants)}
        return dict(self.request("POST", routes.cancel(invocation_id), body))

    def topic_post(self, name: str, body: bytes, final: bool = False) -> dict[str, Any]:
        return dict(self.request("POST", routes.topic_post(name), {"body": bytes(body), "final": final}))

    def send(self, invocation_id: str, index: int, kind: str, body: Any = None) -> dict[str, Any]:
        out = self.request("POST", routes.send(invocation_id), {"index": index, "kind": kind, "body": body})
        return dict(out)

    def whoami(self) -> dict[str, Any]:
        """``{kind, name, namespace}`` of this client's token."""
        return dict(self.request("GET", routes.WHOAMI, as_json=True) or {})

    def live_workers(self, *, limit: int = 500) -> list[dict[str, Any]]:
        """The live workers this token may see (one try: a hint, never worth a wait)."""
        params = {"live": "1", "limit": limit}
        out = self.request("GET", routes.WORKERS, as_json=True, params=params, attempts=1)
        return list((out or {}).get("workers") or [])

    def info(self) -> ServerLimits:
        """The control plane's limits (``GET /v1/ops/info``); an older control plane without the
        route is taken to allow :class:`ServerLimits`' defaults."""
        try:
            answer = self.request("GET", routes.INFO, as_json=True)
        except NotFound as exc:
            if "no route" not in str(exc):
                raise
            return ServerLimits()
        return ServerLimits.from_answer(answer)
