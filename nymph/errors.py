"""The nymph exception hierarchy.

::

    NymphError
     +-- ConfigError                 a setting that is missing or malformed (names the setting)
     |    +-- TaskUserError          nymph runs as root and cannot run tasks as anyone else
     +-- RunnerLoadError             a runner plugin that does not load or validate (names it)
     +-- RunnerError                 a runner could not do what was asked (nymph.runner)
     |    +-- RunnerUnavailable      the runner cannot work here now: engine down, binary missing
     +-- JobRefused                  a job refused before anything was spawned
     |    +-- GateRefused            a gate refused an invocation (.type: the acked error type)
     |    +-- NotEnoughGpus          more GPUs asked for than this host has
     |    +-- PayloadError           an exec payload that cannot be fetched or fails its sha256
     +-- UpgradeError                the pinned version could not be installed; the running one stays

:func:`redact` masks the credentials in a URL or a message (``user:password@``, token query
parameters, ``lsk_`` tokens) before nymph logs or prints it; nymph's log handler applies it to
every line (``nymph.observability.RedactFilter``).

Every class is defined here and re-exported by the module that raises it (``nymph.config``,
``nymph.taskuser``, ``nymph.plugins``, ``nymph.job``, ``nymph.slots``, ``nymph.execjob``, ``nymph.upgrade``), except
``RunnerError`` and ``RunnerUnavailable``: they are defined in :mod:`nymph.runner`, beside the
contract runner plugins implement (which imports this module, never the other way round). The control-plane client's errors
(``PlaneError`` and its subclasses) are :mod:`dreamlake.lakeshore.errors`' own: nymph.client raises
them under those names (no aliases), and this module's gate refusal is ``GateRefused``, not a second
``Refused``.

A job never lets an exception escape its thread: the lifecycle's one guard
(:meth:`nymph.lifecycle.SupervisedJob.run`) settles it ``failed`` with the exception's type and
message; :class:`JobRefused` is the expected way to say no before anything runs.
"""

from __future__ import annotations

import errno
import re

DISK_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))

# ``scheme://user:password@host`` (or ``scheme://token@host``): the whole user part goes
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"<>]+@")
# a query parameter that carries a credential: ?token=, &access_token=, X-Amz-Signature=, sig= ...
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;](?:[\w.-]*(?:token|secret|passw(?:or)?d|signature|credential|api[_-]?key)[\w.-]*"
    r"|sig|key|pwd|auth)=)[^&#\s'\"<>]*",
    re.IGNORECASE,
)
# a lakeshore token (``lsk_...``) or a bearer credential written out in a message
_TOKEN = re.compile(r"\b(?P<name>lsk_|Bearer\s+)[A-Za-z0-9._~+/=-]{6,}")
REDACTED = "***"


def redact(text: object) -> str:
    """``text`` (a URL, an error message, a log line) with its credentials masked: the user part of
    every ``scheme://user:password@host`` URL, the value of every query parameter that carries a
    credential (``token``, ``access_token``, ``sig``, ``X-Amz-Signature``, ``password`` ...), and
    lakeshore tokens (``lsk_...``) or ``Bearer`` values written out. What nymph logs or prints about
    the control plane's URL and its errors goes through it (``--server`` may embed a credential;
    presigned URLs carry signatures)."""
    out = str(text)
    if "://" in out:
        out = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", out)
    if "=" in out:
        out = _SECRET_PARAM.sub(lambda m: m.group("name") + REDACTED, out)
    if "lsk_" in out or "earer" in out:
        out = _TOKEN.sub(lambda m: m.group("name") + REDACTED, out)
    return out


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says a filesystem is full (``ENOSPC``, ``EDQUOT``)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in DISK_ERRNOS:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class NymphError(Exception):
    """Base of every error nymph raises on purpose."""


class ConfigError(NymphError):
    """The configuration is incomplete or malformed; the message says which setting and why."""


class TaskUserError(ConfigError):
    """nymph runs as root and has no unprivileged user to run tasks as; the message says what to do."""


class RunnerLoadError(NymphError):
    """A runner plugin could not be loaded; the message names it, its distribution and the problem."""


class JobRefused(NymphError):
    """A job refused before anything was written or spawned; ``type`` names the refusal."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message


class GateRefused(JobRefused):
    """A worker-side gate refused the invocation (pickle, ``as_user``, capabilities, run_config)."""


class NotEnoughGpus(JobRefused):
    """The invocation asks for more GPUs than this host has."""

    def __init__(self, message: str) -> None:
        super().__init__("NotEnoughGpus", message)


class PayloadError(JobRefused):
    """An exec job's payload could not be obtained or failed verification; nothing is spawned."""

    def __init__(self, message: str) -> None:
        super().__init__("PayloadError", message)


class UpgradeError(NymphError):
    """The requested version could not be installed; the running version keeps running."""


__all__ = [
    "ConfigError",
    "GateRefused",
    "JobRefused",
    "NotEnoughGpus",
    "NymphError",
    "PayloadError",
    "RunnerLoadError",
    "TaskUserError",
    "UpgradeError",
    "redact",
]
