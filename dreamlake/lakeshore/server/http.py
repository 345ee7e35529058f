"""Request and response helpers: bounded msgpack/JSON bodies, typed field access, error answers.

Every handler raises :class:`HTTPError` for a client mistake; the app turns it into
``{"error": ...}`` in the route's encoding (msgpack or JSON) with the given status.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgpack
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import InvalidId

MSGPACK = "application/x-msgpack"
MSGPACK_STREAM = "application/x-msgpack-stream"

NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

# Bounds for decoding untrusted msgpack: containers stay small, bins may fill the body.
_MAX_STR = 1024 * 1024
_MAX_CONTAINER = 100_000
_MAX_EXT = 1024 * 1024


class HTTPError(Exception):
    """A client (4xx) or server (5xx) error with the message the answer carries."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes before buffering it all.

    Read from the ASGI messages straight (Starlette's ``Request.stream`` is an async generator
    per request, for the one message a small body comes in); a client gone mid-body raises
    ``ClientDisconnect`` as ``stream`` does."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise HTTPError(
                    413,
                    f"request body of {declared} bytes is over the limit of {limit} bytes "
                    "(LAKESHORE_MAX_BODY_BYTES); send large payloads through the payload store",
                )
        except ValueError:
            raise HTTPError(400, "invalid Content-Length header") from None
    receive = request.receive
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HTTPError(
                413,
                f"request body is over the limit of {limit} bytes "
                "(LAKESHORE_MAX_BODY_BYTES); send large payloads through the payload store",
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def decode_msgpack(data: bytes) -> dict[str, Any]:
    """Decode a msgpack map body with bounds; 400 on garbage, trailing bytes or a non-map."""
    if not data:
        raise HTTPError(400, "empty body: send a msgpack map (Content-Type: application/x-msgpack)")
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            max_bin_len=len(data),
            max_str_len=min(len(data), _MAX_STR),
            max_array_len=_MAX_CONTAINER,
            max_map_len=_MAX_CONTAINER,
            max_ext_len=_MAX_EXT,
        )
    except (
        ValueError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        UnicodeDecodeError,
    ) as exc:
        raise HTTPError(
            400, f"body is not valid msgpack ({type(exc).__name__}): send one msgpack map"
        ) from None
    except Exception as exc:  # msgpack raises a few odd types on hostile input
        raise HTTPError(
            400, f"body is not valid msgpack ({type(exc).__name__}): send one msgpack map"
        ) from None
    if not isinstance(value, dict):
        raise HTTPError(400, f"body must be a msgpack map, got {type(value).__name__}")
    return value


