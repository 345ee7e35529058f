"""The code archive an invocation shipped (``cfg["code"]`` of its envelope), for its job.

:func:`acquire` fetches it once per sha256 into nymph's code cache (:mod:`nymph.codecache`; by
reference through the presign route of the namespace it was uploaded to, :func:`fetch_ref`) and
holds it while the task runs; a corrupt or unsafe archive, or one shipping a module the
``--allow-module`` policy refuses (:func:`nymph.gates.shipped_refusal`), refuses the invocation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dreamlake.lakeshore import blobs
from dreamlake.lakeshore.client import retrying
from dreamlake.lakeshore.errors import LakeshoreError, PayloadCorrupt
from nymph import codecache, gates
from nymph.config import NymphConfig
from nymph.errors import GateRefused
from nymph.lifecycle import JobContext

FETCH_ATTEMPTS = 4  # a code archive by reference: tries of the fetch while the store is unreachable


def cache_of(cfg: NymphConfig) -> codecache.CodeCache:
    return codecache.shared(
        cfg.code_cache_dir, max_bytes=cfg.code_cache_max_bytes, max_age_s=cfg.code_cache_max_age_s
    )


def acquire(ctx: JobContext, code: dict[str, Any]) -> Path:
    """The unpacked archive, held in the cache under ``code["sha256"]`` (the caller releases it);
    GateRefused (and nothing held) when it cannot be used."""
    cache = cache_of(ctx.config)
    try:
        path = cache.acquire(code, fetch=lambda ref: fetch_ref(ctx, code, ref))
    except codecache.CodeArchiveError as exc:
        raise GateRefused("CodeArchiveRefused", str(exc)) from exc
    except OSError as exc:
        raise GateRefused(
            "CodeArchiveRefused", f"code archive: cannot unpack into {cache.root}: {exc}"
        ) from exc
    patterns = list(ctx.config.allow_modules)
    if patterns:  # the policy sees the shipped code: every module it ships must be allowed
        refusal = gates.shipped_refusal(path, patterns)
        if refusal is not None:
            cache.release(str(code["sha256"]))
            raise refusal
    return path


def fetch_ref(ctx: JobContext, code: dict[str, Any], ref: Any) -> bytes:
    """An archive shipped by reference, through the presign route of the namespace it was
    uploaded to (``dreamlake.lakeshore.blobs``: size and sha256 checked on the way)."""
    client = ctx.client
    if client is None:
        raise codecache.CodeArchiveError("code archive by reference: this nymph has no control-plane client")
    namespace = str(code.get("namespace") or ctx.config.namespace or "default")
    try:  # a control plane or store away for a moment costs a few retries, not the invocation
        policy = retrying(attempts=FETCH_ATTEMPTS, initial_s=0.5)
        data = policy(blobs.get, client, namespace, dict(ref), limit=codecache.MAX_FETCH_BYTES)
    except PayloadCorrupt as exc:
        raise codecache.CodeArchiveError(f"code archive: {exc}") from exc
    except LakeshoreError as exc:
        raise codecache.CodeArchiveError(
            f"code archive: cannot fetch {ref.get('key')!r} from the payload store: {exc}"
        ) from exc
    assert data is not None
    return bytes(data)
