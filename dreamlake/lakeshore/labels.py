"""The one rule for a placement label: a nymph's ``--label name=value`` and a call's ``selector``.

nymph reads ``--label name=value`` (and ``NYMPH_LABEL``, a config file's ``labels``) by splitting
at the first ``=`` and stripping each side, so no label it holds has an ``=`` in its name, or a
space at either end; a control character or line break in one is a mistake (and would be written
raw into a log line). A selector entry of that kind could never match a label: the call would
wait ``queued`` for ever. So the SDK (at decoration and per call, ValueError), the control plane
(at submit, 400) and nymph (at start, for its own labels, ConfigError) all refuse by
:func:`label_problem`: a name is 1 to :data:`MAX_LABEL` printable characters (``str.isprintable``: no
control characters, line breaks or format characters) without ``=`` and without a space at either
end, a value the same but for ``=``, which it may hold.

Part of the entry bundle (the SDK's ``calls`` imports it): importable on Python 3.9, with nothing
but builtins.
"""

from __future__ import annotations

__all__ = ["MAX_LABEL", "RULE", "label_problem", "label_shown"]

MAX_LABEL = 128  # characters of a label's name or value
RULE = (
    f"a label name is 1 to {MAX_LABEL} printable characters (no control characters or line breaks) "
    "without '=' and without a space at either end, and a value likewise ('=' allowed), as nymph's "
    "--label name=value gives them"
)


def _fits(text: object) -> bool:
    return (
        isinstance(text, str) and 0 < len(text) <= MAX_LABEL and text.isprintable() and text == text.strip()
    )


def label_problem(name: object, value: object, where: str) -> str | None:
    """None when ``name``: ``value`` is a label a nymph can have; else the refusal, naming the
    entry of ``where`` (``run_config.selector``, ``selector``, ``labels``) and :data:`RULE`."""
    if _fits(name) and _fits(value) and "=" not in str(name):
        return None
    return f"{where} entry {label_shown(name, value)} is not a label a nymph can have: {RULE}"


def label_shown(name: object, value: object) -> str:
    """``name=value`` for a log line or a message: as it is when both are plain label text, else
    each as its ``repr`` (a newline or a control character written as an escape, never raw)."""
    if _fits(name) and _fits(value) and "=" not in str(name):
        return f"{name}={value}"
    return f"{name!r:.60}={value!r:.60}"