def decode_json(data: bytes) -> dict[str, Any]:
    """Decode a JSON object body; 400 on anything else."""
    if not data:
        raise HTTPError(400, "empty body: send a JSON object (Content-Type: application/json)")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise HTTPError(400, f"body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise HTTPError(400, f"body must be a JSON object, got {type(value).__name__}")
    return value


class MsgpackResponse(Response):
    """``Response(msgpack.packb(value), status, media_type=MSGPACK)``, its two headers made
    straight (the hot routes answer every call with one: ``init_headers`` rebuilds them from
    strings each time)."""

    media_type = MSGPACK

    def __init__(self, value: Any, status_code: int = 200) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body = msgpack.packb(value, use_bin_type=True)
        self.raw_headers = [(b"content-length", b"%d" % len(body)), (b"content-type", _MSGPACK_TYPE)]


_MSGPACK_TYPE = MSGPACK.encode("latin-1")


def msgpack_response(value: Any, status: int = 200) -> Response:
    return MsgpackResponse(value, status)


def json_response(value: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(value, separators=(",", ":")), status_code=status, media_type="application/json"
    )


def error_response(exc: HTTPError, *, as_json: bool) -> Response:
    body = {"error": exc.message, **exc.extra}
    return json_response(body, exc.status) if as_json else msgpack_response(body, exc.status)


JSON_ROUTES = ("/v1/namespaces/", "/v1/ops/", "/v1/blobs/")
TEXT_ROUTES = ("/metrics", "/ui")


def error_encoding(path: str, accept: str) -> str:
    """``json``, ``msgpack`` or ``text``: the JSON routes answer JSON; ``/metrics`` and ``/ui``
    text; a msgpack route msgpack unless the client accepts JSON or text and not msgpack (a
    scraper, curl with ``-H 'Accept: text/plain'``)."""
    if path.startswith(JSON_ROUTES):
        return "json"
    if path.startswith(TEXT_ROUTES):
        return "text"
    accept = accept.lower()
    if not accept or "msgpack" in accept:
        return "msgpack"
    if "application/json" in accept:
        return "json"
    return "text" if "text/" in accept else "msgpack"


def error_answer(request: Request, exc: HTTPError) -> Response:
    """``{"error": ...}`` (plus the error's extra fields) in the encoding the caller reads."""
    encoding = error_encoding(request.url.path, request.headers.get("accept", ""))
    if encoding == "text":
        return Response(f"{exc.message}\n", status_code=exc.status, media_type="text/plain; charset=utf-8")
    return error_response(exc, as_json=encoding == "json")


# -- typed field access ------------------------------------------------------------------------

_MISSING = object()
MISSING: Any = _MISSING  # ``field(..., default=MISSING)``: required after all


def _type_name(value: Any) -> str:
    return type(value).__name__


def field(
    body: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    *,
    default: Any = _MISSING,
    nullable: bool = False,
) -> Any:
    """``body[name]`` checked against ``kind``; 400 naming the field when missing or mistyped."""
    if name not in body or (body[name] is None and default is not _MISSING and not nullable):
        if default is _MISSING:
            raise HTTPError(400, f"missing field '{name}'")
        return default
    value = body[name]
    if value is None and nullable:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; refuse it where a number is asked for.
    if isinstance(value, bool) and bool not in kinds:
        raise HTTPError(400, f"field '{name}' must be {_kinds(kinds)}, got bool")
    if not isinstance(value, kinds):
        raise HTTPError(400, f"field '{name}' must be {_kinds(kinds)}, got {_type_name(value)}")
    return value


# Bounds of a JSON-ish field (run_config, resources, code_context, function, labels): checked at
# decode, so a hostile document fails its own request with a 400 and never reaches the store
# (where a recursive encoder met it in the group commit shared with other tenants' writes).
MAX_DOC_DEPTH = 32
MAX_DOC_BYTES = 256 * 1024


def bound_document(value: Any, what: str, *, depth: int = MAX_DOC_DEPTH, size: int = MAX_DOC_BYTES) -> Any:
    """``value`` when it nests at most ``depth`` containers and weighs at most ``size`` bytes
    (strings, bytes and keys at their length, every other item 8); 400 naming the field (and the
    first-level key where it went too deep) otherwise. Iterative: any depth is safe to check."""
    if isinstance(value, dict) and depth > 0:  # a flat map (most run configs): one pass, no stack
        total = 8
        for key, child in value.items():
            if isinstance(child, (dict, list, tuple)):
                break
            total += (len(key) if isinstance(key, str) else 8) + (
                len(child) if isinstance(child, (str, bytes)) else 8
            )
        else:
            if total <= size:
                return value
    total = 0
    stack: list[tuple[Any, int, str]] = [(value, 0, what)]
    while stack:
        item, level, where = stack.pop()
        if isinstance(item, dict):
            items: Any = item.items()
        elif isinstance(item, (list, tuple)):
            items = enumerate(item)
        else:
            total += len(item) if isinstance(item, (str, bytes)) else 8
            if total > size:
                raise HTTPError(400, f"field '{what}' is over the limit of {size} bytes: send less")
            continue
        if level >= depth:
            raise HTTPError(
                400,
                f"field '{where}' nests deeper than {depth} levels: send a flatter document",
            )
        total += 8
        for key, child in items:
            total += len(key) if isinstance(key, str) else 8
            stack.append((child, level + 1, f"{what}.{key}" if level == 0 else where))
        if total > size:
            raise HTTPError(400, f"field '{what}' is over the limit of {size} bytes: send less")
    return value


def document(body: dict[str, Any], name: str, *, default: Any = _MISSING, nullable: bool = False) -> Any:
    """``field(body, name, dict)`` within the document bounds (:func:`bound_document`)."""
    value = field(body, name, dict, default=default, nullable=nullable)
    return value if value is None else bound_document(value, name)


def _kinds(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def number(body: dict[str, Any], name: str, default: float, *, lo: float, hi: float) -> float:
    """A finite number field clamped to ``[lo, hi]``."""
    value = field(body, name, (int, float), default=default)
    value = float(value)
    if not math.isfinite(value):
        raise HTTPError(400, f"field '{name}' must be a finite number")
    return min(max(value, lo), hi)


I64_MAX = 2**63 - 1  # a BIGINT column (frame seqs)
I32_MAX = 2**31 - 1  # an INTEGER column (attempts)


def integer(body: dict[str, Any], name: str, *, hi: int, default: Any = _MISSING) -> Any:
    """An int field in ``0..hi`` (the column it lands in); 400 naming the field otherwise.

    Without the bound a huge value fails in the database driver (a 500), and differently on
    SQLite and PostgreSQL."""
    value = field(body, name, int, default=default, nullable=default is None)
    if value is not None and not 0 <= value <= hi:
        raise HTTPError(400, f"field '{name}' must be between 0 and {hi}, got {value}")
    return value


def ulid(value: Any, what: str) -> str:
    """Validate an id with :func:`ids.validate`; 400 with its message otherwise."""
    try:
        return ids.validate(value, what)
    except InvalidId as exc:
        raise HTTPError(400, str(exc)) from None


def ulid_field(body: dict[str, Any], name: str, *, optional: bool = False) -> str | None:
    if optional and body.get(name) in (None, ""):
        return None
    if name not in body:
        raise HTTPError(400, f"missing field '{name}'")
    return ulid(body[name], name)


def name(value: Any, what: str) -> str:
    """A queue, topic or namespace name: ``[A-Za-z0-9._-]{1,128}``."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        shown = repr(value)[:60]
        raise HTTPError(400, f"invalid {what} {shown}: expected 1-128 characters of [A-Za-z0-9._-]")
    return value


def query_number(request: Request, key: str, default: float, *, lo: float, hi: float) -> float:
    raw = request.query_params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise HTTPError(400, f"query parameter '{key}' must be a number, got {raw[:40]!r}") from None
    if not math.isfinite(value):
        raise HTTPError(400, f"query parameter '{key}' must be a finite number")
    return min(max(value, lo), hi)


def query_int(request: Request, key: str, default: int) -> int:
    raw = request.query_params.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise HTTPError(400, f"query parameter '{key}' must be an integer, got {raw[:40]!r}") from None
