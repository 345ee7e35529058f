"""Authorization: the one table of who may call which route, and on which objects.

:data:`ROUTES` lists every route of the control plane. For each it names the token kinds that may
call it, each with an ownership rule (:class:`Own`) that decides which objects that kind may touch
there; a kind not listed is refused 403 before the handler runs. ``app.py`` builds its routing
table from :data:`ROUTES`, so a route cannot exist without an entry (the dashboard's pages are one
entry, :data:`UI`, that ``server.ui`` checks its session cookie against), and every handler receives
a :class:`Caller` (the principal and its rule) and applies the rule through the functions below:

=================  ===========================================================================
rule               what the caller may touch
=================  ===========================================================================
``any``            every object of the route
``own namespace``  objects of the namespace its token is bound to (see :func:`confined_to`); an
                   invocation of another namespace answers 404 (its existence is not
                   disclosed), a ``/v1/namespaces/<ns>`` path (or ``?namespace=``) of another
                   namespace 403
``own worker``     worker ids bound to its token (the first daemon call naming an unbound id
                   binds it, see :class:`WorkerBindings`); a daemon token bound to a namespace
                   claims only that namespace's work
``own lease``      ``own worker``, and only invocations (exec jobs) whose current lease that
                   worker holds, under the attempt it names (the store checks the lease: 409
                   superseded, 403 another worker)
``own descendants``  a task token (minted per claim, handed to the task by nymph): submits
                   children of its own invocation, into its namespace, and reaches only that
                   invocation's descendants; every request also checks that the attempt still
                   runs (401 once acked). See ``server/tasks.py``
=================  ===========================================================================

Submitting ``run_config.script`` also needs the token's ``may_script`` flag (admins always may),
see :func:`check_submit`. ``python -m dreamlake.lakeshore.server.authz`` prints the table as the
Markdown of docs/security.md; a test keeps the two equal.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.store.api import DEFAULT_NAMESPACE, TOKEN_KINDS, Invocation, Principal, visible

log = logging.getLogger(__name__)

KINDS = TOKEN_KINDS


class Own(enum.Enum):
    """Which objects of a route a token kind may touch (see the module docstring)."""

    ANY = "any"
    NAMESPACE = "own namespace"
    WORKER = "own worker"
    LEASE = "own lease"
    DESCENDANTS = "own descendants"


@dataclass(frozen=True)
class RouteAuth:
    """One route: its handler (a method of ``app.Routes``, or ``ops.<method>`` of
    ``ops.OpsRoutes``), method, path and grants."""

    handler: str
    method: str
    path: str
    grants: Mapping[str, Own] = field(default_factory=dict)  # kind -> rule; other kinds: 403
    outside: int | None = 404  # the answer for an object outside the caller's rule; None: no such object
    public: bool = False  # no token needed
    session: bool = False  # the token comes in the dashboard's session cookie (server.ui), not a header


def _route(
    handler: str,
    method: str,
    path: str,
    grants: Mapping[str, Own] | None = None,
    *,
    outside: int | None = 404,
    session: bool = False,
    **kinds: Own,
) -> RouteAuth:
    every = {**(grants or {}), **kinds}
    unknown = set(every) - set(KINDS)
    if unknown:
        raise ValueError(f"route {path}: unknown token kinds {sorted(unknown)}")
    return RouteAuth(handler, method, path, every, outside, session=session)


_NS, _ANY, _WORKER, _LEASE, _DESC = Own.NAMESPACE, Own.ANY, Own.WORKER, Own.LEASE, Own.DESCENDANTS
_INV = "/v1/producer/invocations/{id}"
_OPS = {"admin": _ANY, "producer": _NS, "namespace": _NS}  # operators' views (server.ops)
_EVERY = dict.fromkeys(KINDS, _ANY)

ROUTES: tuple[RouteAuth, ...] = (
    RouteAuth("healthz", "GET", "/healthz", public=True),
    _route("metrics", "GET", "/metrics", admin=_ANY, metrics=_ANY),
    # producers: invocations of their own namespace only (an unbound producer token: "default");
    # a task: children of its invocation, in that invocation's namespace
    _route("submit", "POST", "/v1/producer/submit", outside=None, admin=_ANY, producer=_NS, task=_DESC),
    _route(
        "submit_batch",
        "POST",
        "/v1/producer/submit-batch",
        outside=None,
        admin=_ANY,
        producer=_NS,
        task=_DESC,
    ),
    _route("await_", "POST", "/v1/producer/await", admin=_ANY, producer=_NS, task=_DESC),
    # many ids at once (server/bulk.py): an id outside the rule is answered as an unknown one, in
    # the answer's "unknown" list (the request itself succeeds), never disclosed
    _route(
        "await_batch",
        "POST",
        "/v1/producer/await-batch",
        outside=None,
        admin=_ANY,
        producer=_NS,
        task=_DESC,
    ),
    _route("status", "GET", _INV, admin=_ANY, producer=_NS, task=_DESC),
    _route("cancel", "POST", _INV + "/cancel", admin=_ANY, producer=_NS, task=_DESC),
    _route("result_stream", "GET", _INV + "/result/stream", admin=_ANY, producer=_NS, task=_DESC),
    # two-way generators: the invocation's owner sends into its paused body (server/sends.py)
    _route("send", "POST", _INV + "/send", admin=_ANY, producer=_NS, task=_DESC),
    # topics are one space shared by every producer (see docs/security.md)
    _route("topic_post", "POST", "/v1/producer/topics/{name}/post", admin=_ANY, producer=_ANY),
    _route("topic_stream", "GET", "/v1/producer/topics/{name}/stream", admin=_ANY, producer=_ANY),
    # daemons: as the workers their token registered, on the leases those workers hold
    _route("register", "POST", "/v1/daemon/register", outside=403, admin=_ANY, daemon=_WORKER),
    _route("poll", "POST", "/v1/daemon/poll", outside=403, admin=_ANY, daemon=_WORKER),
    _route("heartbeat", "POST", "/v1/daemon/heartbeat", outside=403, admin=_ANY, daemon=_WORKER),
    _route("deregister", "POST", "/v1/daemon/deregister", outside=403, admin=_ANY, daemon=_WORKER),
    _route("ack", "POST", "/v1/daemon/ack", outside=403, admin=_ANY, daemon=_LEASE),
    _route("result_chunk", "POST", "/v1/daemon/result-chunk", outside=403, admin=_ANY, daemon=_LEASE),
    _route("result_chunks", "POST", "/v1/daemon/result-chunks", outside=403, admin=_ANY, daemon=_LEASE),
    _route("sends_fetch", "POST", "/v1/daemon/sends", outside=403, admin=_ANY, daemon=_LEASE),
    # an attempt's checkpoint for the next attempt (server/checkpoints.py), while it holds the lease
    _route("checkpoint", "POST", "/v1/daemon/checkpoint", outside=403, admin=_ANY, daemon=_LEASE),
    # namespaces (seed 003): the path names the namespace, so another one answers 403
    _route("exec_", "POST", "/v1/namespaces/{ns}/exec", outside=403, admin=_ANY, namespace=_NS),
    _route(
        "job_result", "GET", "/v1/namespaces/{ns}/jobs/{id}/result", outside=403, admin=_ANY, namespace=_NS
    ),
    _route(
        "job_publish", "POST", "/v1/namespaces/{ns}/jobs/{id}/result", outside=403, admin=_ANY, daemon=_LEASE
    ),
    # the exec output archive (server/execout.py): the claimer writes it, the namespace reads it
    _route(
        "job_output_put",
        "PUT",
        "/v1/namespaces/{ns}/jobs/{id}/output/{stream}",
        outside=403,
        admin=_ANY,
        daemon=_LEASE,
    ),
    _route(
        "job_output",
        "GET",
        "/v1/namespaces/{ns}/jobs/{id}/output/{stream}",
        outside=403,
        admin=_ANY,
        namespace=_NS,
    ),
    # presign: producers and tasks upload big arguments (argsRef) and read big results, nymph
    # the other way round; a task only while its attempt runs
    _route(
        "presign",
        "POST",
        "/v1/namespaces/{ns}/payloads/presign",
        outside=403,
        admin=_ANY,
        producer=_NS,
        namespace=_NS,
        daemon=_NS,
        task=_DESC,
    ),
    _route("pin", "PUT", "/v1/namespaces/{ns}/pin", outside=403, admin=_ANY),
    # secrets (server/secrets.py): set, listed (names only) and removed in the token's namespace,
    # another namespace's answering 404 as an unknown one does; their values go only to the worker
    # holding a running attempt's lease or to that attempt's own task credential, never an admin
    _route("secret_list", "GET", "/v1/namespaces/{ns}/secrets", _OPS),
    _route("secret_put", "PUT", "/v1/namespaces/{ns}/secrets/{name}", _OPS),
    _route("secret_delete", "DELETE", "/v1/namespaces/{ns}/secrets/{name}", _OPS),
    _route("secrets_fetch", "POST", "/v1/daemon/secrets", outside=403, daemon=_LEASE, task=_DESC),
    # the local blob directory (server/blobdir.py, no bucket configured): the presigned URL's
    # signature is the credential, as an S3 URL's is; presign itself is namespace-gated above
    RouteAuth("blob_put", "PUT", "/v1/blobs/{key:path}", public=True),
    RouteAuth("blob_get", "GET", "/v1/blobs/{key:path}", public=True),
    # operators (server.ops): an admin sees every namespace, the others their own
    _route("ops.whoami", "GET", "/v1/ops/whoami", _EVERY),
    _route("ops.whoami", "POST", "/v1/ops/whoami", _EVERY),
    # the limits the control plane decides (acks per poll, inline threshold, batch sizes): any token
    _route("ops.info", "GET", "/v1/ops/info", _EVERY),
    _route("ops.queues", "GET", "/v1/ops/queues", _OPS, outside=403),
    # a queue's fleet-wide limit covers every namespace's calls of it: admins only
    _route("ops.queue_limit", "PUT", "/v1/ops/queues/{name}/limit", admin=_ANY),
    _route("ops.queue_limit_clear", "DELETE", "/v1/ops/queues/{name}/limit", admin=_ANY),
    _route("ops.workers", "GET", "/v1/ops/workers", _OPS, outside=403),
    _route("ops.invocations", "GET", "/v1/ops/invocations", _OPS, outside=403),
    _route("ops.invocation", "GET", "/v1/ops/invocations/{id}", _OPS),
    _route("ops.cancel", "POST", "/v1/ops/invocations/{id}/cancel", _OPS),
    # the dashboard: every /ui page, with the token of its session cookie (server.ui)
    _route("ui", "GET, POST", "/ui/*", _OPS, session=True),
)

#: The dashboard's entry of :data:`ROUTES` (``server.ui`` checks its sessions against it).
UI = next(r for r in ROUTES if r.session)

ANONYMOUS = Principal(token_id="", kind="anonymous", namespace=None, name="anonymous")


@dataclass(frozen=True)
class Caller:
    """Who calls a route (their principal) and the rule their kind has there."""

    principal: Principal
    rule: Own
    route: RouteAuth

    @property
    def admin(self) -> bool:
        return self.principal.kind == "admin"

    @property
    def namespace(self) -> str | None:
        """The namespace this caller is confined to; None: any."""
        return confined_to(self.principal)


def confined_to(principal: Principal) -> str | None:
    """The namespace a principal acts in: its token's; ``default`` for an unbound producer (every
    invocation has a namespace); None (any) for an admin and an unbound daemon."""
    if principal.kind == "admin":
        return None
    if principal.kind == "producer":
        return principal.namespace or DEFAULT_NAMESPACE
    return principal.namespace


def authorize(route: RouteAuth, principal: Principal) -> Caller:
    """The caller's rule on ``route``; 403 naming the kinds that may call it when theirs may not."""
    rule = Own.ANY if route.public else route.grants.get(principal.kind)
    if rule is None:
        allowed = " or ".join(route.grants)
        raise HTTPError(
            403,
            f"token '{principal.name}' is a {principal.kind} token; "
            f"{route.method} {route.path} needs {allowed}",
        )
    return Caller(principal, rule, route)


