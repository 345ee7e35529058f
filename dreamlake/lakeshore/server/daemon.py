"""Daemon routes (msgpack): register, poll, ack, result-chunk, result-chunks and heartbeat.

``result-chunks`` takes many frames of one attempt in one request and journals them through the
group commit (a ``FramesRequest``: many requests' batches in one transaction), answering per seq (stored or duplicate); the frames that
were new are then published to the live fan-out in one call. ``result-chunk`` is the seed's
one-frame form. The ack pokes the invocation's live followers, so a stream that ends without a
final frame (a plain call, a failure before the first frame) ends at once.

A daemon acts as the workers its token registered (``authz.WorkerBindings``: the first call naming
a worker id binds it; any other token naming it is refused 403) and reports only on the leases
those workers hold: ack and result-chunk require ``worker_id`` and ``attempt``, and the store
refuses a superseded attempt or lapsed lease (409) and another worker's lease (403); every refusal
is logged. Frames must come in order (the store refuses a gap, or a frame after the final one, 409
with ``expected_seq``). A daemon token bound to a namespace registers and claims in it only.

``poll`` is a long poll: each pass collects pending cancels, claims invocations and exec jobs in
one transaction of the group commit (a ``PollRequest``, which also reads the pinned nymph
version; its claims commit with the submits and acks of the same batch); with
nothing to hand out it waits in the poll hub (``server/polls.py``), which wakes one waiting poll per
unit of new work (and every poll of a worker with a command queued), so a submit costs one claim
transaction, not one per waiting daemon; a submit reaching a replica where such a poll waits is
handed to it, and that poll's pass runs in the submit's own transaction (``Ticket.prepare``). ``ack``, ``result-chunk``, ``result-chunks`` and
``heartbeat`` write through
the group commit (``ctx.write``), which applies the same lease and order checks per write, and are
answered once committed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.server import http, task_tokens
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context, answer_of
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.server.polls import EXEC, HANDED, RUN, SHUTDOWN, TIMEOUT, Wake
from dreamlake.lakeshore.store.api import (
    ACK_STATES,
    UNKNOWN,
    AckRequest,
    AckResult,
    ChunkResult,
    Command,
    FrameRequest,
    FramesRequest,
    FramesResult,
    HeartbeatRequest,
    HeartbeatResult,
    Invocation,
    PollRequest,
    PollResult,
    WriteRequest,
    WriteResult,
)
from dreamlake.lakeshore.store.outage import StoreOutage
from dreamlake.lakeshore.store.placement import parse_offer
from dreamlake.lakeshore.store.values import json_safe

if TYPE_CHECKING:
    from dreamlake.lakeshore.wire import Frame

log = logging.getLogger(__name__)

MAX_QUEUES = 64
MAX_RUNNING = 4096  # entries of a heartbeat's ``running`` (and ``running_exec``): one statement each


async def _worker(ctx: Context, caller: Caller, body: dict[str, Any]) -> str:
    """The body's ``worker_id`` (required), once the caller's token is known to act as it."""
    worker_id = http.ulid_field(body, "worker_id")
    assert worker_id is not None
    await ctx.workers.check(caller, worker_id)
    return worker_id


def _attempt(body: dict[str, Any]) -> int:
    attempt: int = http.integer(body, "attempt", hi=http.I32_MAX)
    return attempt


def _queues(body: dict[str, Any], default: list[str] | None = None) -> list[str]:
    queues = field(body, "queues", list, default=default)
    if queues is None:
        raise HTTPError(400, "missing field 'queues'")
    if not queues or len(queues) > MAX_QUEUES:
        raise HTTPError(400, f"field 'queues' must list 1 to {MAX_QUEUES} queue names")
    return [http.name(q, "queue") for q in queues]


async def register(ctx: Context, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    worker_id = await _worker(ctx, caller, body)
    principal = caller.principal
    namespace = field(body, "namespace", str, default=None, nullable=True)
    if namespace is not None:
        namespace = http.name(namespace, "namespace")
        if principal.namespace is not None and namespace != principal.namespace:
            raise HTTPError(
                403,
                f"token '{principal.name}' is bound to namespace '{principal.namespace}', not '{namespace}'",
            )
    info = {
        "hostname": field(body, "hostname", str, default=""),
        "version": field(body, "version", str, default=""),
        "runner": field(body, "runner", str, default=""),
        "queues": _queues(body, default=["default"]),
        "labels": http.document(body, "labels", default={}),
        "slots": http.integer(body, "slots", hi=http.I32_MAX, default=1),
        "namespace": namespace or principal.namespace,
    }
    capacity = field(body, "capacity", dict, default=None, nullable=True)
    if capacity is not None:  # what the host has (docs/protocol.md "Placement"): shown, not matched
        info["capacity"] = json_safe(capacity, "field 'capacity'")
    allow_pickled = field(body, "allow_pickled", bool, default=None, nullable=True)
    if allow_pickled is not None:  # whether it runs pickled functions: the SDK's submit warning
        info["allow_pickled"] = allow_pickled
    await ctx.call(ctx.store.register_worker, worker_id, info)
    ctx.daemons.forget(worker_id)  # its namespace may have changed: the next poll and heartbeat read it
    log.info(
        "worker %s registered (%s, runner %s, queues %s)",
        worker_id,
        info["hostname"],
        info["runner"],
        ",".join(info["queues"]),
    )
    out: dict[str, Any] = {
        "worker_id": worker_id,
        "lease_s": ctx.config.lease_s,
        "heartbeat_s": ctx.config.heartbeat_s,
    }
    if ctx.inline_threshold is not None:  # results and frames larger than this go by reference
        out["inline_threshold_bytes"] = ctx.inline_threshold
    out["limits"] = server_limits(ctx)  # what this control plane allows (protocol.limits.ServerLimits)
    return out


def server_limits(ctx: Context) -> dict[str, Any]:
    """The limits this control plane decides, as clients read them (``GET /v1/ops/info`` and the
    register answer's ``limits``; the client side's ``protocol.limits.ServerLimits``). Each number
    is the one this server enforces, read from where it is defined."""
    from dreamlake.lakeshore.server.bulk import AWAIT_BATCH_MAX

    return {
        "acks_per_poll": MAX_POLL_ACKS,
        "inline_threshold_bytes": ctx.inline_threshold,  # None: no payload store, all inline
        "submit_batch_max": ctx.config.submit_batch_max,
        "max_body_bytes": ctx.config.max_body_bytes,
        "await_batch_max": AWAIT_BATCH_MAX,
        "poll_max_commands": ctx.config.poll_max_commands,
        "result_chunks_max": MAX_BATCH_FRAMES,
    }


def run_command(inv: Invocation, task_token: str | None = None) -> dict[str, Any]:
    """The run command of docs/protocol.md and seed 000 "Dispatch" for a claimed invocation, with
    the invocation's task token (``LAKESHORE_TOKEN`` inside the task: server/task_tokens.py)."""
    rc = inv.run_config or {}
    body: dict[str, Any] = {
        "invocation_id": inv.invocation_id,
        "function": inv.function,
        "args_blob": inv.args_blob,
        "run_config": rc,
        "namespace": inv.namespace,  # where nymph presigns the blobs of this invocation
    }
    if inv.args_ref is not None:
        body["args_ref"] = inv.args_ref  # the Envelope is in the payload store: fetch it first
    if inv.checkpoint_ref is not None:
        body["checkpoint_ref"] = inv.checkpoint_ref  # an earlier attempt's dls.checkpoint_dir()
    if rc.get("prefix"):
        body["prefix"] = rc["prefix"]
    body["attempt"] = inv.attempt
    if inv.parent_invocation_id:
        body["parent_invocation_id"] = inv.parent_invocation_id
    if inv.root_invocation_id:
        body["root_invocation_id"] = inv.root_invocation_id
    for key in ("script", "as_user", "timeout_s"):
        if rc.get(key) is not None:
            body[key] = rc[key]
    if task_token is not None:
        body["task_token"] = task_token
    return {"id": ids.new_ulid(), "kind": "run", "body": body}


