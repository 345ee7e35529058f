"""Version pinning: install the nymph version the control plane asks for and restart into it.

When a poll or heartbeat answer carries ``target_nymph_version`` different from the running
version, nymph either

- exits with :data:`EXIT_VERSION_MISMATCH` (75, ``EX_TEMPFAIL``) after draining, and lets its
  supervisor replace it: systemd (``Restart=always``, ``RestartForceExitStatus=75`` in
  ``systemd/nymph.service``) with a package step in ``ExecStartPre=``, or a Kubernetes DaemonSet
  whose image an operator rolls; or
- with ``auto_upgrade`` on, calls :func:`upgrade_and_reexec`: ``pip install`` the exact version
  into its own interpreter's environment, from a local wheelhouse (``--no-index --find-links``) or
  an index, then ``os.execv`` the same command line, keeping the PID (so systemd's
  ``NotifyAccess=main`` and the watchdog keep working).

Dependencies are NOT installed with ``--no-deps``: a new version may need a new or newer
dependency, and a half-installed agent is worse than a failed upgrade. With a wheelhouse and
``--no-index``, dependencies already installed and satisfied cost nothing; a missing one makes
the install fail cleanly (:class:`UpgradeError`) and the running version carries on.

:class:`VersionPin` notices the pin and drains; the agent then exits or upgrades.

The pure parts (:func:`validate_version`, :func:`install_command`, :func:`reexec_argv`) are split
from the side effects (:func:`install`, :func:`upgrade_and_reexec`) so they can be tested alone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from packaging.version import InvalidVersion, Version

from dreamlake.lakeshore import __version__
from nymph.errors import UpgradeError as UpgradeError  # re-exported: raised here
from nymph.sdnotify import SdNotify

log = logging.getLogger(__name__)

EXIT_VERSION_MISMATCH = 75  # EX_TEMPFAIL: "restart me"; the supervisor replaces the process
DISTRIBUTION = "dreamlake-lakeshore"
INSTALL_TIMEOUT_S = 600.0
STDERR_TAIL = 2000
_DRAIN_STEP_S = 0.2


def validate_version(version: str) -> str:
    """Return ``version`` normalised if it is a PEP 440 public version ("0.1.4", "1.0rc1",
    "2!1.0.post1.dev3"); else raise. Parsed by ``packaging.version`` (the rule pip itself applies);
    a local version ("1.0+abc") or anything with spaces or options is refused before pip sees it."""
    if not isinstance(version, str) or version != version.strip():
        raise UpgradeError(f"refusing to install {DISTRIBUTION} version {version!r}: not a PEP 440 version")
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise UpgradeError(
            f"refusing to install {DISTRIBUTION} version {version!r}: not a PEP 440 version"
        ) from None
    if parsed.local is not None:
        raise UpgradeError(
            f"refusing to install {DISTRIBUTION} version {version!r}: not a PEP 440 version (a local version "
            "cannot be pinned from an index)"
        )
    return str(parsed)


def install_command(
    version: str,
    index_url: str | None = None,
    wheelhouse: str | os.PathLike[str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The pip command line installing exactly ``version`` into ``python``'s environment."""
    cmd = [
        python, "-m", "pip", "install",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
    ]  # fmt: skip
    if wheelhouse is not None:
        cmd += ["--no-index", "--find-links", str(Path(wheelhouse))]
    elif index_url is not None:
        cmd += ["--index-url", index_url]
    cmd.append(f"{DISTRIBUTION}=={validate_version(version)}")
    return cmd


def reexec_argv(python: str = sys.executable, orig_argv: Sequence[str] | None = None) -> list[str]:
    """The command line that restarts this process under ``python`` with the same arguments.

    ``sys.orig_argv`` is ``[interpreter, *interpreter options, script or -m module, *args]`` (for
    the ``nymph`` console script: ``[python, /usr/local/bin/nymph, start, ...]``); the interpreter
    is swapped for ``python`` and everything else is kept.
    """
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    if not argv:
        raise UpgradeError("cannot re-exec: the original command line is unknown")
    return [python, *argv[1:]]


def _tail(text: str) -> str:
    return text[-STDERR_TAIL:].strip()


