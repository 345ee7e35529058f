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

Every route, body and timeout is the protocol package's (:mod:`dreamlake.lakeshore.protocol`):
the plane's one client is a :class:`~dreamlake.lakeshore.protocol.producer.ProducerClient` and a
:class:`~dreamlake.lakeshore.protocol.daemon.DaemonClient` over one connection. This module is the
producer plane; the worker plane (claims, frames, acks, heartbeats) and the payload store both
share are ``dispatch/http_worker.py``.

Streams follow ``GET .../result/stream?since=`` and reassemble frames with ``wire.FrameReader``; a
dropped connection resumes from the last seq seen, so a consumer never sees a gap or a duplicate.

Big payloads go by reference (seed 003, docs/protocol.md "Payload refs", the one rule
:func:`~dreamlake.lakeshore.protocol.limits.by_reference`): an Envelope over the inline threshold
(``INLINE_THRESHOLD_BYTES``, 256 KiB, or ``inline_threshold=``; a control plane with a lower one
answers 413 and the call goes again by reference) is uploaded through the presign route
(:mod:`~dreamlake.lakeshore.blobs`) and submitted as ``args_ref``; a ``result_ref`` in an await
answer, an ``args_ref`` in a claim and a frame whose body is ``{"ref": ...}`` are downloaded
(sha256 checked) before the caller sees them, so ``q.result(inv)`` returns the value either way.
A control plane without a payload store (presign answers 501) keeps everything inline.

Batch sizes are bounded by the control plane's limits (``GET /v1/ops/info``, asked once, on the
first batch): a submit batch holds at most ``SUBMIT_BATCH_ITEMS`` calls and ``SUBMIT_BATCH_BYTES``
of Envelopes, fewer where the control plane allows fewer.

An HTTP plane is outside the local trust domain: ``trusted = False``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import envvars, ids
from dreamlake.lakeshore.client import DEFAULT_RETRY_WINDOW_S, RETRY_WINDOW_ENV, error_for, is_retryable
from dreamlake.lakeshore.dispatch import NATIVE_FUNCTION, Plane, error_ends_stream
from dreamlake.lakeshore.dispatch.batching import FrameWriter
from dreamlake.lakeshore.dispatch.http_worker import ACK_TRIES, HttpWorkerPlane, PlaneRoutes
from dreamlake.lakeshore.errors import BadRequest, NotFound, PlaneError, Unavailable
from dreamlake.lakeshore.protocol import routes
from dreamlake.lakeshore.protocol.daemon import SLACK_S
from dreamlake.lakeshore.protocol.limits import (
    ServerLimits,
    by_reference,
    inline_threshold_from_env,
)
from dreamlake.lakeshore.states import TERMINAL_STATES

if TYPE_CHECKING:
    import httpx

    from dreamlake.lakeshore.client import PlaneClient
    from dreamlake.lakeshore.envelope import Envelope
    from dreamlake.lakeshore.wire import Frame

__all__ = ["ACK_TRIES", "HttpDispatch", "inline_threshold_from_env"]


log = logging.getLogger(__name__)

_STREAM_RECONNECTS = 5
# (control plane, queue, warning) logged already: each once, not each submit's. Keyed by the text:
# a placement warning names the call's own needs (`no live worker of queue 'gpu' offers 4 GPUs`), and
# one logged for a queue before must not hide another call's, nor the queue's no-worker warning
_WARNED: set[tuple[str, str, str]] = set()
# (control plane, queue) -> when its workers were last asked whether they run pickled functions
_PICKLES_ASKED: dict[tuple[str, str], float] = {}
PICKLES_ASK_EVERY_S = 30.0  # while no live worker serves the queue, ask again at most this often
# A submit batch (POST /v1/producer/submit-batch) holds at most this many calls and about this many
# bytes of Envelopes (fewer where the control plane allows fewer): big enough that a sweep pays one
# request and one transaction per few hundred calls, small enough that one is quick to retry.
SUBMIT_BATCH_ITEMS = 500
SUBMIT_BATCH_BYTES = 8 * 1024 * 1024


def _retry_window() -> float:
    """``$LAKESHORE_RETRY_WINDOW`` (seconds), else the default; a bad value says what to set."""
    return envvars.number(RETRY_WINDOW_ENV, default=DEFAULT_RETRY_WINDOW_S)


