"""Daemon routes (msgpack): register, poll, heartbeat and deregister; ack (:mod:`.daemon_acks`),
result-chunk and result-chunks (:mod:`.daemon_frames`) live beside it and are importable from here.

A daemon acts as the workers its token registered (``authz.WorkerBindings``, checked by
:mod:`.daemon_checks`) and reports only on the leases those workers hold. A daemon token bound to
a namespace registers and claims in it only.

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
import logging
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.server import http, task_tokens
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context, answer_of
from dreamlake.lakeshore.server.daemon_acks import MAX_POLL_ACKS as MAX_POLL_ACKS
from dreamlake.lakeshore.server.daemon_acks import _answer_acks, _poke_all, _poll_acks, settle_flights
from dreamlake.lakeshore.server.daemon_acks import ack as ack  # the routes app.py names here
from dreamlake.lakeshore.server.daemon_checks import _attempt as _attempt  # checkpoints.py imports it
from dreamlake.lakeshore.server.daemon_checks import _worker as _worker
from dreamlake.lakeshore.server.daemon_frames import MAX_BATCH_FRAMES as MAX_BATCH_FRAMES
from dreamlake.lakeshore.server.daemon_frames import result_chunk as result_chunk
from dreamlake.lakeshore.server.daemon_frames import result_chunks as result_chunks
from dreamlake.lakeshore.server.http import HTTPError, field
from dreamlake.lakeshore.server.polls import EXEC, HANDED, RUN, SHUTDOWN, TIMEOUT, Wake
from dreamlake.lakeshore.store.api import (
    Command,
    HeartbeatRequest,
    HeartbeatResult,
    Invocation,
    PollRequest,
    PollResult,
    WriteRequest,
    WriteResult,
)
from dreamlake.lakeshore.store.placement import parse_offer
from dreamlake.lakeshore.store.values import json_safe

log = logging.getLogger(__name__)

MAX_QUEUES = 64
MAX_RUNNING = 4096  # entries of a heartbeat's ``running`` (and ``running_exec``): one statement each


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
        "max_payload_bytes": ctx.max_payload_bytes,  # MAX_PAYLOAD_BYTES: nymph sizes checkpoints by it
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
        ctx.metrics.child(ctx.metrics.claims, "run").inc(len(got.invocations))
        for inv in got.invocations:
            if inv.attempt == 1 and inv.started_at is not None:
                ctx.metrics.child(ctx.metrics.claim_latency, inv.queue).observe(
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
    # that pass would have found. Its acks are written all the same, alone: what they put back
    # (a retry, room under a limit) is notified after that position, so it wakes this poll.
    renewal = ctx.daemons.renewal(worker_id, key)
    waited_from: int | None = None  # the position of the last wait: its pass found nothing
    drained_at: int | None = None  # the position of the last pass, when it had room to spare
    # watched from the first wait on: made here, its task's first step ran ahead of this poll's
    # write (a daemon that hung up meanwhile is seen all the same: its wait ends at once)
    hangup: asyncio.Future[None] | None = None

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
            # hung up, or whose poll is a renewal, gets its acks written, and no pass)
            gone = hangup is not None and hangup.done()
            passes = not gone and renewal is None
            request, marks = prepare() if passes else (None, None)
            writes = [a.request for a in acks if a.request is not None]
            flights = [ctx.acks.begin(w.invocation_id) for w in writes]
            try:
                batch: list[WriteRequest] = [*writes, request] if request is not None else [*writes]
                results = await ctx.write_many(batch, settle_flights(ctx, writes, flights))
                acked, failed = _answer_acks(ctx, caller, acks, results[: len(writes)], flights)
            finally:  # every flight ends (settled ones are left as they are)
                for w, flight in zip(writes, flights, strict=True):
                    ctx.acks.end(w.invocation_id, flight, None)
            await _poke_all(ctx, acks, acked)
            if passes:
                opening = (marks, results[-1])
            if failed is not None and not gone and (not passes or _empty(results[-1])):
                raise failed  # as before: nothing was handed out, the daemon sends all again
        while True:
            if hangup is not None and hangup.done():
                log.debug("poll of worker %s: the daemon hung up; nothing claimed", worker_id)
                ctx.metrics.poll_wait.observe(time.monotonic() - started)
                return {"commands": []} if acked is None else {"commands": [], "acked": acked}
            if renewal is not None:
                (mark, pinned), renewal = renewal, None
                ctx.metrics.child(ctx.metrics.idle_answers, "renewal").inc()
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
                ctx.metrics.child(ctx.metrics.poll_passes, reason).inc()
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
            if hangup is None and receive is not None:
                hangup = asyncio.ensure_future(_hangup(receive))
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


def _empty(got: WriteResult | PlaneError) -> bool:
    """Whether a pass handed nothing out (no claim, no exec job, no command taken)."""
    return isinstance(got, PollResult) and not (got.invocations or got.exec_jobs or got.commands)


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
        ctx.metrics.child(ctx.metrics.idle_answers, "heartbeat").inc()
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