def install(
    version: str,
    index_url: str | None = None,
    wheelhouse: str | os.PathLike[str] | None = None,
    python: str = sys.executable,
) -> None:
    """Run pip; raise :class:`UpgradeError` with the tail of pip's stderr when it fails."""
    cmd = install_command(version, index_url=index_url, wheelhouse=wheelhouse, python=python)
    log.info("installing %s==%s: %s", DISTRIBUTION, version, " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpgradeError(f"pip could not run for {DISTRIBUTION}=={version}: {exc}") from exc
    if proc.returncode != 0:
        raise UpgradeError(
            f"pip install {DISTRIBUTION}=={version} failed (exit {proc.returncode}): "
            f"{_tail(proc.stderr) or _tail(proc.stdout)}"
        )
    log.info("installed %s==%s", DISTRIBUTION, version)


def installed_version(python: str = sys.executable) -> str | None:
    """The version of the distribution installed for ``python`` (a fresh process: no stale cache)."""
    code = f"import importlib.metadata as m; print(m.version({DISTRIBUTION!r}))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def _same_version(a: str, b: str) -> bool:
    """Whether two version strings name one version (``1.0`` is ``1.0.0``, ``1.0RC1`` is ``1.0rc1``)."""
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def upgrade_and_reexec(
    version: str,
    index_url: str | None = None,
    wheelhouse: str | os.PathLike[str] | None = None,
    python: str = sys.executable,
) -> NoReturn:
    """Install ``version``, check it is what ``python`` now sees, and exec the same command line.

    The caller drains first (no invocation running, outbox flushed) and closes what must not leak
    into the new image; descriptors without close-on-exec survive ``execv``. Raises
    :class:`UpgradeError` (and does not exec) when the install fails or the version did not take.
    """
    install(version, index_url=index_url, wheelhouse=wheelhouse, python=python)
    got = installed_version(python)
    if got is None or not _same_version(got, version):
        raise UpgradeError(
            f"installed {DISTRIBUTION}=={version} but {python} sees {got!r} "
            "(an editable install or another path earlier on sys.path shadows it)"
        )
    argv = reexec_argv(python)
    log.warning("restarting into %s %s: %s", DISTRIBUTION, version, " ".join(argv))
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(python, argv)
    except OSError as exc:
        raise UpgradeError(f"installed {DISTRIBUTION}=={version} but could not exec {argv}: {exc}") from exc


class VersionPin:
    """The version the control plane pins (``target_nymph_version`` in a poll or heartbeat answer).

    A pin other than ours stops claiming (:attr:`target` is set), drains what runs (the long poll
    in flight first: what it claims runs like any other work), then asks the agent to stop; the
    agent exits :data:`EXIT_VERSION_MISMATCH` or, with ``auto_upgrade``, calls
    :func:`upgrade_and_reexec`.
    """

    def __init__(
        self,
        notify: SdNotify,
        *,
        stopping: threading.Event,
        polling: Callable[[], bool],
        wait_idle: Callable[[float], bool],
        running: Callable[[], int],
        request_stop: Callable[[], None],
    ) -> None:
        self._notify = notify
        self._stopping = stopping
        self._polling = polling
        self._wait_idle = wait_idle
        self._running = running
        self._request_stop = request_stop
        self.target: str | None = None

    def check(self, answer: dict[str, Any]) -> None:
        """Start draining when ``answer`` pins another version (once)."""
        target = answer.get("target_nymph_version")
        if (
            not isinstance(target, str)
            or not target
            or _same_version(target, __version__)
            or self.target is not None
        ):
            return
        log.warning(
            "the control plane pins nymph %s (this is %s): no new claims, draining %d running job(s)",
            target,
            __version__,
            self._running(),
        )
        self.target = str(target)
        self._notify.status(f"draining for nymph {target}")
        threading.Thread(target=self._drain, name="nymph-drain", daemon=True).start()

    def _drain(self) -> None:
        # A long poll in flight when the pin landed may still claim work: wait for it to return
        # (its claims are run like any other) before waiting for the running work to finish.
        while not self._stopping.is_set():
            if self._polling():
                self._stopping.wait(_DRAIN_STEP_S)
            elif self._wait_idle(_DRAIN_STEP_S):
                break
        self._request_stop()
