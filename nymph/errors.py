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

DISK_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))


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
]
