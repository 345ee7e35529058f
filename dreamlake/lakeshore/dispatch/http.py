"""``HttpDispatch``: the plane as a client of the control plane's HTTP routes (docs/protocol.md).

Every request goes through the one control-plane client (:class:`~dreamlake.lakeshore.client.
PlaneClient`): msgpack bodies both ways, one retry rule (connection errors, timeouts, 5xx and 429
are retried for ``retry_window`` seconds, 60 by default or ``$LAKESHORE_RETRY_WINDOW``, with
exponential backoff and jitter, so a call outlasts a restart of the server; a 4xx never is) and one error
tree (401/403 :class:`AuthError` saying how to mint a token, 404 :class:`NotFound`, 409
:class:`Conflict`, another 4xx :class:`BadRequest`, what stayed unreachable :class:`Unavailable`),
each with the server's ``error`` text. Every request that can be retried is idempotent on the
server: submit carries its invocation id (the Envelope's id: a retried submit answers the invocation
the first one stored, never a second), chunks their seq, acks their attempt. A submit whose failure
outlasts the window raises with ``invocation_id`` set: the call may have been stored, so ask for its
status, or submit the same Envelope again (never a new one, which would run the call twice).

Frames go in batches (``POST /v1/daemon/result-chunks``, one request per batch) through a frame
writer (:mod:`~dreamlake.lakeshore.dispatch.batching`); an ack waits for its frames.

Streams follow ``GET .../result/stream?since=`` and reassemble frames with ``wire.FrameReader``; a
dropped connection resumes from the last seq seen, so a consumer never sees a gap or a duplicate.

Big payloads go by reference (seed 003, docs/protocol.md "Payload refs"): an Envelope over the
inline threshold (``INLINE_THRESHOLD_BYTES``, 256 KiB, or ``inline_threshold=``) is uploaded
through the presign route (:mod:`~dreamlake.lakeshore.blobs`) and submitted as ``args_ref``; a
``result_ref`` in an await answer, an ``args_ref`` in a claim and a frame whose body is ``{"ref":
...}`` are downloaded (sha256 checked) before the caller sees them, so ``q.result(inv)`` returns
the value either way. As a worker, results and frame bodies over the control plane's threshold
(its register answer) go up the same way. A control plane without a payload store (presign answers
501) keeps everything inline.

An HTTP plane is outside the local trust domain: ``trusted = False``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import envvars, ids
from dreamlake.lakeshore.client import (
    DEFAULT_RETRY_WINDOW_S,
    RETRY_WINDOW_ENV,
    PlaneClient,
    error_for,
    is_retryable,
)
from dreamlake.lakeshore.dispatch import NATIVE_FUNCTION, Claim, Plane, error_ends_stream
from dreamlake.lakeshore.dispatch.batching import FrameWriter
from dreamlake.lakeshore.errors import BadRequest, Conflict, NotFound, PlaneError, Unavailable
from dreamlake.lakeshore.states import TERMINAL_STATES

if TYPE_CHECKING:
    import httpx

    from dreamlake.lakeshore.envelope import Envelope
    from dreamlake.lakeshore.wire import Frame

__all__ = ["HttpDispatch"]


log = logging.getLogger(__name__)


def _header_id(data: bytes | bytearray | memoryview) -> str:
    """The invocation id in the header of Envelope bytes (submitted as bytes, not as an Envelope)."""
    from dreamlake.lakeshore.envelope import Envelope

    return str(Envelope.header(bytes(data))["id"])


_SLACK_S = 10.0  # read-timeout margin over a server-side long poll
_STREAM_RECONNECTS = 5
POLL_ACKS_MAX = 256  # acks one poll carries at most (the control plane's limit)
ACK_TRIES = 3  # polls an ack the store failed (5xx) rides before it is given up
_WARNED: set[tuple[str, str]] = set()  # (control plane, queue) whose no-worker warning was logged
# (control plane, queue) -> when its workers were last asked whether they run pickled functions
_PICKLES_ASKED: dict[tuple[str, str], float] = {}
PICKLES_ASK_EVERY_S = 30.0  # while no live worker serves the queue, ask again at most this often
DEFAULT_INLINE_THRESHOLD_BYTES = envvars.DEFAULT_INLINE_THRESHOLD_BYTES  # seed 003
# A submit batch (POST /v1/producer/submit-batch) holds at most this many calls and about this many
# bytes of Envelopes: well under the server's caps (1,000 items, 110 MiB), big enough that a sweep
# pays one request and one transaction per few hundred calls.
SUBMIT_BATCH_ITEMS = 500
AWAIT_BATCH_MAX = 1000  # ids one await-batch request asks for at most (the control plane's limit)
SUBMIT_BATCH_BYTES = 8 * 1024 * 1024


def inline_threshold_from_env() -> int:
    """``INLINE_THRESHOLD_BYTES`` of this process (the SDK's side of seed 003's knob), else 256 KiB."""
    return envvars.inline_threshold()


def _retry_window() -> float:
    """``$LAKESHORE_RETRY_WINDOW`` (seconds), else the default; a bad value says what to set."""
    return envvars.number(RETRY_WINDOW_ENV, default=DEFAULT_RETRY_WINDOW_S)


def _submit_failed(exc: PlaneError, invocation_id: str, window: float) -> PlaneError:
    """The error of a submit, carrying ``invocation_id``; one that outlasted the retry window says
    the call may be stored and how to find out (a fresh submit would run it twice)."""
    if isinstance(exc, Unavailable):
        new: PlaneError = Unavailable(
            f"submit of invocation {invocation_id} got no answer within the {window:g} s retry window: "
            f"{exc}. It may have been stored: ask for its status (plane.status({invocation_id!r}) or "
            f"`lakeshore show {invocation_id}`), or submit the same call again (the same Envelope id: "
            "a submit is idempotent on it); never submit it anew, which would run it twice",
            exc.status,
            exc.retry_after,
        )
    else:
        new = type(exc)(str(exc), exc.status)
        new.__dict__.update(vars(exc))  # e.g. a QuotaExceeded's quota, limit and retry_after
    new.invocation_id = invocation_id
    return new


def _batch_failed(err: PlaneError, invocation_id: str, n: int) -> PlaneError:
    """The error of one call whose submit batch (of ``n``) failed as a whole: ``err``'s kind and
    text, with the call's own ``invocation_id``."""
    new = type(err)(f"the submit batch of {n} calls holding {invocation_id} failed: {err}", err.status)
    new.__dict__.update({k: v for k, v in vars(err).items() if k != "invocation_ids"})
    new.invocation_id = invocation_id
    return new


