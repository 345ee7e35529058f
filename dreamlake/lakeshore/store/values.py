"""Pure rules that turn a Submit's loose fields into row values (seed 000, "Submit"), and the check
both planes run on a Submit before it reaches the store.

:func:`check_run_config` refuses (``PlaneError``, status 400, naming the field and the accepted
range) the run_config values that would otherwise be bent into shape below or run as given:
``priority`` not a finite number in -2^53..2^53, ``max_attempts`` not a whole number in 1..100,
``timeout_s`` not a finite number of seconds in (0, 30 days], ``resources`` not a map of at most
16 names, one that names a resource nymph does not know (every runner fails such a call with a
``ResourceError`` before it runs), or one whose ``cpus`` (``cpu``),
``memory``, ``shm``, ``pids`` or ``gpus`` (``nvidia.com/gpu``) nymph would refuse (read by
``resourcevalues``, nymph's own parsers: a positive limit, 0 refused rather than read as "no
limit"; a GPU count from 0, as ``gpucount`` says, in its words) or that names one field twice. The store
itself stays lenient, as the seed asks:

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
from collections.abc import Callable
from typing import Any

from dreamlake.lakeshore import resourcevalues, runenv
from dreamlake.lakeshore.errors import PlaneError

from . import retry
from .api import DEFAULT_MAX_ATTEMPTS, SubmitRequest
from .direct import JSONText

MAX_ATTEMPTS_CAP = 100
MAX_TIMEOUT_S = 30 * 86400.0
PRIORITY_BOUND = 2**53  # priorities are exact in a float (msgpack, JSON) up to here
MAX_RESOURCES = 16
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


def _bad(what: str, accepted: str, value: Any) -> PlaneError:
    return PlaneError(f"{what} must be {accepted}, got {value!r:.60}", status=400)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_timeout(value: Any, what: str = "run_config.timeout_s") -> float | None:
    """``value`` as seconds when it is None or a finite number in (0, MAX_TIMEOUT_S]; else 400."""
    if value is None:
        return None
    if not _number(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise _bad(what, f"a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} (30 days)", value)
    return float(value)


def check_max_attempts(value: Any, what: str = "run_config.max_attempts") -> int | None:
    """``value`` when it is None or a whole number in 1..MAX_ATTEMPTS_CAP; else 400."""
    if value is None:
        return None
    if not _number(value) or value != int(value) or not 1 <= value <= MAX_ATTEMPTS_CAP:
        raise _bad(what, f"a whole number from 1 to {MAX_ATTEMPTS_CAP}", value)
    return int(value)


def check_run_config(run_config: dict[str, Any]) -> None:
    """Refuse a Submit's run_config whose limits are out of range (see the module docstring)."""
    priority = run_config.get("priority")
    if priority is not None and (not _number(priority) or abs(priority) > PRIORITY_BOUND):
        raise _bad(
            "run_config.priority", f"a finite number from -{PRIORITY_BOUND} to {PRIORITY_BOUND}", priority
        )
    check_max_attempts(run_config.get("max_attempts"))
    check_timeout(run_config.get("timeout_s"))
    retry.check(run_config)  # retry_on and backoff_s
    _check_environment(run_config)
    resources = run_config.get("resources")
    if resources is None:
        return
    if not isinstance(resources, dict) or len(resources) > MAX_RESOURCES:
        raise _bad(
            "run_config.resources",
            f"a map of at most {MAX_RESOURCES} limits such as {{'cpus': 2}}",
            resources,
        )
    seen: dict[str, str] = {}  # a field -> the name it was given by (its own, or an alias)
    for name, limit in resources.items():
        what = f"run_config.resources.{str(name)[:40]}"
        if not isinstance(name, str) or not name:
            raise _bad("run_config.resources", "a map with string keys", resources)
        field = resourcevalues.ALIASES.get(name, name)
        if field in seen:
            raise PlaneError(
                f"run_config.resources.{field} is given twice (as {seen[field]!r} and {name!r}): give it once",
                status=400,
            )
        seen[field] = name
        if field not in resourcevalues.PARSERS:  # nymph refuses the call, on every runner
            raise PlaneError(
                f"{what} is not a resource nymph knows: use {', '.join(resourcevalues.FIELDS)} "
                f"(aliases: {', '.join(resourcevalues.ALIASES)})",
                status=400,
            )
        if resourcevalues.PARSERS[field](limit) is None:  # refused as nymph would, in its words
            raise _bad(what, resourcevalues.EXPECTED[field], limit)  # (a GPU count's: gpucount.EXPECTED)


