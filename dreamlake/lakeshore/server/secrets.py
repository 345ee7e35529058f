"""Secrets: a namespace's named values, put in a task's environment by name, never shown.

``lakeshore secret set NAME VALUE`` stores a value for the token's namespace
(``PUT /v1/namespaces/<ns>/secrets/<name>``); ``@dls.udf(secrets=["HF_TOKEN"])`` asks for it by
name, and nymph puts ``HF_TOKEN`` in the task's environment on every runner. Where the value goes,
and where it never does:

- **at rest** it is sealed here (:class:`Sealer`: AES-GCM, a fresh 96-bit nonce each time, the
  namespace and the name as associated data) under the server key ``secrets``, which the store's
  ``server_key`` accessor keeps outside the secrets table; the table holds sealed bytes only;
- **on the wire to a task** only for the call that asked for it, while its attempt runs:
  ``POST /v1/daemon/secrets`` answers the worker holding that attempt's lease (rule "own
  lease") or the task's own credential (rule "own descendants", its own invocation only; 401 once
  the attempt ended), and no other token kind (an admin may set, list and remove secrets, not read
  them);
- **never** in the Envelope, the invocation's row (``run_config.secrets`` holds names), ``lakeshore
  show``, the ops routes, the dashboard, or nymph's logs;
- listing answers names and times; another namespace's secret answers 404 as an unknown one does;
  a submit naming a secret its namespace lacks is refused (400 naming it) before it is stored.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import runenv
from dreamlake.lakeshore.server import authz, http, tasks
from dreamlake.lakeshore.server.http import HTTPError, field

if TYPE_CHECKING:
    from dreamlake.lakeshore.server.authz import Caller
    from dreamlake.lakeshore.server.context import Context

log = logging.getLogger(__name__)

KEY_NAME = "secrets"  # the server key that seals them (store.server_key)
MAX_VALUE_BYTES = 64 * 1024
MAX_PER_NAMESPACE = 1000
_VERSION = b"\x01"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class Sealer:
    """Seals and opens secret values under one 32-byte key (AES-256-GCM)."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if len(key) != 32:
            raise ValueError("the secrets key must hold 32 bytes")
        self._aead = AESGCM(key)

    @staticmethod
    def _aad(namespace: str, name: str) -> bytes:
        return f"lakeshore-secret\0{namespace}\0{name}".encode()

    def seal(self, namespace: str, name: str, value: str) -> bytes:
        nonce = os.urandom(12)
        return _VERSION + nonce + self._aead.encrypt(nonce, value.encode(), self._aad(namespace, name))

    def open(self, namespace: str, name: str, sealed: bytes) -> str:
        from cryptography.exceptions import InvalidTag

        if sealed[:1] != _VERSION or len(sealed) < 13 + 16:
            raise ValueError(f"secret {name!r} of namespace {namespace!r} is not sealed as this server seals")
        try:
            return self._aead.decrypt(sealed[1:13], sealed[13:], self._aad(namespace, name)).decode()
        except InvalidTag:
            raise ValueError(
                f"secret {name!r} of namespace {namespace!r} does not open under this server's key "
                "(the key changed, or the row was altered): set it again"
            ) from None


async def _sealer(ctx: Context) -> Sealer:
    if ctx.secret_sealer is None:  # one per process, under the key every replica shares
        ctx.secret_sealer = Sealer(await ctx.call(ctx.store.server_key, KEY_NAME))
    sealer: Sealer = ctx.secret_sealer
    return sealer


def check_name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value.startswith("LAKESHORE_"):
        raise HTTPError(
            400,
            f"secret name {str(value)[:80]!r} is not a variable name of at most 128 letters, digits and _ "
            "(not starting with a digit or LAKESHORE_): it becomes one in the task",
        )
    try:  # nor one no call may ask for (PYTHONPATH, LD_PRELOAD, ...: dreamlake.lakeshore.runenv)
        runenv.secret_names([value], "secret name")
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None
    return value


# --- the namespace routes (JSON) --------------------------------------------------------------------