def _submit_failed(exc: PlaneError, invocation_id: str, window: float) -> PlaneError:
    """The error of a submit, carrying ``invocation_id``; one that outlasted the retry window says
    the call may be stored and how to find out (a fresh submit would run it twice)."""
    if isinstance(exc, Unavailable) and getattr(exc, "maybe_received", True) is False:
        new: PlaneError = Unavailable(
            f"submit of invocation {invocation_id}: no try reached the control plane within the "
            f"{window:g} s retry window, so nothing was stored: {exc}",
            exc.status,
            exc.retry_after,
        )
    elif isinstance(exc, Unavailable):
        new = Unavailable(
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


class HttpDispatch(HttpWorkerPlane, Plane):
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
        self._client = PlaneRoutes(
            url, token, timeout_s=timeout, attempts=retries, window_s=window, transport=transport
        )
        self.url = self._client.url
        self.retries = self._client.attempts
        self.retry_window = window
        self._frames = FrameWriter(self._write_frames)
        self._init_worker()
        # payloads over this go by reference; None once the control plane said it has no store
        self.inline_threshold: int | None = (
            inline_threshold if inline_threshold is not None else inline_threshold_from_env()
        )
        self._info: ServerLimits | None = None  # GET /v1/ops/info, asked on the first batch

    def server_limits(self) -> ServerLimits:
        """The control plane's limits (``GET /v1/ops/info``), asked once; a worker's register
        answer says them too. While it cannot be asked, :class:`ServerLimits`' defaults: the
        request that follows meets the same outage and reports it as its own."""
        if self._info is None:
            if self._limits is not None:
                self._info = self._limits
            else:
                try:
                    self._info = self._client.info()
                except PlaneError as exc:  # unreachable now: the defaults, and ask again next time
                    log.debug("cannot ask %s for its limits (%s): the defaults for now", self.url, exc)
                    return ServerLimits()
        return self._info

    # -- producer side ------------------------------------------------------------------------------

    def submit(
        self, envelope: Envelope, queue: str, run_config: dict[str, Any], parent: str | None = None
    ) -> str:
        """Queue a call. An Envelope over the inline threshold goes to the payload store from
        :meth:`Envelope.to_parts` (its arguments read in place), never joined in memory."""
        item = self._item(envelope, queue, run_config, parent)
        return self._submit(item, envelope, None)[0]

    def submit_batch(
        self, calls: Sequence[tuple[Envelope, str, dict[str, Any], str | None]]
    ) -> list[str | PlaneError]:
        """Submit many calls, ``(envelope, queue, run_config, parent)`` each, in requests of up to
        ``SUBMIT_BATCH_ITEMS`` calls (``POST /v1/producer/submit-batch``, one transaction each);
        per call, in order, its invocation id or the error its :meth:`submit` would raise (with
        ``invocation_id`` set). An Envelope over the inline threshold goes to the payload store
        first, as with :meth:`submit`. A request retried after a lost answer is harmless: every
        call carries its Envelope's id. A control plane without the route gets single submits."""
        limits = self.server_limits()
        most_items = max(1, min(SUBMIT_BATCH_ITEMS, limits.submit_batch_max))
        most_bytes = max(1, min(SUBMIT_BATCH_BYTES, limits.max_body_bytes // 2))
        out: list[str | PlaneError] = []
        chunk: list[tuple[Envelope, dict[str, Any]]] = []
        size = 0
        for envelope, queue, run_config, parent in calls:
            item = self._item(envelope, queue, run_config, parent)
            blob = item.get("args_blob")
            n = len(blob) if isinstance(blob, bytes) else 512
            if chunk and (len(chunk) >= most_items or size + n > most_bytes):
                out += self._submit_chunk(chunk)
                chunk, size = [], 0
            chunk.append((envelope, item))
            size += n
        if chunk:
            out += self._submit_chunk(chunk)
        return out

    def _item(
        self, envelope: Envelope, queue: str, run_config: dict[str, Any], parent: str | None
    ) -> dict[str, Any]:
        """One call's submit body, less what every call of a batch shares (``function``); over the
        inline threshold, its Envelope uploaded (``args_ref``)."""
        item: dict[str, Any] = {
            "invocation_id": envelope.id,
            "queue": queue,
            "run_config": {**run_config, "queue": queue},
        }
        parts = envelope.pieces()
        ref = None
        if by_reference(sum(len(p) for p in parts), self.inline_threshold):
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
            answer = self._client.submit_batch(common, items)
        except NotFound as exc:
            if "no route" not in str(exc):
                raise
            log.info("%s has no submit-batch route (an older control plane): submitting one by one", self.url)
            return [self._submit_one(envelope, item) for envelope, item in chunk]
        except PlaneError as exc:  # the whole request: each call may or may not be stored
            err = _submit_failed(exc, chunk[0][0].id, self.retry_window)
            return [_batch_failed(err, envelope.id, len(chunk)) for envelope, _ in chunk]
        for queue, warning in (answer.get("warnings") or {}).items():
            self._warn(queue, warning)
        results = answer.get("results") or []
        if len(results) != len(chunk):
            raise Unavailable(f"submit-batch answered {len(results)} results for {len(chunk)} calls")
        out: list[str | PlaneError] = []
        for (envelope, item), got in zip(chunk, results):  # noqa: B905 (Python 3.9: no strict)
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
            return self._submit(dict(item), envelope, None)[0]
        except PlaneError as exc:
            return exc

    def submit_and_wait(
        self,
        envelope: Envelope,
        queue: str,
        run_config: dict[str, Any],
        parent: str | None,
        timeout: float,
    ) -> tuple[str, dict[str, Any] | None]:
        """Submit and await in one request (``submit`` with ``wait_s``): the invocation id and the
        await answer after up to ``timeout`` s (``{state: pending}`` when not yet terminal)."""
        item = self._item(envelope, queue, run_config, parent)
        inv, out = self._submit(item, envelope, max(0.0, timeout))
        return inv, self._resolved(dict(out.get("outcome") or {"state": "pending"}), inv)

    def _submit(
        self, item: dict[str, Any], envelope: Envelope, wait_s: float | None
    ) -> tuple[str, dict[str, Any]]:
        """``POST /v1/producer/submit`` of one call's ``item`` (:meth:`_item`); a 413 naming
        ``args_ref`` (the control plane's threshold is lower than ours) sends it again by reference."""
        body: dict[str, Any] = {**item, "function": dict(NATIVE_FUNCTION), "code_context": {}}
        try:
            try:
                out = self._client.submit(body, wait_s=wait_s)
            except BadRequest as exc:
                if exc.status != 413 or "args_ref" not in str(exc) or "args_blob" not in body:
                    raise
                ref = self._upload(envelope.to_parts(), envelope.id, "args")
                if ref is None:
                    raise
                body.pop("args_blob")
                body["args_ref"] = ref
                out = self._client.submit(body, wait_s=wait_s)
        except PlaneError as exc:
            raise _submit_failed(exc, body["invocation_id"], self.retry_window) from exc
        if out.get("warning"):
            self._warn(str(body["queue"]), out["warning"])
        return str(out["invocation_id"]), dict(out)

    def _warn(self, queue: str, warning: Any) -> None:
        """Log a submit's ``warning`` (no worker polls ``queue``; no live worker could place the
        call) once per control plane, queue and text."""
        seen = (self.url, queue, str(warning))
        if seen not in _WARNED:
            _WARNED.add(seen)
            log.warning("%s", warning)

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
            workers = self._client.live_workers(limit=500)
        except PlaneError as exc:  # e.g. a task's token, which may not list workers: no warning
            log.debug("cannot ask which workers run pickled functions: %s", exc)
            return
        serving = [w for w in workers if queue in (w.get("queues") or [])]
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
        return self._client.status(inv)

    def await_result(self, invocation_id: str, timeout: float) -> dict[str, Any]:
        inv = ids.validate(invocation_id, "invocation id")
        return self._resolved(dict(self._client.await_result(inv, timeout)), inv)

    def await_batch(self, invocation_ids: Sequence[str], timeout: float) -> dict[str, Any]:
        """The outcomes of many invocations in one request (``POST /v1/producer/await-batch``,
        up to the control plane's ``await_batch_max`` ids), waiting up to ``timeout`` for any of them to end:
        ``{"results": {id: {state, result_blob, error}}, "states": {id: state}, "unknown": [id]}``
        (``results``: the terminal ones, result refs fetched; ``states``: the others). A control
        plane without the route gets one await per id (the first waits)."""
        wanted = [ids.validate(i, "invocation id") for i in invocation_ids][
            : self.server_limits().await_batch_max
        ]
        try:
            out = self._client.await_batch(wanted, timeout)
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
        return str(self._client.cancel(inv, descendants)["state"])

    def frames(
        self, owner: str, since: int = -1, timeout: float = 30.0, *, topic: bool = False
    ) -> Iterator[Frame]:
        from dreamlake.lakeshore import wire

        if topic:
            path = routes.topic_stream(owner)
        else:
            path = routes.result_stream(ids.validate(owner, "invocation id"))
        last_frame = time.monotonic()
        drops = 0
        first_drop: float | None = None  # when the current run of reconnects began
        terminal = False
        while True:
            patience = max(0.05, timeout - (time.monotonic() - last_frame))
            got_any = False
            try:
                with self._client.stream(
                    path, params={"since": since, "timeout": patience}, timeout_s=patience + SLACK_S
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
        out = self._client.topic_post(name, body, final)
        return int(out["seq"])

    def send(self, invocation_id: str, index: int, kind: str, body: Any = None) -> bool:
        inv = ids.validate(invocation_id, "invocation id")
        return bool(self._client.send(inv, index, kind, body).get("duplicate"))

    def payload_client(self) -> PlaneClient:
        return self._client

    def close(self) -> None:
        self._frames.close()
        self._client.close()

    def __enter__(self) -> HttpDispatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HttpDispatch {self.url}>"
