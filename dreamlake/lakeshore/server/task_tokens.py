"""Task tokens: the credential nymph hands each invocation, so that a task can submit tasks.

The poll answer's run command carries ``task_token``; nymph puts it in the task's environment as
``LAKESHORE_TOKEN`` beside ``LAKESHORE_URL`` (docs/protocol.md "Task tokens"). The token is
stateless: ``lst_`` + base64url(msgpack ``[1, invocation_id, attempt, namespace, expires_at]``) +
``.`` + base64url(HMAC-SHA256 of that payload), under a key every replica shares
(``store.server_key("task-token")``). Minting it costs the claim nothing; verifying it costs one
HMAC, then one read of the invocation.

What a token may do (the ``task`` rows of the auth table) is checked in ``server/tasks.py``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import msgpack

from dreamlake.lakeshore.store.api import Invocation, Principal

PREFIX = "lst_"
KEY_NAME = "task-token"
_VERSION = 1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TaskTokens:
    """Mints and verifies task tokens under one HMAC key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("the task-token key must hold at least 32 bytes")
        # keyed once; each signature is a copy of it (OpenSSL's HMAC context, in C). Not
        # ``hmac.digest``: its one-shot C call lets go of the GIL for any length of message, so
        # on the event loop every claim (a mint) and every task's request (a verify) waited for
        # the GIL back behind whatever thread took it (the writer's, on PostgreSQL): 37 us a
        # mint on an idle SQLite server, over a millisecond behind a busy thread, against 1 us
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)

    def _sign(self, payload: bytes) -> bytes:
        signer = self._keyed.copy()
        signer.update(payload)
        return signer.digest()

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