def exec_command(job: dict[str, Any]) -> dict[str, Any]:
    body = {
        k: job.get(k)
        for k in ("exec_id", "namespace", "command", "payload_inline", "payload_ref", "timeout_s", "attempt")
    }
    return {"id": ids.new_ulid(), "kind": "exec", "body": body}


def command_dict(cmd: Command) -> dict[str, Any]:
    return {"id": cmd.id, "kind": cmd.kind, "body": cmd.body}


def _with_pin(out: dict[str, Any], version: str | None) -> dict[str, Any]:
    """Add ``target_nymph_version`` when the daemon's namespace pins one. The namespace is its
    token's, else the one it registered with (read from the store's workers row, in the poll's or
    heartbeat's own transaction, so a replica that did not serve the register answers the same),
    else ``default``."""
    if version:
        out["target_nymph_version"] = version
    return out


async def _commands(ctx: Context, got: PollResult) -> tuple[list[dict[str, Any]], list[Wake], str | None]:
    """What one poll pass found (a ``PollRequest`` written through the group commit: its claims
    share the transaction of the submits and acks committed with it, or of the submits it was
    handed): pending cancels, then claimed invocations (each with its task token), then exec jobs
    (of the token's namespace when it is bound to one) for free slots. Returns the commands, the
    work claimed (for the poll hub) and the pinned nymph version."""
    commands = [command_dict(c) for c in got.commands]
    if got.invocations:
        signer, now = await ctx.task_tokens(), time.time()
        ttl, lease = ctx.config.task_token_ttl_s, ctx.config.lease_s
        for inv in got.invocations:
            token = signer.mint(
                inv.invocation_id, inv.attempt, inv.namespace, task_tokens.expires_at(inv, ttl, lease, now)
            )
            commands.append(run_command(inv, token))
    commands.extend(exec_command(job) for job in got.exec_jobs)
    if got.invocations:
        ctx.metrics.claims.labels(kind="run").inc(len(got.invocations))
        for inv in got.invocations:
            if inv.attempt == 1 and inv.started_at is not None:
                ctx.metrics.claim_latency.labels(queue=inv.queue).observe(
                    max(0.0, inv.started_at - inv.submitted_at)
                )
    if got.exec_jobs:
        ctx.metrics.claims.labels(kind="exec").inc(len(got.exec_jobs))
    units = [Wake(RUN, inv.queue, inv.namespace, inv.shape) for inv in got.invocations]
    units.extend(Wake(EXEC, job["queue"], job["namespace"]) for job in got.exec_jobs)
    return commands, units, got.pinned_version


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # the request's ASGI ``receive``
POLL_KINDS = ("run", "exec")