def see_invocation(caller: Caller, invocation_id: str, inv: Invocation | None) -> Invocation:
    """``inv`` when the caller may see it; 404 when it is unknown or outside the caller's
    namespace (the answer is the same, so an id of another namespace discloses nothing)."""
    confined = caller.rule in (Own.NAMESPACE, Own.DESCENDANTS)
    if inv is None or (confined and not visible(caller.namespace, inv)):
        raise HTTPError(404, f"unknown invocation '{invocation_id}'")
    return inv


def enter_namespace(caller: Caller, namespace: str) -> None:
    """Refuse (the route's ``outside`` status) a ``/v1/namespaces/<namespace>`` call by a token
    bound to another namespace."""
    if caller.rule is Own.ANY:
        return
    bound = caller.namespace
    if bound is not None and bound != namespace:
        name = caller.principal.name
        raise HTTPError(
            caller.route.outside or 403, f"token '{name}' is bound to namespace '{bound}', not '{namespace}'"
        )


def check_submit(caller: Caller, run_config: Mapping[str, Any]) -> None:
    """403 for a ``script`` invocation from a token without ``may_script``."""
    if run_config.get("script") in (None, "") or caller.admin or caller.principal.may_script:
        return
    log.warning("refused a script invocation from token %r (no may_script)", caller.principal.name)
    raise HTTPError(
        403,
        f"token '{caller.principal.name}' may not submit script invocations (its may_script flag is "
        "off): mint a token with 'lakeshore token create --kind producer --may-script', or submit a "
        "function instead of run_config.script",
    )


