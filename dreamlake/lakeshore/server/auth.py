"""Bearer-token authentication: who is calling (401). What they may do is ``authz``'s table."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request

from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.store.api import Principal

log = logging.getLogger(__name__)

_CACHE_TTL_S = 30.0
_CACHE_MAX = 4096


class Authenticator:
    """Resolves ``Authorization: Bearer <token>`` to a Principal, with a short positive cache."""

    def __init__(self, verify: Callable[[str], Awaitable[Principal | None]]) -> None:
        self._verify = verify
        self._cache: dict[str, tuple[float, Principal]] = {}

    async def principal(self, request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise HTTPError(
                401,
                "missing bearer token: send 'Authorization: Bearer <token>' "
                "(lakeshore token create --kind KIND --name NAME mints one)",
            )
        found = await self.verify(secret)
        if found is None:
            raise HTTPError(
                401,
                "unknown token: check the token, or mint one with "
                "'lakeshore token create --kind KIND --name NAME'",
            )
        return found

    async def verify(self, secret: str) -> Principal | None:
        """The principal of a token secret (from a header or the dashboard's cookie); None if unknown."""
        digest = hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        found = await self._verify(secret) if 0 < len(secret) <= 256 else None
        if found is None:
            return None
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[digest] = (now + _CACHE_TTL_S, found)
        return found
