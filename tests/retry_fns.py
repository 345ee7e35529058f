"""Functions the retry tests ship by reference to a real nymph (the spawned entry imports this
module): each counts its calls in a file, so a test can tell the attempts apart."""

from __future__ import annotations

import os
from pathlib import Path


def _count(counter: str) -> int:
    """This call's number (1, 2, ...), kept in the file ``counter``."""
    path = Path(counter)
    n = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(n))
    return n


def flaky(counter: str, failures: int) -> str:
    """Raise TimeoutError on the first ``failures`` calls, then succeed."""
    n = _count(counter)
    if n <= failures:
        raise TimeoutError(f"call {n}: the backend did not answer")
    return f"ok on call {n}"


def refused(counter: str) -> None:
    """Raise ConnectionRefusedError: an OSError by its base classes."""
    _count(counter)
    raise ConnectionRefusedError(f"call {Path(counter).read_text()}: refused")


def crash(counter: str) -> None:
    """Die without a word, as a segfault or an OOM kill would."""
    _count(counter)
    os._exit(17)


def bad_value(counter: str) -> None:
    _count(counter)
    raise ValueError("not retried: ValueError is not in retry_on")
