"""The limits the control plane decides, as the client side knows them, and the by-reference rule.

The control plane says its limits in its register answer (``limits``, a daemon) and at
``GET /v1/ops/info`` (any token): :class:`ServerLimits` reads either. Its defaults are what a
control plane that says nothing (an older one) is taken to allow; they are the only client-side
definitions of these numbers. A client may ask for less (a submit batch of 500 calls, not the
server's 1,000), never for more.

:func:`by_reference` is the one rule for what goes by reference (seed 003, docs/protocol.md
"Payload refs"): a payload over the inline threshold, where there is a threshold (None: the
control plane has no payload store, everything stays inline). ``HttpDispatch`` (arguments,
results, frame bodies), ``codeship`` (code archives) and nymph (results, frame bodies) all ask it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from dreamlake.lakeshore import envvars

__all__ = ["DEFAULT_INLINE_THRESHOLD", "ServerLimits", "by_reference", "inline_threshold_from_env"]

DEFAULT_INLINE_THRESHOLD = envvars.DEFAULT_INLINE_THRESHOLD_BYTES  # seed 003: 256 KiB


def by_reference(size: int, threshold: int | None) -> bool:
    """Whether a payload of ``size`` bytes goes by reference under ``threshold`` (None: never)."""
    return threshold is not None and size > threshold


def inline_threshold_from_env() -> int:
    """``INLINE_THRESHOLD_BYTES`` of this process (the SDK's side of seed 003's knob), else 256 KiB."""
    return envvars.inline_threshold()


@dataclass(frozen=True)
class ServerLimits:
    """What one control plane allows (``GET /v1/ops/info``'s ``limits``, the register answer's)."""

    acks_per_poll: int = 256  # acks one poll carries at most
    inline_threshold_bytes: int | None = DEFAULT_INLINE_THRESHOLD  # None: no payload store
    submit_batch_max: int = 1000  # calls one submit-batch request holds at most
    max_body_bytes: int = 110 * 1024 * 1024  # one request's body at most
    await_batch_max: int = 1000  # ids one await-batch request asks for at most
    poll_max_commands: int = 64  # commands one poll hands out at most
    result_chunks_max: int = 10_000  # frames one result-chunks request carries at most
    max_payload_bytes: int = envvars.DEFAULT_MAX_PAYLOAD_BYTES  # one upload to the payload store at most

    @classmethod
    def from_answer(cls, answer: Any) -> ServerLimits:
        """The limits an answer carries (``{"limits": {...}}``); a field it lacks or gives in a
        form not understood keeps its default. A register answer without ``limits`` (an older
        control plane) still says its threshold as ``inline_threshold_bytes``, and that it has no
        payload store by leaving it out."""
        answer = answer if isinstance(answer, dict) else {}
        given = answer.get("limits")
        if not isinstance(given, dict):
            threshold = answer.get("inline_threshold_bytes")
            ok = isinstance(threshold, int) and not isinstance(threshold, bool) and threshold >= 0
            return cls(inline_threshold_bytes=threshold if ok else None)
        out = cls()
        for f in fields(cls):
            if f.name not in given:
                continue
            value = given[f.name]
            if value is None and f.name == "inline_threshold_bytes":
                out = replace(out, inline_threshold_bytes=None)
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out = replace(out, **{f.name: value})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
