"""The systemd notification protocol (``sd_notify``), for ``Type=notify`` units with a watchdog.

systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace) and, with
``WatchdogSec=``, ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). nymph says ``READY=1`` once it polls,
``WATCHDOG=1`` from its main loop at least every half of :meth:`SdNotify.watchdog_interval`,
``STATUS=...`` for ``systemctl status``, and ``STOPPING=1`` when it begins a graceful shutdown.

Without ``NOTIFY_SOCKET`` (a terminal, a container) every call is a no-op. The environment is read
when :class:`SdNotify` is constructed, never at import. A failed send is logged, never raised: a
notification must not take the agent down.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class SdNotify:
    def __init__(self, env: Mapping[str, str] | None = None, unset_environment: bool = False) -> None:
        """Read ``NOTIFY_SOCKET`` / ``WATCHDOG_*`` from ``env`` (``os.environ`` by default).

        ``unset_environment`` removes them from ``os.environ`` so that child processes (the tasks
        nymph runs) do not inherit them, as ``sd_notify(unset_environment=1)`` does.
        """
        source = os.environ if env is None else env
        path = source.get("NOTIFY_SOCKET") or None
        self._address: str | bytes | None = None
        if path:
            # "@name" is Linux's abstract namespace: a leading NUL byte on the wire.
            self._address = b"\0" + path[1:].encode() if path.startswith("@") else path
        self._watchdog_usec = source.get("WATCHDOG_USEC")
        self._watchdog_pid = source.get("WATCHDOG_PID")
        if unset_environment:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)

    @property
    def enabled(self) -> bool:
        """True when running under systemd with a notification socket."""
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; True if sent, False if disabled or failed."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(payload, self._address)
        except OSError as exc:
            log.warning("sd_notify %r to %r failed: %s", assignments, self._address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        # One line: a newline would start a new assignment.
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def watchdog_interval(self) -> float | None:
        """The watchdog timeout in seconds (``WATCHDOG_USEC``), or None when there is no watchdog.

        This is systemd's deadline; ping at least every half of it. None too when
        ``WATCHDOG_PID`` names another process (the watchdog is not ours).
        """
        if not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid != str(os.getpid()):
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            log.warning("ignoring WATCHDOG_USEC=%r: not an integer", self._watchdog_usec)
            return None
        return usec / 1_000_000 if usec > 0 else None
