"""Reconcile on start-up: deal with every workdir a previous life of nymph left behind.

For each ``{workdir}/{ULID}/``:

* already settled (``outcome.json``: a failure kept for inspection): left alone;
* a persisted handle the runner can re-attach to (:meth:`Runner.recover`): supervised again
  (frames keep flowing, the wait, the ack) as if nothing happened;
* a handle whose task is gone: its outputs are read and acked (frames not yet sent go first);
* nymph's ``invocation.json`` but no handle (nymph died between the claim and the start):
  acked ``failed`` ``{type: "DaemonRestart"}``; the control plane decides about a retry;
* nothing of nymph's at all: removed as an orphan, unless the outbox still holds a message for it.
"""

from __future__ import annotations

import logging

from nymph import workdir as wd
from nymph.job import Job, JobContext
from nymph.runner import Handle

log = logging.getLogger(__name__)


def recover_all(ctx: JobContext) -> list[tuple[Job, bool]]:
    """Jobs to resume, each with whether its task is still alive; orphans are cleaned here."""
    found: list[tuple[Job, bool]] = []
    for path in wd.leftovers(ctx.config.workdir):
        invocation_id = path.name
        if wd.is_settled(path):
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
        alive = False
        if handle is not None:
            if handle.runner != ctx.runner.name:
                log.error(
                    "invocation %s: started by runner %r, this nymph runs %r; cannot re-attach",
                    invocation_id,
                    handle.runner,
                    ctx.runner.name,
                )
                job = Job.attach(ctx, path, meta, None)
                found.append((job, False))
                continue
            try:
                alive = ctx.runner.recover(handle)
            except Exception as exc:
                log.warning("invocation %s: recover failed: %s", invocation_id, exc)
                alive = False
        log.info(
            "invocation %s: left by a previous run (attempt %s): %s",
            invocation_id,
            meta.get("attempt"),
            "re-attaching" if alive else ("collecting its outcome" if handle else "never started"),
        )
        found.append((Job.attach(ctx, path, meta, handle), alive))
    return found
