"""Pure rules that turn a Submit's loose fields into row values (seed 000, "Submit").

- ``priority``: ints as given; floats truncated toward zero; bools, non-numbers, NaN and
  infinities become 0; clamped to the signed 64-bit range the column holds.
- ``max_attempts``: ``run_config.max_attempts`` as an int clamped to 1..100; absent or unusable -> 3.
- ``run_config`` is stored as JSON; non-finite floats in it (JSON has none) are stored as the
  strings ``"nan"``, ``"inf"``, ``"-inf"``.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from dreamlake.lakeshore.errors import PlaneError

from .api import DEFAULT_MAX_ATTEMPTS, SubmitRequest

MAX_ATTEMPTS_CAP = 100
MAX_KEY_LEN = 1024  # the idempotency_key column: PostgreSQL refuses longer, SQLite would not
_I64 = 2**63 - 1


def normalize_priority(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, float):
        if not math.isfinite(value):
            return 0
        value = math.trunc(value)
    return max(-_I64, min(_I64, int(value)))


def normalize_max_attempts(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return DEFAULT_MAX_ATTEMPTS
    if isinstance(value, float):
        if not math.isfinite(value):
            return DEFAULT_MAX_ATTEMPTS
        value = math.trunc(value)
    return max(1, min(MAX_ATTEMPTS_CAP, int(value)))


def json_safe(value: Any, what: str) -> Any:
    """``value`` with non-finite floats spelled as strings; PlaneError(400) if not JSON data."""

    def fix(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        return v

    fixed = fix(value)
    try:
        json.dumps(fixed, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PlaneError(
            f"{what} must hold JSON data only (str, int, float, bool, None, list, dict with str keys): {exc}",
            status=400,
        ) from exc
    return fixed


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def function_key(function: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(function).encode()).hexdigest()


def content_hash(req: SubmitRequest, queue: str, run_config: dict[str, Any]) -> str:
    """What makes two submits of one invocation_id the same submit."""
    h = hashlib.sha256()
    head = [queue, req.function, run_config, req.code_context, req.parent_invocation_id, req.namespace]
    h.update(canonical(head).encode())
    h.update(b"\0")
    h.update(req.args_blob)
    return h.hexdigest()


def idempotency_key(run_config: dict[str, Any]) -> str | None:
    key = run_config.get("key")
    if key is None or key == "":
        return None
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise PlaneError(f"run_config.key must be a string, got {type(key).__name__}", status=400)
    key = str(key)
    if len(key) > MAX_KEY_LEN:
        raise PlaneError(
            f"run_config.key is {len(key)} characters long; the limit is {MAX_KEY_LEN} "
            "(hash a longer key client-side)",
            status=400,
        )
    return key
