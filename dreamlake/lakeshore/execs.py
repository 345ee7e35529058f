"""Namespace exec jobs from the SDK (seed 003's flows): run a shell command on a nymph, read its
outcome, and decode its typed result.

``Execs(url, token, namespace)`` (a ``namespace`` token, or an admin's) wraps the JSON routes:
``submit(command, queue=..., payload=..., timeout_s=...)`` -> the exec id (``POST
/v1/namespaces/:ns/exec``; a payload over the inline threshold goes through the payload store),
``result(exec_id, wait=...)`` -> an :class:`ExecOutcome` once the job is done (``GET
/v1/namespaces/:ns/jobs/:id/result?wait=N``), with ``result`` the job's typed result, decoded: what
the command wrote to ``$LAKESHORE_RESULT`` (msgpack) or ``result.json`` beside it, carried back as
``resultInline`` or ``resultRef`` (fetched and checked by sha256). ``run`` is both.
``lakeshore exec`` is the same from a shell (:mod:`dreamlake.lakeshore.ops_cli`).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

from dreamlake.lakeshore import blobs, wire
from dreamlake.lakeshore.client import PlaneClient
from dreamlake.lakeshore.protocol import routes

__all__ = ["ExecOutcome", "Execs"]

NO_RESULT: Any = object()
WAIT_S = 30.0  # one long poll of the result route (the server caps it)


@dataclass(frozen=True)
class ExecOutcome:
    """A finished exec job: its exit code, the tails of its output, and its typed result
    (:data:`NO_RESULT` when the command left none)."""

    exec_id: str
    exit_code: int
    stdout: str
    stderr: str
    result: Any = NO_RESULT

    @property
    def has_result(self) -> bool:
        return self.result is not NO_RESULT


class Execs:
    """The exec routes of one namespace (see the module docstring)."""

    def __init__(self, url: str, token: str, namespace: str, *, client: PlaneClient | None = None) -> None:
        self.namespace = namespace
        self._client = client or PlaneClient(url, token)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Execs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        command: str,
        *,
        queue: str = "default",
        payload: Any = NO_RESULT,
        timeout_s: float | None = None,
    ) -> str:
        """Queue ``command`` (``bash -c``) with ``payload`` (any value the codec packs; the
        command finds its msgpack at ``$LAKESHORE_PAYLOAD``); returns the exec id."""
        body: dict[str, Any] = {"command": command, "queue": queue}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if payload is not NO_RESULT:
            from dreamlake.lakeshore.protocol.limits import by_reference, inline_threshold_from_env

            data = wire.pack(payload)
            if not by_reference(len(data), inline_threshold_from_env()):
                body["payloadInline"] = base64.b64encode(data).decode("ascii")
            else:
                body["payloadRef"] = blobs.put(self._client, self.namespace, data)
        out = self._client.request("POST", routes.exec_(self.namespace), body, as_json=True)
        return str(out["exec_id"])

    def result(self, exec_id: str, *, wait: float = 60.0) -> ExecOutcome:
        """The outcome of ``exec_id``, waiting up to ``wait`` seconds; TimeoutError past it."""
        deadline = time.monotonic() + wait
        while True:
            left = max(0.0, deadline - time.monotonic())
            out = self._client.request(
                "GET",
                routes.job_result(self.namespace, exec_id),
                as_json=True,
                params={"wait": min(left, WAIT_S)},
                timeout_s=min(left, WAIT_S) + 10.0,
            )
            if isinstance(out, dict) and out.get("state") == "done":
                return self._outcome(out)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"exec job {exec_id} is not done after {wait:g} s; ask again with a longer wait"
                )

    def output(self, exec_id: str, stream: str = "stdout") -> bytes:
        """The whole ``stream`` (``stdout`` or ``stderr``) of a done exec job, from the exec output
        archive (the result's ``stdout`` / ``stderr`` hold only their last 1 MiB); NotFound when
        it printed nothing."""
        route = routes.job_output(self.namespace, exec_id, stream)
        chunks = []
        with self._client.stream(route, timeout_s=120.0) as resp:
            for piece in resp.iter_bytes():
                chunks.append(piece)
        return b"".join(chunks)

    def run(self, command: str, *, wait: float = 60.0, **kwargs: Any) -> ExecOutcome:
        """:meth:`submit` then :meth:`result`."""
        return self.result(self.submit(command, **kwargs), wait=wait)

    def _outcome(self, out: dict[str, Any]) -> ExecOutcome:
        result: Any = NO_RESULT
        if out.get("resultInline") is not None:
            result = wire.unpack(base64.b64decode(out["resultInline"]))
        elif out.get("resultRef") is not None:
            data = blobs.get(self._client, self.namespace, dict(out["resultRef"]))
            assert data is not None
            result = wire.unpack(bytes(data))
        return ExecOutcome(
            exec_id=str(out["exec_id"]),
            exit_code=int(out.get("exit_code") or 0),
            stdout=str(out.get("stdout") or ""),
            stderr=str(out.get("stderr") or ""),
            result=result,
        )
