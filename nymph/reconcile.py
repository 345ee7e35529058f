"""Reconcile on start-up: deal with every workdir a previous life of nymph left behind.

For each ``{workdir}/{ULID}/``:

* already settled (``outcome.json``: a failure kept for inspection): left alone, but one a user of
  the task user pool still owns (a previous life died before it sealed it, or predates the seal)
  is taken back first (:func:`nymph.workdir.seal`): that uid runs other tenants' tasks;
* a persisted handle the runner can re-attach to (:meth:`Runner.recover`): supervised again
  (frames keep flowing, the wait, the ack) as if nothing happened;
* a handle whose task is gone: its outputs are read and acked (frames not yet sent go first);
* a handle of a runner that cannot re-attach (``Capabilities.recover`` False): ``recover`` is
  never called; the task is destroyed (nobody would supervise it) and what it left is read and
  acked like a gone task's;
* a handle the runner cannot look at yet (``recover`` raises :class:`RunnerUnavailable`: the
  Docker engine is down): the job is resumed with ``alive=None`` and asks again, with backoff,
  until the runner answers; nothing is acked on a guess;
* nymph's ``invocation.json`` but no handle (nymph died between the claim and the start, or
  between ``runner.start`` and saving the handle): when the runner lists a task labelled with the
  invocation and attempt (``list_labelled``), that task is adopted; otherwise acked ``failed``
  ``{type: "DaemonRestart"}``; the control plane decides about a retry;
* nothing of nymph's at all: removed as an orphan, unless the outbox still holds a message for it.

Runners that label what they start (docker, gvisor, kube) declare ``Capabilities.list_labelled``
and implement :class:`~nymph.runner.Labelling` (``list_labelled(worker_id)``); what a runner can
do is read only from its capabilities, never guessed from its attributes. Every labelled task of
this worker that no unsettled workdir claims (its workdir is gone or settled) is destroyed here, so
no labelled container outlives a restart. When listing fails for
another reason than an unavailable runner (a bug, a malformed answer), the workdirs are still
reconciled, the failure is logged and the result says ``sweep_pending``: the agent calls
:func:`sweep_labelled` again later, sparing the tasks of the jobs it runs by then.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from typing import cast

from dreamlake.lakeshore import ids
from nymph import taskuser
from nymph import workdir as wd
from nymph.job import Job, JobContext
from nymph.runner import Handle, Labelling, RunnerError, RunnerUnavailable

log = logging.getLogger(__name__)


def _key(handle: Handle) -> str:
    cid = handle.data.get("container_id")
    return str(cid) if cid else json.dumps(handle.data, sort_keys=True)


def _labelled(ctx: JobContext) -> list[Handle] | None:
    """The runner's labelled tasks of this worker; None when it does not declare ``list_labelled``.

    Raises RunnerUnavailable: reconciliation waits for the runner (the agent retries).
    """
    if not ctx.runner.capabilities.list_labelled:
        return None
    lister = cast(Labelling, ctx.runner)
    return [h for h in lister.list_labelled(ctx.worker_id) if isinstance(h, Handle)]


class Recovered(list[tuple[Job, bool | None]]):
    """What :func:`recover_all` found; ``sweep_pending``: the labelled tasks could not be listed."""

    sweep_pending: bool = False


def _labelled_or_pending(ctx: JobContext) -> tuple[list[Handle] | None, bool]:
    """``_labelled``, with a failure other than RunnerUnavailable logged and reported as pending."""
    try:
        return _labelled(ctx), False
    except RunnerUnavailable:
        raise
    except Exception:
        log.exception(
            "runner %s: listing its labelled tasks failed; orphaned tasks of a previous run are "
            "removed later (the workdirs are reconciled now)",
            ctx.runner.name,
        )
        return None, True


def recover_all(ctx: JobContext) -> Recovered:
    """Jobs to resume, each with whether its task is still alive (None: unknown yet).

    Orphaned workdirs and labelled tasks nobody claims are cleaned here. Raises RunnerUnavailable
    when the runner cannot list its tasks; call again once ``runner.check()`` passes.
    """
    labelled, sweep_pending = _labelled_or_pending(ctx)
    by_invocation: dict[tuple[str, int], Handle] = {}
    for h in labelled or []:
        by_invocation.setdefault((h.invocation_id, h.attempt), h)
    kept: set[str] = set()
    found = Recovered()
    found.sweep_pending = sweep_pending
    pool_uids = taskuser.task_users(ctx.config).pool_uids()
    for path in wd.leftovers(ctx.config.workdir):
        invocation_id = path.name
        if wd.is_settled(path):
            if pool_uids:
                wd.seal(path, owners=pool_uids)
            continue
        meta = wd.read_meta(path)
        if meta is None or meta.get("invocation_id") != invocation_id:
            if ctx.outbox.pending_for(invocation_id):
                continue
            log.warning(
                "invocation %s: orphaned workdir %s (nothing of nymph's in it) removed", invocation_id, path
            )
            wd.remove(path)
            continue
        handle = Handle.load(path)
        if handle is None:
            adopted = by_invocation.get((invocation_id, int(meta.get("attempt", 1))))
            if adopted is not None:
                log.info(
                    "invocation %s: no handle saved, but its labelled task %s exists; adopting it",
                    invocation_id,
                    _key(adopted)[:12],
                )
                adopted.save(path)
                handle = adopted
        alive: bool | None = False
        if handle is not None:
            if handle.runner != ctx.runner.name:
                log.error(
                    "invocation %s: started by runner %r, this nymph runs %r; cannot re-attach",
                    invocation_id,
                    handle.runner,
                    ctx.runner.name,
                )
                found.append((Job.attach(ctx, path, meta, None), False))
                continue
            kept.add(_key(handle))
            if not ctx.runner.capabilities.recover:
                _destroy_unrecoverable(ctx, handle)
            else:
                try:
                    alive = ctx.runner.recover(handle)
                except RunnerUnavailable as exc:
                    log.warning(
                        "invocation %s: runner unavailable, re-attach deferred: %s", invocation_id, exc
                    )
                    alive = None
                except Exception as exc:
                    log.warning("invocation %s: recover failed: %s", invocation_id, exc)
                    alive = False
        log.info(
            "invocation %s: left by a previous run (attempt %s): %s",
            invocation_id,
            meta.get("attempt"),
            "re-attaching"
            if alive
            else ("deferred" if alive is None else "collecting its outcome" if handle else "never started"),
        )
        found.append((Job.attach(ctx, path, meta, handle), alive))
    for h in labelled or []:
        if _key(h) not in kept:
            _destroy_orphan(ctx, h)
    return found


def _destroy_unrecoverable(ctx: JobContext, handle: Handle) -> None:
    """Destroy a task its runner cannot re-attach to (``recover=False``): nobody would supervise it.

    Best effort: the job collects what it left and destroys it again when it settles.
    """
    log.warning(
        "invocation %s: runner %s cannot re-attach (capabilities.recover is False); its task is "
        "destroyed and what it left is reported",
        handle.invocation_id,
        ctx.runner.name,
    )
    try:
        ctx.runner.destroy(handle)
    except RunnerError as exc:  # RunnerUnavailable too: the job's own destroy tries again
        log.warning("invocation %s: could not destroy its task now: %s", handle.invocation_id, exc)


def _destroy_orphan(ctx: JobContext, h: Handle) -> None:
    log.warning(
        "invocation %s: labelled task %s of a previous run has no unsettled workdir; removed",
        h.invocation_id,
        _key(h)[:12],
    )
    try:
        ctx.runner.destroy(h)
    except RunnerUnavailable:
        raise
    except RunnerError as exc:
        log.warning("invocation %s: could not remove task %s: %s", h.invocation_id, _key(h)[:12], exc)


def sweep_labelled(ctx: JobContext, live: Callable[[], Collection[str]]) -> bool:
    """The labelled-task sweep of :func:`recover_all`, tried again after nymph started claiming.

    Destroys this worker's labelled tasks that no job runs (``live()``: the invocation and exec
    ids of the jobs running now, asked after listing, so a task started meanwhile is spared) and
    no unsettled workdir claims. True when done; False when listing failed again (logged). Raises
    RunnerUnavailable like :func:`recover_all`.
    """
    labelled, pending = _labelled_or_pending(ctx)
    if pending:
        return False
    running = set(live())
    for h in labelled or []:
        if h.invocation_id in running:
            continue
        path = ctx.config.workdir / h.invocation_id
        claimed = ids.is_ulid(h.invocation_id) and path.is_dir() and not wd.is_settled(path)
        if claimed and wd.read_meta(path) is not None:
            continue  # an unsettled workdir still claims it
        _destroy_orphan(ctx, h)
    log.info("runner %s: labelled tasks of a previous run reconciled", ctx.runner.name)
    return True