class WorkerBindings:
    """Which token each worker id is bound to: the first daemon call naming an unbound worker id
    binds it (``bind``, the store's conditional update); a binding never changes, so it is cached."""

    _CACHE_MAX = 65536

    def __init__(self, bind: Callable[[str, str], Awaitable[str]]) -> None:
        self._bind = bind
        self._bound: dict[str, str] = {}

    async def check(self, caller: Caller, worker_id: str) -> None:
        """403 (logged) unless ``worker_id`` is bound to the caller's token; an admin may act as
        any worker (and binds none)."""
        if caller.rule is Own.ANY:
            return
        token_id = caller.principal.token_id
        bound = self._bound.get(worker_id)
        if bound is None:
            bound = await self._bind(worker_id, token_id)
            if len(self._bound) >= self._CACHE_MAX:
                self._bound.clear()
            self._bound[worker_id] = bound
        if bound != token_id:
            log.warning(
                "refused %s %s from token %r acting as worker %s, which another token registered",
                caller.route.method,
                caller.route.path,
                caller.principal.name,
                worker_id,
            )
            raise HTTPError(
                403,
                f"worker {worker_id} is registered by another daemon token: a worker id is bound to "
                "the token that registered it; register a new worker id with this token",
                ok=False,
            )


# -- the matrix as Markdown (docs/security.md) ----------------------------------------------------

