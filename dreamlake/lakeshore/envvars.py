"""Whole-number settings from the environment, parsed one way (the SDK and the control plane).

:func:`env_int` is the one integer-from-environment parser: empty or unset means the default, a
value that is not a whole number or is below its minimum is a ``ValueError`` that names the
variable and what to set. A setting renamed keeps its old name as a deprecated alias: read when the
new one is unset, with a ``FutureWarning`` naming the new one.

The inline threshold (seed 003) has one name, ``INLINE_THRESHOLD_BYTES``, on the control plane and
in the SDK (HTTP submits and code archives alike); ``LAKESHORE_INLINE_THRESHOLD_BYTES`` (what code
archives read before) is its deprecated alias.

Part of the entry bundle (a task's ``.submit()`` reads the threshold), so it runs on Python 3.9.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence

INLINE_THRESHOLD_ENV = "INLINE_THRESHOLD_BYTES"
INLINE_THRESHOLD_ALIASES = ("LAKESHORE_INLINE_THRESHOLD_BYTES",)  # deprecated
DEFAULT_INLINE_THRESHOLD_BYTES = 256 * 1024  # seed 003


def env_int(
    name: str,
    default: int,
    *,
    minimum: int = 0,
    env: Mapping[str, str] | None = None,
    aliases: Sequence[str] = (),
) -> int:
    """``$name`` as an int (``default`` when unset or empty); ValueError saying what to set when it
    is not a whole number or is below ``minimum``. ``aliases``: deprecated names, read (with a
    FutureWarning) when ``name`` is unset."""
    env = os.environ if env is None else env
    used, raw = name, (env.get(name) or "").strip()
    if not raw:
        for alias in aliases:
            found = (env.get(alias) or "").strip()
            if found:
                warnings.warn(f"{alias} is deprecated: set {name} instead", FutureWarning, stacklevel=2)
                used, raw = alias, found
                break
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{used}={raw!r} is not a whole number: set it to one, or unset it") from None
    if value < minimum:
        raise ValueError(f"{used}={value} is below {minimum}: set it to at least {minimum}, or unset it")
    return value


def inline_threshold(env: Mapping[str, str] | None = None) -> int:
    """``INLINE_THRESHOLD_BYTES`` (bytes; its deprecated alias too), else 256 KiB."""
    return env_int(
        INLINE_THRESHOLD_ENV, DEFAULT_INLINE_THRESHOLD_BYTES, env=env, aliases=INLINE_THRESHOLD_ALIASES
    )
