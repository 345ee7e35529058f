"""Task tokens: the credential nymph hands each invocation, so that a task can submit tasks.

The poll answer's run command carries ``task_token``; nymph puts it in the task's environment as
``LAKESHORE_TOKEN`` beside ``LAKESHORE_URL`` (docs/protocol.md "Task tokens"). The token is
stateless: ``lst_`` + base64url(msgpack ``[1, invocation_id, attempt, namespace, expires_at]``) +
``.`` + base64url(HMAC-SHA256 of that payload), under a key every replica shares
(``store.server_key("task-token")``). Minting it costs the claim nothing; verifying it costs one
HMAC, then one read of the invocation.

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

import base64
import hashlib
import hmac
import time
from typing import TYPE_CHECKING, Any

import msgpack

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.store.api import Invocation, Principal

if TYPE_CHECKING:
    from dreamlake.lakeshore.server.authz import Caller
    from dreamlake.lakeshore.server.context import Context

PREFIX = "lst_"
KEY_NAME = "task-token"
_VERSION = 1
_LINEAGE_DEPTH = 64  # the deepest descendant a task token reaches


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TaskTokens:
    """Mints and verifies task tokens under one HMAC key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("the task-token key must hold at least 32 bytes")
        self._key = key

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def mint(self, invocation_id: str, attempt: int, namespace: str, expires_at: float) -> str:
        payload = msgpack.packb([_VERSION, invocation_id, attempt, namespace, int(expires_at)])
        return f"{PREFIX}{_b64(payload)}.{_b64(self._sign(payload))}"

    def verify(self, secret: str, now: float | None = None) -> Principal | None:
        """The task principal of ``secret``; None when it is malformed, forged or expired."""
        if not secret.startswith(PREFIX):
            return None
        body, _, signature = secret[len(PREFIX) :].partition(".")
        try:
            payload, sig = _unb64(body), _unb64(signature)
            if not hmac.compare_digest(sig, self._sign(payload)):
                return None
            version, invocation_id, attempt, namespace, expires_at = msgpack.unpackb(payload)
        except (ValueError, TypeError, msgpack.UnpackException):
            return None
        if version != _VERSION or expires_at <= (time.time() if now is None else now):
            return None
        return Principal(
            token_id=f"task:{invocation_id}:{attempt}",
            kind="task",
            namespace=namespace,
            name=f"task of {invocation_id}",
            invocation_id=invocation_id,
            attempt=attempt,
        )


def expires_at(inv: Invocation, ttl_s: float, lease_s: float, now: float) -> float:
    """When the token of a claim made at ``now`` lapses at the latest."""
    timeout = (inv.run_config or {}).get("timeout_s")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return now + min(ttl_s, float(timeout) + lease_s)
    return now + ttl_s


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
