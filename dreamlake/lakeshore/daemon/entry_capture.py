"""The entry's output capture: the task's fd 1 / fd 2 appended to the workdir's logs.

With ``LAKESHORE_CAPTURE_OUTPUT=1`` (nymph sets it for every invocation) the entry first appends
its own fd 1 and fd 2 to the workdir's ``stdout.log`` / ``stderr.log`` (``O_APPEND``, no link
followed; a child of the process runner's zygote has them so already) and makes ``sys.stdout`` /
``sys.stderr`` line-buffered (:func:`capture_output`), so every runner leaves the task's output in
the workdir while it runs, and nymph's pump streams it as LOG frames.

Part of the entry bundle, like :mod:`dreamlake.lakeshore.daemon.entry`: importable on Python
3.9, no ``typing`` at runtime.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # no typing at runtime: start-up is what a noop invocation costs
if TYPE_CHECKING:
    from typing import Any

CAPTURE_ENV = "LAKESHORE_CAPTURE_OUTPUT"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"


def capture_output(reopen: bool = True) -> None:
    """Append fd 1 / fd 2 to ``stdout.log`` / ``stderr.log`` of the cwd (the workdir) and make
    ``sys.stdout`` / ``sys.stderr`` line-buffered (see the module docstring). A file that
    cannot be opened leaves that fd as it was, with one line on the old stderr. ``reopen=False``:
    fd 1 and fd 2 are those files already (the zygote's child opened them): only the streams."""
    import io

    for fd, name, attr in ((1, STDOUT_FILE, "stdout"), (2, STDERR_FILE, "stderr")):
        old = getattr(sys, attr, None)
        try:
            if old is not None:
                old.flush()
        except (OSError, ValueError):
            pass
        if reopen:
            try:
                _append_fd(fd, name)
            except OSError as exc:
                sys.stderr.write(f"lakeshore entry: cannot append {attr} to {name}: {exc.strerror}\n")
                continue
        errors = "backslashreplace" if attr == "stderr" else (getattr(old, "errors", None) or "strict")
        if not reopen and old is not None and _writes_to(old, fd):  # the zygote's own: line-buffer it
            try:
                old.reconfigure(errors=errors, line_buffering=True)
                continue
            except (AttributeError, OSError, ValueError):
                pass
        encoding = getattr(old, "encoding", None) or "utf-8"
        buffer = io.BufferedWriter(io.FileIO(fd, "w", closefd=False))
        stream = io.TextIOWrapper(buffer, encoding=encoding, errors=errors, line_buffering=True)
        setattr(sys, attr, stream)


def _writes_to(stream: Any, fd: int) -> bool:
    """Whether ``stream`` is the interpreter's own text stream on ``fd`` (a forked child's inherited
    ``sys.stdout`` or ``sys.stderr``: reconfigured, it costs no new objects)."""
    import io

    try:
        return type(stream) is io.TextIOWrapper and stream.writable() and stream.fileno() == fd
    except (OSError, ValueError):
        return False


def _append_fd(fd: int, name: str) -> None:
    """Make ``fd`` append to ``name`` in the cwd (no link followed, no FIFO waited for)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    target = os.open(name, flags, 0o644)
    try:
        os.set_blocking(target, True)
        os.dup2(target, fd)  # the copy at fd is inheritable: child processes write there too
    finally:
        os.close(target)