def _takes_exec(body: dict[str, Any]) -> bool:
    """``kinds`` of a poll: the command kinds the daemon runs (default both). A worker that cannot
    run exec jobs (the SDK's in-process worker) sends ``["run"]``: a job it claimed and could not
    run would sit in ``running`` for ever."""
    kinds = field(body, "kinds", list, default=list(POLL_KINDS))
    if not kinds or any(k not in POLL_KINDS for k in kinds):
        raise HTTPError(400, f"field 'kinds' must list one or both of {', '.join(POLL_KINDS)}")
    if "run" not in kinds:
        raise HTTPError(400, "field 'kinds' must include 'run'")
    return "exec" in kinds


async def _hangup(receive: Receive) -> None:
    """Return when the daemon's connection closes: ASGI's ``http.disconnect``, which the server
    sends once the connection is lost (its body was read before the poll began)."""
    while (await receive()).get("type") != "http.disconnect":
        pass


async def poll(
    ctx: Context, caller: Caller, body: dict[str, Any], receive: Receive | None = None
) -> dict[str, Any]:
    """The long poll (admission is the route's: ``ctx.polls.admitted()``). With ``receive`` (the
    request's, its body already read) the daemon's connection is watched: a daemon that hung up
    claims nothing, a waiting poll whose daemon hung up leaves at once (it no longer holds a
    place in the queue's FIFO, or a wake-up, until its deadline, nor keeps the server's shutdown
    waiting for it), and a wake-up it was handed goes to the next poll. Work claimed just before a hang-up
    is not lost: its lease lapses and the reaper requeues it (attempt + 1). A token bound to a
    namespace claims that namespace's invocations and exec jobs only."""
    worker_id = await _worker(ctx, caller, body)
    queues = _queues(body)
    limit = int(http.number(body, "max", 1, lo=1, hi=ctx.config.poll_max_commands))
    timeout = http.number(body, "timeout_s", ctx.config.poll_default_s, lo=0.0, hi=ctx.config.poll_max_s)
    field(body, "version", str, default="")
    exec_jobs = _takes_exec(body)
    try:
        offer = parse_offer(body.get("offer"))
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None
    acks = _poll_acks(ctx, caller, worker_id, body) if body.get("acks") else None
    acked: list[dict[str, Any]] | None = None
    started = time.monotonic()
    # A fleet started together would renew its polls in lockstep, all at once every timeout_s: an
    # empty poll ends at a random point of its last fifth, so renewals spread out within rounds.
    deadline = started + timeout * random.uniform(0.8, 1.0)
    namespace = caller.principal.namespace
    ticket = ctx.polls.ticket(worker_id, queues, takes_exec=exec_jobs, namespace=namespace, offer=offer)
    key = (ticket.queues, exec_jobs, namespace, offer)
    commands: list[dict[str, Any]] = []
    pinned: str | None = None
    reason = "first"
    # The same daemon's next poll after one that left nothing (empty, or a pass with room to spare)
    # waits at once, from its last pass's position (server/idle.py): the hub hands it whatever
    # that pass would have found.
    renewal = ctx.daemons.renewal(worker_id, key) if acks is None else None
    waited_from: int | None = None  # the position of the last wait: its pass found nothing
    drained_at: int | None = None  # the position of the last pass, when it had room to spare
    hangup = asyncio.ensure_future(_hangup(receive)) if receive is not None else None

    def prepare() -> tuple[PollRequest, tuple[tuple[int, int], tuple[str | None] | None]]:
        """The next pass's write, and its notifier mark and memo state (server/idle.py): a lean
        pass (claims only) for a daemon the memo knows."""
        began = ctx.daemons.begin()
        known = ctx.daemons.known(worker_id)
        request = PollRequest(
            worker_id, queues, limit, ctx.config.lease_s, exec_jobs, namespace, known is None, offer=offer
        )
        return request, (began, known)

    ticket.prepare = prepare  # a submit may hand this poll its pass (server/polls.py)
    opening: tuple[Any, WriteResult | PlaneError] | None = None
    try:
        if acks is not None:
            # the acks and the opening pass in one group commit, the acks first: one transaction
            # answers the acked work's producers and hands out the next (a daemon that already
            # hung up gets its acks written, and no claim)
            gone = hangup is not None and hangup.done()
            request, marks = prepare()
            writes = [a.request for a in acks if a.request is not None]
            flights = [ctx.acks.begin(w.invocation_id) for w in writes]
            try:
                batch: list[WriteRequest] = [*writes] if gone else [*writes, request]
                results = await ctx.write_many(batch)
                acked, failed = _answer_acks(ctx, caller, acks, results[: len(writes)], flights)
            finally:  # every flight ends (settled ones are left as they are)
                for w, flight in zip(writes, flights, strict=True):
                    ctx.acks.end(w.invocation_id, flight, None)
            await _poke_all(ctx, acks, acked)
            if not gone:
                opening = (marks, results[-1])
                if failed is not None and _empty(results[-1]):
                    raise failed  # as before: nothing was handed out, the daemon sends all again
        while True:
            if hangup is not None and hangup.done():
                log.debug("poll of worker %s: the daemon hung up; nothing claimed", worker_id)
                ctx.metrics.poll_wait.observe(time.monotonic() - started)
                return {"commands": []} if acked is None else {"commands": [], "acked": acked}
            if renewal is not None:
                (mark, pinned), renewal = renewal, None
                ctx.metrics.idle_answers.labels(kind="renewal").inc()
            else:
                if opening is not None:  # written with the acks
                    ((began, known), got), opening = opening, None
                elif reason == HANDED and ticket.handed is not None:  # written with a submit
                    ((began, known), got), ticket.handed = ticket.handed, None
                else:
                    request, (began, known) = prepare()
                    got = await ctx.write(request)
                if isinstance(got, PlaneError):
                    raise answer_of(got)
                assert isinstance(got, PollResult)
                mark = began[0]
                ctx.metrics.poll_passes.labels(reason=reason).inc()
                commands, claimed, pinned = await _commands(ctx, got)
                if known is None:
                    ctx.daemons.wrote(worker_id, began, pinned)
                else:
                    pinned = known[0]
                ticket.settle(claimed, limit)
                drained_at = mark if len(claimed) < limit else None  # it took all there was
            remaining = deadline - time.monotonic()
            if commands or remaining <= 0:
                break
            waited_from = mark
            reason = await ticket.wait(remaining, since=mark, hangup=hangup)
            if reason in (TIMEOUT, SHUTDOWN):  # nothing came, or the server stops: answer now
                break
    finally:
        ticket.close()
        if hangup is not None:
            hangup.cancel()
    # the daemon's next poll may wait at once (server/idle.py): this one ended with nothing left for it
    if commands and drained_at is not None:
        ctx.daemons.left_nothing(worker_id, key, drained_at)
    elif not commands and reason == TIMEOUT and waited_from is not None:
        ctx.daemons.left_nothing(worker_id, key, waited_from)
    ctx.metrics.poll_wait.observe(time.monotonic() - started)
    out: dict[str, Any] = {"commands": commands}
    if acked is not None:
        out["acked"] = acked
    return _with_pin(out, pinned)