async def put(ctx: Context, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    name = check_name(name)
    value = field(body, "value", str)
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise HTTPError(413, f"a secret holds at most {MAX_VALUE_BYTES} bytes")
    known = await ctx.call(ctx.store.secret_names, namespace)
    if len(known) >= MAX_PER_NAMESPACE and name not in {n for n, _ in known}:
        raise HTTPError(409, f"namespace {namespace!r} has {len(known)} secrets, the most it may hold")
    sealed = (await _sealer(ctx)).seal(namespace, name, value)
    await ctx.call(ctx.store.put_secret, namespace, name, sealed)
    log.info("secret %s of namespace %s set", name, namespace)  # its name only, never its value
    return {"ok": True, "name": name}


async def listing(ctx: Context, namespace: str) -> dict[str, Any]:
    rows = await ctx.call(ctx.store.secret_names, namespace)
    return {"secrets": [{"name": n, "updated_at": at} for n, at in rows]}


async def delete(ctx: Context, namespace: str, name: str) -> dict[str, Any]:
    name = check_name(name)
    if not await ctx.call(ctx.store.delete_secret, namespace, name):
        raise HTTPError(404, f"no secret {name!r} in namespace {namespace!r}")
    log.info("secret %s of namespace %s removed", name, namespace)
    return {"ok": True}


# --- a submit names only secrets its namespace has -------------------------------------------------


async def missing(ctx: Context, namespace: str, run_configs: Iterable[dict[str, Any]]) -> set[str]:
    """The secrets the ``run_config.secrets`` of these submits ask for that ``namespace`` lacks
    (their shape was checked with the run_config): one read for a whole batch."""
    wanted: set[str] = set()
    for rc in run_configs:
        names = rc.get("secrets")
        if names:
            wanted.update(names)
    if not wanted:
        return set()
    have = await ctx.call(ctx.store.sealed_secrets, namespace, wanted)
    return wanted - set(have)


def unknown_secret(namespace: str, run_config: dict[str, Any], missing: set[str]) -> HTTPError | None:
    """The 400 of a submit whose ``run_config.secrets`` names one of ``missing``; None when none."""
    names = [n for n in run_config.get("secrets") or () if n in missing]
    if not names:
        return None
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return HTTPError(
        400,
        f"unknown secret {names[0]!r} in namespace {namespace!r}{more}: set it with "
        f"`lakeshore secret set {names[0]} ...`, or drop it from secrets=[...]",
    )


# --- the values, for the task of a running attempt ----------------------------------------------


async def fetch(ctx: Context, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/daemon/secrets``: ``{invocation_id, attempt[, worker_id]}`` -> ``{secrets:
    {name: value}}``, the secrets that invocation's ``run_config.secrets`` names."""
    invocation_id = http.ulid_field(body, "invocation_id")
    assert invocation_id is not None
    attempt = http.integer(body, "attempt", hi=http.I32_MAX)
    if caller.rule is authz.Own.DESCENDANTS:  # a task: its own invocation, while its attempt runs
        inv = await tasks.live(ctx, caller.principal)
        if inv.invocation_id != invocation_id or inv.attempt != attempt:
            raise HTTPError(
                caller.route.outside or 403,
                f"a task token reads the secrets of its own invocation {inv.invocation_id} "
                f"(attempt {inv.attempt}) only, not of {invocation_id} (attempt {attempt})",
            )
    else:
        worker_id = http.ulid_field(body, "worker_id")
        assert worker_id is not None
        await ctx.workers.check(caller, worker_id)
        found = await ctx.call(ctx.store.get, invocation_id)
        if found is None:
            raise HTTPError(404, f"unknown invocation '{invocation_id}'")
        inv = found
        if inv.worker_id != worker_id:
            raise HTTPError(403, f"worker {worker_id} does not hold invocation {invocation_id}")
        if inv.state != "running" or inv.attempt != attempt:
            raise HTTPError(
                409, f"attempt {attempt} of invocation {invocation_id} is not running (superseded or ended)"
            )
    names = list((inv.run_config or {}).get("secrets") or [])
    sealed = await ctx.call(ctx.store.sealed_secrets, inv.namespace, names)
    sealer = await _sealer(ctx)
    out = {}
    for name in names:
        if name not in sealed:
            raise HTTPError(
                404,
                f"secret {name!r} of namespace {inv.namespace!r} was removed after invocation "
                f"{invocation_id} was submitted: set it again",
            )
        try:
            out[name] = sealer.open(inv.namespace, name, sealed[name])
        except ValueError as exc:
            raise HTTPError(500, str(exc)) from None
    return {"secrets": out}
