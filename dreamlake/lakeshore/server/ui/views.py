"""What the dashboard shows of an invocation's arguments and result, and of a sweep's progress.

Arguments and result are shown decoded when they are plain values (numbers, strings, lists, maps:
what msgpack alone reads), size-capped: a blob over ``SHOWN_BYTES`` shows its size only, a preview
over ``PREVIEW_CHARS`` is cut. Nothing is decoded with the wire codec: an extension value (an
array, a tensor, an image) shows as ``<ext N: size>``, and nothing it names is imported. Payloads
stored by reference (seed 003) show where they are and their size; the dashboard never fetches them.
"""

from __future__ import annotations

from typing import Any

import msgpack

from dreamlake.lakeshore.store.activity import Sweep
from dreamlake.lakeshore.store.api import Invocation

SHOWN_BYTES = 64 * 1024
PREVIEW_CHARS = 4000


def preview(body: bytes) -> tuple[str, bool]:
    """``(text, plain)``: a msgpack value as Python would print it, cut at ``PREVIEW_CHARS``;
    ``plain`` False when it held an extension value or could not be read."""
    plain = True

    def ext(code: int, data: bytes) -> str:
        nonlocal plain
        plain = False
        return f"<ext {code}: {len(data)} bytes>"

    try:
        value = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            ext_hook=ext,
            max_str_len=SHOWN_BYTES,
            max_bin_len=SHOWN_BYTES,
        )
    except Exception:
        return f"<{len(body)} bytes, not a plain value>", False
    text = repr(value)
    if len(text) > PREVIEW_CHARS:
        text = text[:PREVIEW_CHARS] + f" … ({len(text) - PREVIEW_CHARS} more characters)"
    return text, plain


def _blob(body: bytes | None, ref: dict[str, Any] | None) -> dict[str, Any] | None:
    if ref:
        size = ref.get("size")
        return {"text": f"stored by reference ({size} bytes in the payload store)", "plain": False}
    if body is None or len(body) == 0:
        return None
    if len(body) > SHOWN_BYTES:
        return {"text": f"{len(body)} bytes (over {SHOWN_BYTES // 1024} KiB: not shown)", "plain": False}
    text, plain = preview(body)
    return {"text": text, "plain": plain}


def arguments(inv: Invocation) -> dict[str, Any] | None:
    """``{args, kwargs}`` previews of the Envelope's arguments, or a size / reference note."""
    if inv.args_ref:
        return {"note": _blob(None, inv.args_ref)["text"]}  # type: ignore[index]
    if len(inv.args_blob) > SHOWN_BYTES:
        return {"note": f"{len(inv.args_blob)} bytes (over {SHOWN_BYTES // 1024} KiB: not shown)"}
    from dreamlake.lakeshore.envelope import Envelope

    try:
        env = Envelope.from_bytes(inv.args_blob)
    except Exception:
        return None  # not an Envelope (a raw wire submit): nothing to decode
    return {"args": _blob(bytes(env.args), None), "kwargs": _blob(bytes(env.kwargs), None)}


def result(inv: Invocation) -> dict[str, Any] | None:
    return _blob(inv.result_blob, inv.result_ref)


def sweep_view(s: Sweep) -> dict[str, Any]:
    """A sweep's row: its counts by outcome and how much of it has finished."""
    total = max(1, s.total)
    failed = sum(s.counts.get(k, 0) for k in ("failed", "killed", "timeout", "cancelled"))
    done = s.counts.get("succeeded", 0)
    running = s.counts.get("running", 0)
    return {
        "sweep": s.sweep,
        "queue": s.queue,
        "total": s.total,
        "done": done,
        "failed": failed,
        "running": running,
        "queued": s.counts.get("queued", 0),
        "finished": done + failed,
        "first_submitted_at": s.first_submitted_at,
        "percent": round(100.0 * (done + failed) / total),
    }
