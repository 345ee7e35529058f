"""``POST /v1/daemon/checkpoint``: an attempt's checkpoint for the next attempt (issue 30 item 4).

nymph tars the task's ``dls.checkpoint_dir()`` when an attempt ends without succeeding (failed,
timed out, preempted), uploads it to the payload store (``payloads/.../<invocation_id>.<random>/
checkpoint``, through the presign route) and, before its ack, records it here:

    {invocation_id, attempt, worker_id, checkpoint_ref: {bucket, key, size, sha256}}

It is recorded only while that worker holds that attempt's lease (the same rule as an ack): a
superseded attempt, a lapsed lease or a finished call answers 409, another worker's lease 403, an
unknown invocation 404, so nothing of a stale attempt overwrites the current one's. The ref's key
must be one nymph minted for this invocation (its ``jobId`` starts with the invocation id) and of
kind ``checkpoint``: a daemon cannot hand the next attempt another call's blob. The next run
command carries ``checkpoint_ref``; retention deletes the blob with the finished call.
"""

from __future__ import annotations

from typing import Any

from dreamlake.lakeshore.server import http
from dreamlake.lakeshore.server.authz import Caller
from dreamlake.lakeshore.server.context import Context
from dreamlake.lakeshore.server.daemon import _attempt, _worker
from dreamlake.lakeshore.server.http import HTTPError, field

KIND = "checkpoint"


def _check_key(ref: dict[str, Any], invocation_id: str) -> None:
    parts = str(ref["key"]).split("/")
    if len(parts) < 3 or parts[-1] != KIND or not parts[-2].startswith(f"{invocation_id}."):
        raise HTTPError(
            400,
            f"checkpoint_ref.key must name a '{KIND}' blob minted for {invocation_id} "
            f"(payloads/<date>/{invocation_id}.<random>/{KIND})",
        )


async def checkpoint(ctx: Context, caller: Caller, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    attempt = _attempt(body)
    worker_id = await _worker(ctx, caller, body)
    ref = ctx.ref(field(body, "checkpoint_ref", dict), "checkpoint_ref")
    _check_key(ref, invocation_id)
    refused = await ctx.call(ctx.store.set_checkpoint, invocation_id, attempt, worker_id, ref)
    if refused is not None:
        status, reason = refused
        return status, {"ok": False, "error": reason}
    return 200, {"ok": True}
