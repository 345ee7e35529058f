"""The entry's stops: the first SIGTERM raises Interrupted in the function, with nymph's reason.

While the function runs, the first SIGTERM (the runners' ladder: interrupt, grace, kill) raises
:class:`~dreamlake.lakeshore.errors.Interrupted` in the function's thread, with the reason nymph
wrote to ``stop.reason`` in the workdir before signalling (``cancelled``, ``timeout``,
``preempted``; ``shutdown`` without the file). Later SIGTERMs are ignored (the grace is the
function's), and once the function returned the handler is gone (:meth:`_Interrupts.close`). The
handler is ``_signal``'s (a builtin: no import at start-up).

Part of the entry bundle, like :mod:`dreamlake.lakeshore.daemon.entry`: importable on Python
3.9, no ``typing`` at runtime.
"""

from __future__ import annotations

import os

from dreamlake.lakeshore.errors import Interrupted

TYPE_CHECKING = False  # no typing at runtime: start-up is what a noop invocation costs
if TYPE_CHECKING:
    from typing import Any

STOP_REASON_FILE = "stop.reason"  # nymph writes why it stops the task before the SIGTERM


class _Interrupts:
    """The SIGTERM handler of a running function: the first SIGTERM raises Interrupted (with the
    reason nymph left in ``stop.reason``), later ones are ignored; :meth:`close` puts back the
    handler there was (a warm worker runs many calls in one process)."""

    def __init__(self) -> None:
        import _signal

        self.fired = False
        self.cwd = os.getcwd()  # the function may chdir; the reason file is the workdir's
        try:
            self.previous: Any = _signal.signal(_signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread (an embedding that runs the entry in a thread)
            self.previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.fired:
            return
        self.fired = True
        raise Interrupted(_stop_reason(self.cwd))

    def close(self) -> None:
        """Stop raising: the function is done (its result is written whole whatever comes)."""
        import _signal

        if self.previous is not None:
            _signal.signal(_signal.SIGTERM, self.previous)
            self.previous = None


def _stop_reason(cwd: str) -> str:
    try:
        fd = os.open(os.path.join(cwd, STOP_REASON_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "shutdown"
    try:
        return os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