MATRIX_BEGIN = "<!-- auth-matrix:begin (generated by python -m dreamlake.lakeshore.server.authz) -->"
MATRIX_END = "<!-- auth-matrix:end -->"


def matrix_markdown() -> str:
    """The table of :data:`ROUTES` as Markdown: a row per route, a column per kind."""
    lines = [
        "| route | " + " | ".join(KINDS) + " | outside the rule |",
        "| --- | " + " | ".join("---" for _ in KINDS) + " | --- |",
    ]
    for r in ROUTES:
        if r.public:
            cells = ["public (no token)"] * len(KINDS)
            outside = "-"
        else:
            cells = [r.grants[k].value if k in r.grants else "403" for k in KINDS]
            confined = r.outside is not None and any(g is not Own.ANY for g in r.grants.values())
            outside = str(r.outside) if confined else "-"
        where = f"`{r.method} {r.path}`" + (" (session cookie)" if r.session else "")
        lines.append(f"| {where} | " + " | ".join(cells) + f" | {outside} |")
    return "\n".join(lines) + "\n"


def render_into(text: str) -> str:
    """``text`` (docs/security.md) with the part between the matrix markers regenerated."""
    head, sep, rest = text.partition(MATRIX_BEGIN)
    _, sep2, tail = rest.partition(MATRIX_END)
    if not sep or not sep2:
        raise ValueError(f"the document lacks the markers {MATRIX_BEGIN!r} ... {MATRIX_END!r}")
    return f"{head}{MATRIX_BEGIN}\n{matrix_markdown()}{MATRIX_END}{tail}"


if __name__ == "__main__":  # pragma: no cover - a maintainer's tool
    import sys
    from pathlib import Path

    if len(sys.argv) == 2:
        doc = Path(sys.argv[1])
        doc.write_text(render_into(doc.read_text()))
    else:
        sys.stdout.write(matrix_markdown())
