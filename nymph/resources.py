"""Reading ``run_config.resources`` values the same way in every runner that enforces limits.

The docker, gvisor, kube and slurm runners each turn ``resources`` into their own form (docker SDK
keywords, a pod's requests and limits, sbatch options); the values they read are the same, so they
are parsed here once:

- :func:`parse_size`: bytes (at least one) from a number or a string with an optional binary unit
  (``1024``, ``512m``, ``1g``, ``2GiB``, ``512Mi``); ``k``/``m``/``g``/``t`` are powers of 1024.

Every error is a :class:`~nymph.runner.RunnerError` that names the field and the value, so the
invocation is acked ``failed`` with a message the producer can act on.
"""

from __future__ import annotations

import re
from typing import Any

from nymph.runner import RunnerError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value: Any, what: str) -> int:
    """Bytes from a positive int/float or a string such as ``512m``, ``1g``, ``2GiB``, ``512Mi``."""
    if not isinstance(value, bool):
        if isinstance(value, int | float):
            if value >= 1:
                return int(value)
        elif isinstance(value, str):
            match = _SIZE.match(value)
            if match:
                number = float(match.group(1)) * _UNITS[match.group(2).lower()]
                if number >= 1:
                    return int(number)
    raise RunnerError(f"{what}: expected a positive size such as 512m, 1g or 512Mi, got {value!r}")