def _check_environment(run_config: dict[str, Any]) -> None:
    """``env``, ``secrets`` and ``mounts`` (docs/nymph.md "Environments") of the right shape."""
    try:
        runenv.user_env(run_config.get("env"))
        runenv.secret_names(run_config.get("secrets"))
        runenv.mount_names(run_config.get("mounts"))
    except ValueError as exc:
        raise PlaneError(str(exc), status=400) from None


def _encoder(**options: Any) -> Callable[[Any], str]:
    """``json.dumps(value, allow_nan=False, **options)``, made once. ``JSONEncoder.encode`` builds
    its C encoder anew on every call, half the time of a small map's encode (a submit encodes four:
    its three JSON columns and its content hash's canonical form; 2.6 -> 1.2 us each here). With
    CPython's C accelerator (``json.encoder.c_make_encoder``, which ``JSONEncoder`` itself uses)
    that encoder is made here once; without it, ``encode`` as before. It is made without the
    circular-reference check (its marks would outlive a failed encode): a value that holds itself
    recurses to a RecursionError, which ``json_encoded`` met all the same (its ``fix`` recursed on
    the ValueError), so its callers do."""
    plain = json.JSONEncoder(allow_nan=False, **options)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # (an interpreter without CPython's _json)
        return plain.encode
    c = make(
        None,
        plain.default,
        json.encoder.encode_basestring_ascii,
        None,
        plain.key_separator,
        plain.item_separator,
        plain.sort_keys,
        plain.skipkeys,
        plain.allow_nan,
    )

    def encode(value: Any) -> str:
        return "".join(c(value, 0))

    return encode


_ENCODE = _encoder()
_CANONICAL = _encoder(sort_keys=True, separators=(",", ":"))


def json_safe(value: Any, what: str) -> Any:
    """``value`` with non-finite floats spelled as strings; PlaneError(400) if not JSON data."""
    return json_encoded(value, what)[0]


def json_encoded(value: Any, what: str) -> tuple[Any, JSONText]:
    """:func:`json_safe`'s value and its JSON text (``json.dumps``'s, as the store's JSON column
    would write it: the check's own encoding, kept so the row is not encoded again).

    Most values have no non-finite float: one encoding (in C) says so, and they are returned as
    they are; the walk that spells them runs only for a value the encoder refused."""
    try:
        return value, JSONText(_ENCODE(value))
    except (TypeError, ValueError):
        pass

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
        text = json.dumps(fixed, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PlaneError(
            f"{what} must hold JSON data only (str, int, float, bool, None, list, dict with str keys): {exc}",
            status=400,
        ) from exc
    return fixed, JSONText(text)


def canonical(value: Any) -> str:
    return _CANONICAL(value)


_FUNCTION_KEYS: dict[str, str] = {}  # a function's JSON text -> its key (a sweep submits one function)
_FUNCTION_KEYS_MAX = 1024


def function_key(function: dict[str, Any], text: str | None = None) -> str:
    """The sha256 of ``function``'s canonical JSON; with ``text`` (its :func:`json_encoded` text:
    one text is one value, so one key) remembered for the next submit of the same function."""
    if text is None:
        return hashlib.sha256(canonical(function).encode()).hexdigest()
    key = _FUNCTION_KEYS.get(text)
    if key is None:
        if len(_FUNCTION_KEYS) >= _FUNCTION_KEYS_MAX:
            _FUNCTION_KEYS.clear()
        key = _FUNCTION_KEYS[text] = hashlib.sha256(canonical(function).encode()).hexdigest()
    return key


def content_hash(req: SubmitRequest, queue: str, run_config: dict[str, Any]) -> str:
    """What makes two submits of one invocation_id the same submit."""
    h = hashlib.sha256()
    head = [queue, req.function, run_config, req.code_context, req.parent_invocation_id, req.namespace]
    h.update(canonical(head).encode())
    h.update(b"\0")
    h.update(req.args_blob)
    if req.args_ref is not None:  # the same Envelope by reference: its key and sha256 decide
        h.update(b"\0ref\0" + canonical(req.args_ref).encode())
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
