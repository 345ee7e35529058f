"""The rows of the ``task`` token kind (server/task_tokens.py mints and verifies the token).

What it may do: the ``task`` column of ``authz.ROUTES``, rule "own descendants", which ``app``
applies through :func:`check_submit` and :func:`check_target`:

* submit, into its invocation's namespace, with its invocation as the parent (a submit naming
  another parent: 403): the store records ``parent_invocation_id`` / ``root_invocation_id``;
* status, await, result stream and cancel of its own descendants (a child, a grandchild, ...);
  any other invocation answers 404, as an unknown id does (nothing is disclosed);
* presign payloads (``POST /v1/namespaces/<its namespace>/payloads/presign``: big arguments of
  the children it submits, their big results);
* nothing else: topics, daemon, the other namespace routes, ops and dashboard routes refuse the
  ``task`` kind (403).

It lives as long as its attempt runs: every request re-reads the invocation, and once the attempt
is acked (or superseded, or cancelled and gone) the token answers 401. ``expires_at``
(``ServerConfig.task_token_ttl_s`` after the claim, or the run's ``timeout_s`` plus a lease when
that is shorter) bounds a token that leaked from a task that never ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.store.api import Invocation, Principal

if TYPE_CHECKING:
    from dreamlake.lakeshore.server.authz import Caller
    from dreamlake.lakeshore.server.context import Context

_LINEAGE_DEPTH = 64  # the deepest descendant a task token reaches


# --- the rows of the ``task`` kind ----------------------------------------------------------------


async def live(ctx: Context, principal: Principal) -> Invocation:
    """The task's invocation while the token's attempt runs; 401 once it ended."""
    assert principal.invocation_id is not None
    inv = await ctx.call(ctx.store.get, principal.invocation_id)
    if inv is None or inv.state != "running" or inv.attempt != principal.attempt:
        raise HTTPError(
            401,
            f"the task token of invocation {principal.invocation_id} (attempt {principal.attempt}) "
            "ended with that attempt: a task token is valid only while its invocation runs",
        )
    return inv


async def check_submit(ctx: Context, caller: Caller, body: dict[str, Any]) -> None:
    """A task submits children of its own invocation, into its namespace (set by the submit route)."""
    own_child(await live(ctx, caller.principal), body)


def own_child(inv: Invocation, body: dict[str, Any]) -> None:
    """Make a submit ``body`` of the task of ``inv`` a child of ``inv`` (403 for another parent);
    the submit-batch route checks each item so, after one :func:`live`."""
    parent = body.get("parent_invocation_id")
    if parent is None:
        body["parent_invocation_id"] = inv.invocation_id
    elif parent != inv.invocation_id:
        raise HTTPError(
            403,
            f"a task token submits children of its own invocation {inv.invocation_id} only, "
            f"not of {str(parent)[:64]!r}",
        )


async def check_target(ctx: Context, caller: Caller, target: str) -> None:
    """The route's ``outside`` answer (404, as for an unknown id) unless ``target`` descends from
    the task's invocation; 401 once the task's attempt ended."""
    inv = await live(ctx, caller.principal)
    ids.validate(target, "invocation id")
    chain = await ctx.call(ctx.store.lineage, target, _LINEAGE_DEPTH)
    if inv.invocation_id not in chain[1:]:
        raise HTTPError(
            caller.route.outside or 403,
            f"unknown invocation '{target}' (a task token reaches only the invocations its task "
            "submitted, and theirs)",
        )