def _error_info(body: dict[str, Any]) -> dict[str, Any] | None:
    error = body.get("error")
    if error is None or error == "":
        return None
    if isinstance(error, str):
        return {"type": "DaemonError", "message": error}
    if not isinstance(error, dict):
        raise HTTPError(
            400,
            f"field 'error' must be a map {{type, message, traceback?}} or a string, "
            f"got {type(error).__name__}",
        )
    if not all(isinstance(k, str) for k in error):
        raise HTTPError(400, "field 'error' must have string keys")
    return error


def _refused(caller: Caller, what: str, invocation_id: str, status: int, reason: str) -> None:
    log.warning(
        "%s of %s refused (%d) for token %r: %s", what, invocation_id, status, caller.principal.name, reason
    )


async def ack(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    state = field(body, "state", str)
    if state not in ACK_STATES:
        raise HTTPError(400, f"cannot ack state {state[:40]!r}: use one of {', '.join(sorted(ACK_STATES))}")
    result_blob = field(body, "result_blob", bytes, default=None, nullable=True)
    raw_ref = field(body, "result_ref", dict, default=None, nullable=True)
    result_ref = None if raw_ref is None else ctx.ref(raw_ref, "result_ref")
    error = _error_info(body)
    attempt = _attempt(body)
    worker_id = await _worker(ctx, caller, body)
    if result_ref is not None and result_blob:
        raise HTTPError(400, "send result_blob or result_ref, not both")
    ctx.check_inline("result_blob", len(result_blob or b""), caller.namespace or ":ns", "result_ref")
    return await _ack(ctx, caller, worker_id, invocation_id, state, attempt, result_blob, error, result_ref)


MAX_POLL_ACKS = 256


def _poll_acks(ctx: Context, caller: Caller, worker_id: str, body: dict[str, Any]) -> list[_PollAck]:
    """The ``acks`` a poll carries (``[{invocation_id, state, attempt, result_blob?, error?}]``,
    each of ``worker_id``'s leases), each checked as the ack route checks it: an ack to write, or
    the answer of one that failed its check (:func:`_answer_acks` answers them all, in order)."""
    acks = field(body, "acks", list, default=[])
    if len(acks) > MAX_POLL_ACKS:
        raise HTTPError(400, f"field 'acks' lists {len(acks)} acks; the limit is {MAX_POLL_ACKS}")
    out = []
    for item in acks:
        inv = str(item.get("invocation_id", ""))[:64] if isinstance(item, dict) else ""
        try:
            if not isinstance(item, dict):
                raise HTTPError(
                    400, "field 'acks' must list maps {invocation_id, state, attempt, result_blob?, error?}"
                )
            invocation_id = http.ulid_field(item, "invocation_id")
            assert invocation_id is not None
            state = field(item, "state", str)
            if state not in ACK_STATES:
                raise HTTPError(
                    400, f"cannot ack state {state[:40]!r}: use one of {', '.join(sorted(ACK_STATES))}"
                )
            blob = field(item, "result_blob", bytes, default=None, nullable=True)
            raw = field(item, "result_ref", dict, default=None, nullable=True)
            ref = None if raw is None else ctx.ref(raw, "result_ref")
            if ref is not None and blob:
                raise HTTPError(400, "send result_blob or result_ref, not both")
            ctx.check_inline("result_blob", len(blob or b""), caller.namespace or ":ns", "result_ref")
            request = AckRequest(
                invocation_id, state, _attempt(item), worker_id, blob, _error_info(item), ref
            )
        except HTTPError as exc:
            out.append(_PollAck(inv, None, {"status": exc.status, "ok": False, "error": exc.message}))
        else:
            out.append(_PollAck(inv, request, None))
    return out


@dataclasses.dataclass
class _PollAck:
    """One ack a poll carries: the write it makes (None when it failed its check) or its answer."""

    invocation_id: str
    request: AckRequest | None
    answer: dict[str, Any] | None


def _answer_acks(
    ctx: Context,
    caller: Caller,
    acks: list[_PollAck],
    results: list[WriteResult | PlaneError],
    flights: list[asyncio.Future[Any]],
) -> tuple[list[dict[str, Any]], PlaneError | None]:
    """The answers of a poll's acks, whose writes committed with ``results`` (those of the acks
    that passed their checks, in order, each with its ``ctx.acks.begin`` in ``flights``, all
    ended here): ``{invocation_id, status, ok, duplicate?, error?}`` (status: the ack route's)
    per ack sent; and the first store failure (5xx) among them, None when none failed. An ack
    the store failed is answered 500, to be sent again (``HttpDispatch.claim_batch`` does)."""
    out = []
    failed: PlaneError | None = None
    written = iter(zip(results, flights, strict=True))
    for ack in acks:
        if ack.request is None:
            assert ack.answer is not None
            out.append({"invocation_id": ack.invocation_id, **ack.answer})
            continue
        result, flight = next(written)
        try:
            status, answer = _ack_settled(ctx, caller, ack.request, result, flight)
        except HTTPError as exc:
            status, answer = exc.status, {"ok": False, "error": exc.message}
        except PlaneError as exc:
            failed = failed or exc
            status = 503 if isinstance(exc, StoreOutage) else 500  # the store is down, or a bug
            answer = {"ok": False, "error": f"{exc}; send the ack again"}
        out.append({"invocation_id": ack.invocation_id, "status": status, **answer})
    return out, failed


async def _poke_all(ctx: Context, acks: list[_PollAck], answers: list[dict[str, Any]]) -> None:
    """The live followers of every invocation a poll's acks ended, told at once."""
    done = [a.invocation_id for a, out in zip(acks, answers, strict=True) if out.get("ok")]
    if done:
        await asyncio.gather(*(_poke(ctx, inv) for inv in done))


def _empty(got: WriteResult | PlaneError) -> bool:
    """Whether a pass handed nothing out (no claim, no exec job, no command taken)."""
    return isinstance(got, PollResult) and not (got.invocations or got.exec_jobs or got.commands)


async def _ack(
    ctx: Context,
    caller: Caller,
    worker_id: str,
    invocation_id: str,
    state: str,
    attempt: int,
    result_blob: bytes | None,
    error: dict[str, Any] | None,
    result_ref: dict[str, Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Write one checked ack through the group commit and answer as the ack route does."""
    request = AckRequest(invocation_id, state, attempt, worker_id, result_blob, error, result_ref)
    flight = ctx.acks.begin(invocation_id)
    try:
        (result,) = await ctx.write_many([request])
    except BaseException:
        ctx.acks.end(invocation_id, flight, None)
        raise
    status, answer = _ack_settled(ctx, caller, request, result, flight)
    if answer.get("ok"):
        await _poke(ctx, invocation_id)
    return status, answer


def _ack_settled(
    ctx: Context,
    caller: Caller,
    request: AckRequest,
    result: WriteResult | PlaneError,
    flight: asyncio.Future[Any],
) -> tuple[int, dict[str, Any]]:
    """Answer one committed ack as the ack route does, and hand its outcome to the producers
    waiting on it (``flight``: the ``ctx.acks.begin`` made before its write, ended here). The
    live followers are the caller's to poke (``_poke``)."""
    invocation_id, state = request.invocation_id, request.state
    if isinstance(result, PlaneError):
        ctx.acks.end(invocation_id, flight, None)
        raise answer_of(result)
    assert isinstance(result, AckResult)
    # as the store keeps it (an empty blob is None, the error JSON-safe), for a waiting producer
    committed = {
        "state": state,
        "result_blob": request.result_blob or None,
        "error": None if request.error is None else json_safe(request.error, "error"),
    }
    if request.result_ref is not None:  # the result is in the payload store (producer.outcome's shape)
        committed["result_ref"] = request.result_ref
    # a failure that queued a retry (result.state "queued") is no outcome for a waiting producer
    final = result.ok and not result.duplicate and result.state == state
    ctx.acks.end(invocation_id, flight, committed if final else None)
    if result.ok:
        ctx.metrics.acks.labels(state=state, outcome="duplicate" if result.duplicate else "ok").inc()
        ctx.wake.notify(f"inv:{invocation_id}")
        log.debug("ack %s %s (attempt %s)", invocation_id, state, request.attempt)
        return 200, ({"ok": True, "duplicate": True} if result.duplicate else {"ok": True})
    if result.status == UNKNOWN:
        ctx.metrics.acks.labels(state=state, outcome="unknown").inc()
        raise HTTPError(404, result.reason or f"unknown invocation '{invocation_id}'", ok=False)
    ctx.metrics.acks.labels(state=state, outcome="refused").inc()
    reason = result.reason or "ack refused: the attempt was superseded"
    _refused(caller, "ack", invocation_id, result.status, reason)
    return result.status, {"ok": False, "error": reason}


def _frame(data: bytes, what: str = "field 'bytes'") -> Frame:
    from dreamlake.lakeshore.wire import decode_frame

    try:
        return decode_frame(data)
    except Exception as exc:
        raise HTTPError(400, f"{what} is not one encoded frame [kind, seq, body, meta]: {exc}") from None


def _check_frame(ctx: Context, caller: Caller, frame: Frame, what: str) -> None:
    """413 for a frame whose body bytes are over the inline threshold: such a frame travels as a
    frame whose body is ``{"ref": {bucket, key, size, sha256}}`` (docs/protocol.md, Payload refs)."""
    body = frame.body
    if isinstance(body, bytes | bytearray):
        ctx.check_inline(
            f"{what} (seq {frame.seq}) body", len(body), caller.namespace or ":ns", "a frame body {ref: ...}"
        )
    elif isinstance(body, dict) and "ref" in body:
        ctx.ref(body["ref"], f"{what}.body.ref")


async def result_chunk(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Journal one frame, then publish it live. The frame's kind decides whether it closes the
    stream (END and ERROR do, as the seed says); a ``final: true`` on a VALUE or LOG frame is
    logged and ignored. Only the worker holding the current lease posts frames, in seq order."""
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    seq = http.integer(body, "seq", hi=http.I64_MAX)
    data = field(body, "bytes", bytes)
    said_final = field(body, "final", bool, default=False)
    attempt = _attempt(body)
    worker_id = await _worker(ctx, caller, body)
    frame = _frame(data)
    _check_frame(ctx, caller, frame, "frame")
    if frame.seq != seq:
        raise HTTPError(
            400,
            f"the frame's own seq {frame.seq} differs from the body's seq {seq}: "
            "send the frame with the seq it was encoded with",
        )
    final = frame.final
    if said_final and not final:
        log.warning(
            "result chunk %s seq %d says final but is a frame of kind %d: only END and ERROR close a stream",
            invocation_id,
            seq,
            frame.kind,
        )
    result = await ctx.write(FrameRequest(invocation_id, seq, data, final, attempt, worker_id))
    assert isinstance(result, ChunkResult)
    if not result.ok:
        reason = result.reason or "frame refused"
        if result.status == UNKNOWN:
            raise HTTPError(404, reason, ok=False)
        _refused(caller, f"frame {seq}", invocation_id, result.status, reason)
        out: dict[str, Any] = {"ok": False, "error": reason}
        if result.expected_seq is not None:
            out["expected_seq"] = result.expected_seq
        return result.status, out
    ctx.metrics.chunks.labels(duplicate=str(result.duplicate).lower()).inc()
    if result.duplicate:
        return 200, {"ok": True, "seq": seq, "duplicate": True}
    ctx.metrics.frames_appended((frame.kind,))
    ctx.wake.notify(f"inv:{invocation_id}")
    if ctx.fanout is not None:
        try:  # at its journal position, as journaled (a later attempt's frames are restamped)
            pos = seq if result.pos is None else result.pos
            await ctx.fanout.publish(invocation_id, pos, result.data or data, final)
        except Exception:
            log.warning(
                "live publish of %s seq %d failed; followers catch up from the journal",
                invocation_id,
                seq,
                exc_info=True,
            )
    return 200, {"ok": True, "seq": seq}


MAX_BATCH_FRAMES = 10_000


async def result_chunks(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Journal a batch ``{invocation_id, attempt, worker_id, frames: [bytes, ...]}`` of one attempt
    through the group commit (one transaction, shared with the other writes committed with it;
    the lease and order checks run per batch, inside it) and answer, once committed, ``{ok, results: [{seq, duplicate}]}`` in the order sent. Each
    frame is a repeat of a seq already journaled (``duplicate``) or the next seq. A gap or a frame
    after the final one is refused with the rest of the batch: 409 ``{ok: false, error,
    expected_seq, results}`` with the results of the frames kept before it. Only the worker holding
    the current lease posts frames (403 another worker, 409 superseded, nothing journaled); an
    unknown invocation is a 404. Frames whose kind is END or ERROR close the stream."""
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    attempt = _attempt(body)
    worker_id = await _worker(ctx, caller, body)
    raw = field(body, "frames", list)
    if not raw or len(raw) > MAX_BATCH_FRAMES:
        raise HTTPError(400, f"field 'frames' must list 1 to {MAX_BATCH_FRAMES} encoded frames")
    batch: list[tuple[int, bytes, bool]] = []
    kinds: list[int] = []
    for i, data in enumerate(raw):
        if not isinstance(data, bytes):
            raise HTTPError(
                400, f"frames[{i}] must be the bytes of one encoded frame, not {type(data).__name__}"
            )
        frame = _frame(data, f"frames[{i}]")
        _check_frame(ctx, caller, frame, f"frames[{i}]")
        batch.append((frame.seq, data, frame.final))
        kinds.append(frame.kind)
    written = await ctx.write(FramesRequest(invocation_id, attempt, batch, worker_id))
    assert isinstance(written, FramesResult)
    results = written.results
    kept = [r for r in results if r.ok]
    fresh = [  # at their journal positions, as journaled (a later attempt's frames are restamped)
        (seq if r.pos is None else r.pos, r.data or data, final)
        for (seq, data, final), r in zip(batch, results, strict=False)
        if r.ok and not r.duplicate
    ]
    ctx.metrics.chunks.labels(duplicate="false").inc(len(fresh))
    ctx.metrics.frames_appended(k for k, r in zip(kinds, results, strict=False) if r.ok and not r.duplicate)
    if len(kept) > len(fresh):
        ctx.metrics.chunks.labels(duplicate="true").inc(len(kept) - len(fresh))
    if fresh:
        ctx.wake.notify(f"inv:{invocation_id}")
        await _publish(ctx, invocation_id, fresh)
    answers = [{"seq": r.seq, "duplicate": r.duplicate} for r in kept]
    if len(kept) == len(results):
        return 200, {"ok": True, "results": answers}
    refused = results[len(kept)]
    reason = refused.reason or "frames refused"
    if refused.status == UNKNOWN:
        raise HTTPError(404, reason, ok=False)
    _refused(caller, f"frames from {refused.seq}", invocation_id, refused.status, reason)
    out: dict[str, Any] = {"ok": False, "error": reason, "results": answers}
    if refused.expected_seq is not None:
        out["expected_seq"] = refused.expected_seq
    return refused.status, out


async def _publish(ctx: Context, invocation_id: str, items: list[tuple[int, bytes, bool]]) -> None:
    """Hand new frames to the live fan-out; a failure is logged (followers read the journal)."""
    fanout = ctx.fanout
    if fanout is None:
        return
    try:
        if hasattr(fanout, "publish_many"):
            await fanout.publish_many(invocation_id, items)
        else:
            for seq, data, final in items:
                await fanout.publish(invocation_id, seq, data, final)
    except Exception:
        log.warning("live publish of %s (%d frame(s)) failed; followers catch up from the journal",
                    invocation_id, len(items), exc_info=True)  # fmt: skip


async def _poke(ctx: Context, invocation_id: str) -> None:
    """Tell the live followers of ``invocation_id`` to re-read the store (its state changed)."""
    poke = getattr(ctx.fanout, "poke", None)
    if poke is None:
        return
    try:
        await poke(invocation_id)
    except Exception:
        log.warning("live poke of %s failed", invocation_id, exc_info=True)


def _running_exec(body: dict[str, Any]) -> list[tuple[str, int]] | None:
    """``running_exec`` of a heartbeat: the exec jobs ``[{exec_id, attempt}]`` the daemon runs.
    Absent (a daemon from before exec leases): None, and the store renews all the worker's exec jobs."""
    if body.get("running_exec") is None:
        return None
    running = field(body, "running_exec", list)
    if len(running) > MAX_RUNNING:
        raise HTTPError(
            400, f"field 'running_exec' lists {len(running)} exec jobs; the limit is {MAX_RUNNING}"
        )
    pairs: list[tuple[str, int]] = []
    for item in running:
        if not isinstance(item, dict):
            raise HTTPError(400, "field 'running_exec' must list maps {exec_id, attempt}")
        exec_id = http.ulid(item.get("exec_id"), "exec_id")
        attempt = item.get("attempt")
        if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt <= http.I32_MAX:
            raise HTTPError(
                400, f"running_exec[].attempt of {exec_id} must be an integer between 0 and {http.I32_MAX}"
            )
        pairs.append((exec_id, attempt))
    return pairs


async def deregister(ctx: Context, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    """A nymph that stops cleanly says so: its worker is not live from now (``lakeshore workers``
    says ``stopped``; queues count it no more) until it registers again. Only the token the worker
    id is bound to may (``own worker``); leases it still holds lapse as usual."""
    worker_id = await _worker(ctx, caller, body)
    await ctx.call(ctx.store.deregister_worker, worker_id)
    ctx.daemons.forget(worker_id)
    log.info("worker %s deregistered (a clean stop)", worker_id)
    return {"ok": True}


async def heartbeat(ctx: Context, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    worker_id = await _worker(ctx, caller, body)
    running = field(body, "running", list, default=[])
    if len(running) > MAX_RUNNING:
        raise HTTPError(400, f"field 'running' lists {len(running)} invocations; the limit is {MAX_RUNNING}")
    pairs: list[tuple[str, int]] = []
    for item in running:
        if not isinstance(item, dict):
            raise HTTPError(400, "field 'running' must list maps {invocation_id, attempt}")
        inv_id = http.ulid(item.get("invocation_id"), "invocation_id")
        attempt = item.get("attempt")
        if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt <= http.I32_MAX:
            raise HTTPError(
                400, f"running[].attempt of {inv_id} must be an integer between 0 and {http.I32_MAX}"
            )
        pairs.append((inv_id, attempt))
    exec_pairs = _running_exec(body)
    field(body, "free_slots", int, default=0)
    # Idle (a daemon without running_exec renews every exec job it holds: not idle), its poll
    # waiting: nothing to write (server/idle.py)
    quiet = ctx.daemons.quiet_heartbeat(worker_id) if not pairs and exec_pairs == [] else None
    if quiet is not None:
        ctx.metrics.idle_answers.labels(kind="heartbeat").inc()
        result = HeartbeatResult([], [], quiet[0])
    else:
        beat = HeartbeatRequest(worker_id, pairs, ctx.config.lease_s, exec_pairs, caller.principal.namespace)
        began = ctx.daemons.begin()
        written = await ctx.write(beat)
        assert isinstance(written, HeartbeatResult)
        result = written
        ctx.daemons.wrote(worker_id, began, result.pinned_version)
    out = {
        "ok": True,
        "lease_s": ctx.config.lease_s,
        "commands": [command_dict(c) for c in result.commands],
        "lost": result.lost,
    }
    return _with_pin(out, result.pinned_version)
