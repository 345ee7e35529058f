"""Text from tasks and tenants made safe for an operator's terminal.

A task's output, an error message, a worker's hostname: any of it may hold terminal control
sequences (OSC 52 writes the clipboard, CSI clears the screen or moves the cursor, OSC 8 makes a
link whose text lies about its target). :func:`escape` shows every C0 and C1 control character
but newline and tab, DEL, and the Unicode controls that reorder or break text (bidi overrides and
isolates, line and paragraph separators) as a visible ``\\xNN`` / ``\\uNNNN`` escape, so nothing
a tenant wrote can drive the terminal. ``lakeshore logs``, ``stream``, ``show`` and ``ls`` apply it
when they write to a terminal (:func:`for_terminal`); ``--raw`` keeps the bytes.
"""

from __future__ import annotations

import re
from typing import IO

# C0 but \t and \n; \r (it rewrites the line); DEL; C1; bidi embedding/override/isolate; LS/PS
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _show(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with its control characters (see the module docstring) shown as escapes; a
    ``\\r\\n`` line end is kept as ``\\n``."""
    text = text.replace("\r\n", "\n")
    return _UNSAFE.sub(_show, text)


def for_terminal(text: str, stream: IO[str], *, raw: bool = False) -> str:
    """``text`` escaped when ``stream`` is a terminal (and not ``raw``); as it is otherwise (a
    pipe or a file gets the bytes the task wrote)."""
    if raw:
        return text
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return escape(text) if tty else text