class HttpDispatch(Plane):
    """A control plane at ``url`` (``http://host:8470``), authenticated with a bearer ``token``.

    A transient failure is retried for ``retry_window`` seconds (default ``$LAKESHORE_RETRY_WINDOW``,
    else ``DEFAULT_RETRY_WINDOW_S``) and, when ``retries`` is given, at most that many times.
    """

    trusted = False
    runs_async = True  # every runner of nymph and `lakeshore worker` runs an async def (asyncio.run)
    acks_ride_polls = True  # ack(later=True) rides the worker's next claim_batch (one request fewer)

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 30.0,
        retries: int | None = None,
        retry_window: float | None = None,
        transport: httpx.BaseTransport | None = None,
        inline_threshold: int | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"control plane url must start with http:// or https://, got {url!r}")
        if not isinstance(token, str) or not token:
            raise ValueError("a token is required: mint one with `lakeshore token create --kind producer`")
        window = _retry_window() if retry_window is None else float(retry_window)
        self._client = PlaneClient(
            url, token, timeout_s=timeout, attempts=retries, window_s=window, transport=transport
        )
        self.url = self._client.url
        self.retries = self._client.attempts
        self.retry_window = window
        self._registered: set[str] = set()
        self._frames = FrameWriter(self._write_frames)
        self._later: dict[str, list[dict[str, Any]]] = {}  # worker id -> acks for its next poll
        self._ack_tries: dict[str, int] = {}  # invocation id -> polls its ack rode and the store failed
        # payloads over this go by reference; None once the control plane said it has no store
        self.inline_threshold: int | None = (
            inline_threshold if inline_threshold is not None else inline_threshold_from_env()
        )
        self._worker_threshold: int | None = None  # the control plane's, from the register answer
        self._namespace: str | None = None

    # -- payloads by reference ----------------------------------------------------------------------

    def namespace(self) -> str:
        """The namespace this token acts in (presign routes name it): asked once, ``whoami``."""
        if self._namespace is None:
            who = self._client.request("GET", "/v1/ops/whoami", as_json=True)
            self._namespace = str((who or {}).get("namespace") or "default")
        return self._namespace

    def _upload(self, data: bytes | list[bytes], job_id: str, kind: str) -> dict[str, Any] | None:
        """``data`` uploaded through the presign route -> its ref; None when the control plane has
        no payload store (501: it takes everything inline, and is not asked again)."""
        from dreamlake.lakeshore import blobs

        try:
            return blobs.put(
                self._client, self.namespace(), data, job_id=blobs.private_job_id(job_id), kind=kind
            )
        except PlaneError as exc:
            if exc.status == 501:
                log.info("%s has no payload store: payloads stay inline", self.url)
                self.inline_threshold = None
                self._worker_threshold = None
                return None
            raise

    def _download(self, ref: Any, what: str) -> bytes:
        from dreamlake.lakeshore import blobs

        data = blobs.get(self._client, self.namespace(), blobs.check_ref(ref, what))
        return bytes(data or b"")

    def _resolve_frame(self, frame: Frame) -> Frame:
        """A frame whose body is ``{"ref": ...}``, with the referenced bytes as its body."""
        from dreamlake.lakeshore import wire

        body = frame.body
        if frame.kind in (wire.FRAME_VALUE, wire.FRAME_END) and isinstance(body, dict) and "ref" in body:
            return frame._replace(body=self._download(body["ref"], f"frame {frame.seq}"))
        return frame

    def _call(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """One request, retried on transient failures; ``timeout`` is a server-side wait to outlast."""
        timeout_s = None if timeout is None else timeout + _SLACK_S
        return self._client.request(method, path, body, timeout_s=timeout_s)

    # -- producer side ------------------------------------------------------------------------------

    def submit(
        self, envelope: Envelope | bytes, queue: str, run_config: dict[str, Any], parent: str | None = None
    ) -> str:
        """Queue a call. An Envelope over the inline threshold goes to the payload store from
        :meth:`Envelope.to_parts` (its arguments read in place), never joined in memory; Envelope
        bytes are sent as they are (the id read from their header)."""
        if isinstance(envelope, (bytes, bytearray, memoryview)):
            data = bytes(envelope)
            return self._submit(_header_id(data), data, queue, run_config, parent, None)[0]
        parts = envelope.to_parts()
        limit = self.inline_threshold
        if limit is not None and sum(len(p) for p in parts) > limit:
            ref = self._upload(parts, envelope.id, "args")
            if ref is not None:
                return self._submit(envelope.id, None, queue, run_config, parent, None, args_ref=ref)[0]
        return self._submit(envelope.id, b"".join(parts), queue, run_config, parent, None)[0]

    def submit_batch(
        self, calls: Sequence[tuple[Envelope, str, dict[str, Any], str | None]]
    ) -> list[str | PlaneError]:
        """Submit many calls, ``(envelope, queue, run_config, parent)`` each, in requests of up to
        ``SUBMIT_BATCH_ITEMS`` calls (``POST /v1/producer/submit-batch``, one transaction each);
        per call, in order, its invocation id or the error its :meth:`submit` would raise (with
        ``invocation_id`` set). An Envelope over the inline threshold goes to the payload store
        first, as with :meth:`submit`. A request retried after a lost answer is harmless: every
        call carries its Envelope's id. A control plane without the route gets single submits."""
        out: list[str | PlaneError] = []
        chunk: list[tuple[Envelope, dict[str, Any]]] = []
        size = 0
        for envelope, queue, run_config, parent in calls:
            item = self._batch_item(envelope, queue, run_config, parent)
            blob = item.get("args_blob")
            n = len(blob) if isinstance(blob, bytes) else 512
            if chunk and (len(chunk) >= SUBMIT_BATCH_ITEMS or size + n > SUBMIT_BATCH_BYTES):
                out += self._submit_chunk(chunk)
                chunk, size = [], 0
            chunk.append((envelope, item))
            size += n
        if chunk:
            out += self._submit_chunk(chunk)
        return out

    def _batch_item(
        self, envelope: Envelope, queue: str, run_config: dict[str, Any], parent: str | None
    ) -> dict[str, Any]:
        """One call's submit body, less what every call of a batch shares (``function``)."""
        item: dict[str, Any] = {
            "invocation_id": envelope.id,
            "queue": queue,
            "run_config": {**run_config, "queue": queue},
        }
        parts = envelope.to_parts()
        limit = self.inline_threshold
        ref = None
        if limit is not None and sum(len(p) for p in parts) > limit:
            ref = self._upload(parts, envelope.id, "args")
        if ref is not None:
            item["args_ref"] = ref
        else:
            item["args_blob"] = b"".join(parts)
        if parent:
            item["parent_invocation_id"] = parent
        return item

    def _submit_chunk(self, chunk: list[tuple[Envelope, dict[str, Any]]]) -> list[str | PlaneError]:
        items = [item for _, item in chunk]
        common: dict[str, Any] = {"function": dict(NATIVE_FUNCTION), "code_context": {}}
        first = items[0]
        if all(i["queue"] == first["queue"] and i["run_config"] == first["run_config"] for i in items):
            common.update(queue=first["queue"], run_config=first["run_config"])  # a sweep's: sent once
            items = [{k: v for k, v in i.items() if k not in ("queue", "run_config")} for i in items]
        try:
            answer = self._call("POST", "/v1/producer/submit-batch", {"common": common, "submits": items})
        except NotFound as exc:
            if "no route" not in str(exc):
                raise
            log.info("%s has no submit-batch route (an older control plane): submitting one by one", self.url)
            return [self._submit_one(envelope, item) for envelope, item in chunk]
        except PlaneError as exc:  # the whole request: each call may or may not be stored
            err = _submit_failed(exc, chunk[0][0].id, self.retry_window)
            return [_batch_failed(err, envelope.id, len(chunk)) for envelope, _ in chunk]
        for queue, warning in (answer.get("warnings") or {}).items():
            if (self.url, queue) not in _WARNED:
                _WARNED.add((self.url, queue))
                log.warning("%s", warning)
        if len(answer["results"]) != len(chunk):
            raise Unavailable(
                f"submit-batch answered {len(answer['results'])} results for {len(chunk)} calls"
            )
        out: list[str | PlaneError] = []
        for (envelope, item), got in zip(chunk, answer["results"]):  # noqa: B905 (Python 3.9: no strict)
            if "error" not in got:
                out.append(str(got["invocation_id"]))
                continue
            status = int(got.get("status") or 400)
            if status == 413 and "args_ref" in str(got["error"]) and "args_blob" in item:
                out.append(self._submit_one(envelope, item))  # the server's threshold is lower: by ref
                continue
            err = error_for(status, str(got["error"]))
            err.invocation_id = envelope.id
            out.append(err)
        return out

    def _submit_one(self, envelope: Envelope, item: dict[str, Any]) -> str | PlaneError:
        """One call of a batch through the single submit route (its error, not raised)."""
        try:
            return self.submit(envelope, item["queue"], item["run_config"], item.get("parent_invocation_id"))
        except PlaneError as exc:
            return exc

    def submit_and_wait(
        self,
        envelope: Envelope | bytes,
        queue: str,
        run_config: dict[str, Any],
        parent: str | None,
        timeout: float,
    ) -> tuple[str, dict[str, Any] | None]:
        """Submit and await in one request (``submit`` with ``wait_s``): the invocation id and the
        await answer after up to ``timeout`` s (``{state: pending}`` when not yet terminal)."""
        if isinstance(envelope, (bytes, bytearray, memoryview)):
            data, invocation_id = bytes(envelope), _header_id(envelope)
        else:
            data, invocation_id = envelope.to_bytes(), envelope.id
        inv, out = self._submit(invocation_id, data, queue, run_config, parent, max(0.0, timeout))
        return inv, self._resolved(dict(out.get("outcome") or {"state": "pending"}), inv)

    def _submit(
        self,
        invocation_id: str,
        envelope: bytes | None,
        queue: str,
        run_config: dict[str, Any],
        parent: str | None,
        wait_s: float | None,
        *,
        args_ref: dict[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "invocation_id": invocation_id,
            "queue": queue,
            "function": dict(NATIVE_FUNCTION),
            "run_config": {**run_config, "queue": queue},
            "code_context": {},
        }
        if args_ref is not None:
            body["args_ref"] = args_ref
        else:
            assert envelope is not None
            body["args_blob"] = bytes(envelope)
        if parent:
            body["parent_invocation_id"] = parent
        if wait_s is not None:
            body["wait_s"] = wait_s
        limit = self.inline_threshold
        if envelope is not None and limit is not None and len(envelope) > limit:
            self._by_reference(body, envelope)
        try:
            try:
                out = self._call("POST", "/v1/producer/submit", body, timeout=wait_s)
            except BadRequest as exc:  # the control plane's threshold is lower than ours: go by reference
                if (
                    exc.status != 413
                    or "args_ref" not in str(exc)
                    or envelope is None
                    or "args_blob" not in body
                ):
                    raise
                self._by_reference(body, envelope)
                if "args_ref" not in body:
                    raise
                out = self._call("POST", "/v1/producer/submit", body, timeout=wait_s)
        except PlaneError as exc:
            raise _submit_failed(exc, body["invocation_id"], self.retry_window) from exc
        warning = out.get("warning")
        if warning and (self.url, queue) not in _WARNED:  # "no worker has polled queue ...": once
            _WARNED.add((self.url, queue))
            log.warning("%s", warning)
        return str(out["invocation_id"]), out

    def _by_reference(self, body: dict[str, Any], envelope: bytes) -> None:
        """Move the submit's Envelope to the payload store (``args_ref``), when there is one."""
        ref = self._upload(envelope, body["invocation_id"], "args")
        if ref is not None:
            body.pop("args_blob", None)
            body["args_ref"] = ref

    def _resolved(self, out: dict[str, Any], invocation_id: str) -> dict[str, Any]:
        """An await answer with a ``result_ref`` fetched (sha256 checked) into ``result_blob``."""
        ref = out.pop("result_ref", None)
        if ref is not None:
            out["result_blob"] = self._download(ref, f"result_ref of {invocation_id}")
        return out

    def warn_if_pickles_refused(self, queue: str, what: str) -> None:
        """Before a pickled call of ``what`` goes to ``queue``: log a warning naming the fix when
        every live worker serving the queue said (at register) that it refuses pickled functions,
        as ``nymph start`` without ``--allow-pickled`` does. Asked once per queue (while no live
        worker serves it, again every ``PICKLES_ASK_EVERY_S``); never fails the submit."""
        key = (self.url, queue)
        asked = _PICKLES_ASKED.get(key)
        if asked is not None and (asked == float("inf") or time.monotonic() - asked < PICKLES_ASK_EVERY_S):
            return
        _PICKLES_ASKED[key] = time.monotonic()
        try:
            out = self._client.request(
                "GET", "/v1/ops/workers", as_json=True, params={"live": "1", "limit": 500}, attempts=1
            )
        except PlaneError as exc:  # e.g. a task's token, which may not list workers: no warning
            log.debug("cannot ask which workers run pickled functions: %s", exc)
            return
        serving = [w for w in (out or {}).get("workers") or [] if queue in (w.get("queues") or [])]
        if not serving:
            return
        _PICKLES_ASKED[key] = float("inf")  # asked and answered: once per queue
        if all(w.get("allow_pickled") is False for w in serving):
            log.warning(
                "%s travels pickled (it is not importable by module: defined in __main__, a notebook "
                "or a closure), and every live worker of queue %r refuses pickled functions, so it "
                "will fail with PickleRefused. Define it in a module next to your script (it then "
                "ships by reference), or start the nymph with --allow-pickled "
                "(`lakeshore worker start --allow-pickled`)",
                what,
                queue,
            )

    def status(self, invocation_id: str) -> dict[str, Any]:
        inv = ids.validate(invocation_id, "invocation id")
        return dict(self._call("GET", f"/v1/producer/invocations/{inv}"))

    def await_result(self, invocation_id: str, timeout: float) -> dict[str, Any]:
        inv = ids.validate(invocation_id, "invocation id")
        body = {"invocation_id": inv, "timeout_s": max(0.0, timeout)}
        return self._resolved(dict(self._call("POST", "/v1/producer/await", body, timeout=timeout)), inv)

    def await_batch(self, invocation_ids: Sequence[str], timeout: float) -> dict[str, Any]:
        """The outcomes of many invocations in one request (``POST /v1/producer/await-batch``,
        up to ``AWAIT_BATCH_MAX`` ids), waiting up to ``timeout`` for any of them to end:
        ``{"results": {id: {state, result_blob, error}}, "states": {id: state}, "unknown": [id]}``
        (``results``: the terminal ones, result refs fetched; ``states``: the others). A control
        plane without the route gets one await per id (the first waits)."""
        wanted = [ids.validate(i, "invocation id") for i in invocation_ids][:AWAIT_BATCH_MAX]
        body = {"invocation_ids": wanted, "timeout_s": max(0.0, timeout)}
        try:
            out = self._call("POST", "/v1/producer/await-batch", body, timeout=timeout)
        except NotFound as exc:
            if "no route" not in str(exc):
                raise
            return self._await_each(wanted, timeout)
        results = {
            str(r["invocation_id"]): self._resolved(dict(r), str(r["invocation_id"]))
            for r in out.get("results") or []
        }
        return {
            "results": results,
            "states": dict(out.get("states") or {}),
            "unknown": list(out.get("unknown") or []),
        }

    def _await_each(self, wanted: list[str], timeout: float) -> dict[str, Any]:
        """``await_batch`` on a control plane without the route (an older one)."""
        out: dict[str, Any] = {"results": {}, "states": {}, "unknown": []}
        for n, inv in enumerate(wanted):
            try:
                got = self.await_result(inv, timeout if n == 0 else 0.0)
            except NotFound:
                out["unknown"].append(inv)
                continue
            if got.get("state") in TERMINAL_STATES:
                out["results"][inv] = got
            else:
                out["states"][inv] = str(got.get("state") or "pending")
        return out

    def cancel(self, invocation_id: str, descendants: bool = True) -> str:
        inv = ids.validate(invocation_id, "invocation id")
        body = {"descendants": bool(descendants)}
        return str(self._call("POST", f"/v1/producer/invocations/{inv}/cancel", body)["state"])

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
        first_drop: float | None = None  # when the current run of reconnects began
        terminal = False
        while True:
            patience = max(0.05, timeout - (time.monotonic() - last_frame))
            got_any = False
            try:
                with self._client.stream(
                    path, params={"since": since, "timeout": patience}, timeout_s=patience + _SLACK_S
                ) as resp:
                    reader = wire.FrameReader()
                    skipped = False  # a retried attempt's ERROR: reconnect after it
                    for chunk in resp.iter_bytes():
                        if skipped:
                            break
                        for frame in reader.feed(chunk):
                            if frame.seq <= since:
                                continue  # never hand a consumer the same seq twice
                            got_any = True
                            last_frame = time.monotonic()
                            retried = frame.kind == wire.FRAME_ERROR and not topic
                            if retried and not error_ends_stream(lambda: self.status(owner), frame, timeout):
                                since, skipped = frame.seq, True  # its restart follows
                                break
                            yield self._resolve_frame(frame)
                            since = frame.seq
                            if frame.kind in (wire.FRAME_END, wire.FRAME_ERROR):
                                return
            except PlaneError as exc:
                if not is_retryable(exc):
                    raise
                drops += 1
                if got_any or first_drop is None:
                    first_drop = time.monotonic()
                if drops > _STREAM_RECONNECTS and time.monotonic() - first_drop > self.retry_window:
                    raise Unavailable(
                        f"lost the stream {path} at seq {since} {drops} times over "
                        f"{self.retry_window:g} s: {exc}; resume later with since={since}",
                        exc.status,
                    ) from exc
                log.info("stream %s dropped at seq %s (%s); resuming", path, since, exc)
                time.sleep(min(2.0, 0.1 * 2**drops))
                last_frame = time.monotonic()  # an outage is not the producer's silence
                if got_any:
                    drops = 0
                continue
            if got_any:
                drops, first_drop = 0, None
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

    def send(self, invocation_id: str, index: int, kind: str, body: Any = None) -> bool:
        inv = ids.validate(invocation_id, "invocation id")
        out = self._call(
            "POST", f"/v1/producer/invocations/{inv}/send", {"index": index, "kind": kind, "body": body}
        )
        return bool(out.get("duplicate"))

    # -- worker side --------------------------------------------------------------------------------

    def _register(self, worker_id: str, queues: list[str]) -> None:
        from dreamlake.lakeshore.version import __version__

        info = {
            "worker_id": worker_id,
            "hostname": socket.gethostname(),
            "version": __version__,
            "runner": "in-process",
            "queues": list(queues),
            "labels": {},
            "slots": 1,
        }
        answer = self._call("POST", "/v1/daemon/register", info)
        threshold = (answer or {}).get("inline_threshold_bytes")
        self._worker_threshold = threshold if isinstance(threshold, int) else None
        self._registered.add(worker_id)

    def claim(self, worker_id: str, queues: list[str], timeout: float) -> Claim | None:
        got = self.claim_batch(worker_id, queues, timeout, 1)
        return got[0] if got else None

    def claim_batch(self, worker_id: str, queues: list[str], timeout: float, limit: int) -> list[Claim]:
        """Up to ``limit`` invocations in one long poll (waiting up to ``timeout`` for the first),
        carrying the acks queued by ``ack(..., later=True)``: one request answers those acks (each
        committed with the poll's first pass) and hands out the next work."""
        from dreamlake.lakeshore.version import __version__

        if worker_id not in self._registered:
            self._register(worker_id, queues)
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            left = max(0.0, deadline - time.monotonic())
            body: dict[str, Any] = {
                "worker_id": worker_id,
                "queues": list(queues),
                "max": max(1, int(limit)),
                "kinds": ["run"],  # this worker cannot run exec jobs: never claim one
                "timeout_s": left,
                "version": __version__,
            }
            acks = self._later.pop(worker_id, [])
            if len(acks) > POLL_ACKS_MAX:  # the rest go with the next polls
                self._later[worker_id], acks = acks[POLL_ACKS_MAX:], acks[:POLL_ACKS_MAX]
            if acks:
                body["acks"] = acks
            try:
                out = self._call("POST", "/v1/daemon/poll", body, timeout=left)
            except BaseException:
                if acks:  # not known to have landed: they go again, first (an ack is idempotent)
                    self._later.setdefault(worker_id, [])[:0] = acks
                raise
            again = []
            for sent, answer in zip(acks, out.get("acked") or [], strict=False):
                status, inv = answer.get("status"), str(sent.get("invocation_id"))
                failed = not answer.get("ok") and isinstance(status, int) and status >= 500
                tries = self._ack_tries.pop(inv, 0) + 1  # polls it rode that the store failed
                if failed and tries < ACK_TRIES:
                    self._ack_tries[inv] = tries
                    again.append(sent)  # the store failed it: it goes again with the next poll
                elif failed:
                    log.error(
                        "ack of %s failed in the store %d times, given up: its lease lapses and "
                        "it runs again (%s)", inv, tries, answer.get("error"),
                    )  # fmt: skip
                elif not answer.get("ok"):
                    log.warning(
                        "ack of %s refused (%s): %s",
                        answer.get("invocation_id"),
                        answer.get("status"),
                        answer.get("error"),
                    )
            if again:
                self._later.setdefault(worker_id, [])[:0] = again
            claims: list[Claim] = []
            for cmd in out.get("commands") or []:
                if cmd.get("kind") == "run":
                    b = cmd["body"]
                    args = b.get("args_blob") or b""
                    if b.get("args_ref") is not None:
                        args = self._download(b["args_ref"], f"args_ref of {b['invocation_id']}")
                    claims.append(
                        Claim(
                            b["invocation_id"],
                            args,
                            dict(b.get("run_config") or {}),
                            int(b.get("attempt") or 1),
                        )
                    )
                elif cmd.get("kind") == "cancel":
                    # the control plane asks again on every heartbeat that reports it running
                    log.debug("worker %s: cancel by poll, left to the heartbeat: %s", worker_id, cmd)
                else:
                    log.warning("worker %s ignoring a %s command", worker_id, cmd.get("kind"))
            if claims or time.monotonic() >= deadline:
                return claims

    def append_frame(
        self, invocation_id: str, seq: int, data: bytes, final: bool, attempt: int, *, worker_id: str
    ) -> None:
        """Queue the frame for the frame writer: batches go to ``/v1/daemon/result-chunks`` (one
        request each); a refusal is raised by the next ``append_frame`` of the invocation. A frame
        body over the control plane's threshold is uploaded first and sent as ``{"ref": ...}``."""
        limit = self._worker_threshold
        if limit is not None and len(data) > limit:
            from dreamlake.lakeshore import wire

            frame = wire.decode_frame(bytes(data))
            if isinstance(frame.body, bytes) and len(frame.body) > limit:
                ref = self._upload(frame.body, invocation_id, f"frame-{seq}")
                if ref is not None:
                    data = wire.encode_frame(frame.kind, frame.seq, {"ref": ref}, frame.meta)
        self._frames.append(invocation_id, attempt, seq, bytes(data), final, worker_id=worker_id)

    def _write_frames(
        self, invocation_id: str, attempt: int, worker_id: str, frames: Sequence[tuple[int, bytes, bool]]
    ) -> None:
        body = {
            "invocation_id": invocation_id,
            "attempt": attempt,
            "worker_id": worker_id,
            "frames": [data for _seq, data, _final in frames],
        }
        self._call("POST", "/v1/daemon/result-chunks", body)

    def ack(
        self,
        invocation_id: str,
        state: str,
        *,
        attempt: int,
        worker_id: str,
        result_blob: bytes | None = None,
        error: dict[str, Any] | None = None,
        later: bool = False,
    ) -> bool:
        """Record the outcome (after the invocation's frames). ``later``: queue it for the
        worker's next ``claim_batch`` instead of a request of its own (True: queued; a refusal
        is logged when that poll answers); ``flush_acks`` sends what is queued."""
        try:
            self._frames.flush(invocation_id)  # the ack follows its frames
        except PlaneError as exc:
            log.warning("ack of %s refused: its frames were: %s", invocation_id, exc)
            return False
        body: dict[str, Any] = {
            "invocation_id": invocation_id,
            "state": state,
            "result_blob": bytes(result_blob or b""),
            "error": error,
            "worker_id": worker_id,
            "attempt": attempt,
        }
        limit = self._worker_threshold
        if limit is not None and result_blob and len(result_blob) > limit:
            ref = self._upload(bytes(result_blob), invocation_id, "result")
            if ref is not None:
                body["result_blob"] = b""
                body["result_ref"] = ref
        if later:
            self._later.setdefault(worker_id, []).append({k: v for k, v in body.items() if k != "worker_id"})
            return True
        try:
            self._call("POST", "/v1/daemon/ack", body)
        except Conflict as exc:
            log.warning("ack of %s refused: %s", invocation_id, exc)
            return False
        return True

    def wait_commands(self, worker_id: str, timeout: float) -> bool:
        """Not here (``wakes_on_commands`` is False): a cancel comes back in a heartbeat's answer
        or with the next poll, so the worker heartbeats on its interval."""
        raise NotImplementedError(
            "HttpDispatch cannot wait for commands (wakes_on_commands is False): "
            "cancels come back in heartbeat and poll answers"
        )

    def payload_client(self) -> PlaneClient:
        return self._client

    def flush_acks(self, worker_id: str) -> None:
        """Send the acks ``ack(..., later=True)`` queued for ``worker_id``, each in its own request."""
        for body in self._later.pop(worker_id, []):
            try:
                self._call("POST", "/v1/daemon/ack", {**body, "worker_id": worker_id})
            except Conflict as exc:
                log.warning("ack of %s refused: %s", body["invocation_id"], exc)

    def heartbeat(self, worker_id: str, running: list[tuple[str, int]]) -> list[str]:
        body = {
            "worker_id": worker_id,
            "running": [{"invocation_id": i, "attempt": a} for i, a in running],
            "free_slots": 0,
        }
        out = self._call("POST", "/v1/daemon/heartbeat", body)
        return [c["body"]["invocation_id"] for c in out.get("commands") or [] if c.get("kind") == "cancel"]

    def sends(
        self, invocation_id: str, attempt: int, *, worker_id: str, since: int, timeout: float
    ) -> list[Frame]:
        from dreamlake.lakeshore import wire

        body = {
            "invocation_id": invocation_id,
            "attempt": attempt,
            "worker_id": worker_id,
            "since": since,
            "wait_s": max(0.0, timeout),
        }
        out = self._call("POST", "/v1/daemon/sends", body, timeout=timeout)
        return [wire.decode_frame(bytes(f)) for f in out.get("frames") or []]

    def close(self) -> None:
        self._frames.close()
        self._client.close()

    def __enter__(self) -> HttpDispatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HttpDispatch {self.url}>"
