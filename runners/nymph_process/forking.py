"""The process runner's warm fork: its zygotes, one per interpreter environment.

``prefork=True`` (warm fork): a Python task (no ``script``; with a user to become only when nymph
runs as root, the zygote's child then drops to it with ``setgroups`` / ``setgid`` / ``setuid``
before the entry runs) is forked by a long-lived
zygote (:mod:`nymph_process.zygote`) that has already paid the interpreter start-up and the entry's
imports, instead of spawning a new interpreter. The child is set up exactly as the spawned entry
(own session, cwd, environment, logs) and imports the user's code itself; the handle is the same
``{pid, pgid, start_time}``. The zygote reports each child's exit code (it is the parent); if it
dies, running children are watched like re-attached ones and the next task restarts it (or, after
repeated failures, spawns the normal way), so no invocation is lost to it. On by default
(``prefork = false`` under ``[runner_options]`` turns it off). What differs from a spawned entry:
children of one zygote share its hash seed (``PYTHONHASHSEED``) and the entry code it loaded (an
upgrade of the package on disk reaches tasks when nymph restarts), and ``__main__`` is the entry
module. One zygote serves each distinct environment (all but ``LAKESHORE_*`` and the GPU variables,
which are read after start-up), at most four.

Code a call shipped (``Task.code_dirs``, nymph's code cache) reaches the task as
``LAKESHORE_CODE_PATH``, a per-task variable like every ``LAKESHORE_*`` one: it is not part of a
zygote's key, so one zygote serves every version, and the entry (in the forked child or the spawned
process alike) puts the directories first on ``sys.path`` and ``PYTHONPATH``.

:class:`Zygotes` keeps them (at most four; after three consecutive failures none: the runner spawns
from then on) and forks a task through the one for its environment (:meth:`Zygotes.fork`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

from nymph.runner import RunnerError, Task
from nymph_process.prefork import ForkedChild, ZygoteClient, ZygoteError
from nymph_process.warm import passwd_record

log = logging.getLogger(__name__)

ZYGOTE_TIMEOUT_S = 30.0  # start-up (imports on a cold page cache) and one fork answer
_ZYGOTE_MAX_FAILURES = 3  # consecutive zygote failures before prefork gives up for this runner
_ZYGOTE_MAX = 4  # zygotes kept at once, one per distinct interpreter environment
# per-invocation variables: read after start-up, so a zygote serves tasks that differ only in them
_PER_TASK_ENV = ("LAKESHORE_",)
_PER_TASK_ENV_KEYS = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)

Key = tuple[tuple[str, str], ...]


def interpreter_key(env: Mapping[str, str]) -> Key:
    """What of a task's environment shapes an interpreter: all but the per-task variables."""
    return tuple(
        sorted(
            (k, v) for k, v in env.items() if k not in _PER_TASK_ENV_KEYS and not k.startswith(_PER_TASK_ENV)
        )
    )


class Zygotes:
    """The zygotes of one runner, by interpreter environment (see the module docstring)."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.live: dict[Key, ZygoteClient] = {}
        self._lock = threading.Lock()
        self.failures = 0

    def fork(
        self, task: Task, env: dict[str, str], procs: str | None
    ) -> tuple[ZygoteClient, ForkedChild, float] | None:
        """Fork ``task`` (``env``: its environment; ``procs``: the ``cgroup.procs`` files it joins)
        through its zygote -> ``(zygote, child, start_time)``; None when prefork cannot serve it
        (spawn it instead)."""
        workdir = Path(task.workdir)
        try:
            user = passwd_record(task.as_user) if task.as_user else None
        except KeyError:
            raise RunnerError(
                f"process runner: as_user {task.as_user!r} is not a user on this host"
            ) from None
        for _attempt in range(2):  # a zygote found dead is restarted once for this task
            zygote = self._get(env)
            if zygote is None:
                return None
            try:
                child, start_time = zygote.fork(
                    workdir, env, ZYGOTE_TIMEOUT_S, cgroup=procs, user=user, args=task.args
                )
            except ZygoteError as exc:
                log.warning("invocation %s: zygote %d: %s", task.invocation_id, zygote.pid, exc)
                self._failed(zygote)
                if exc.maybe_forked:  # a child may run it: only the entry lock decides from here
                    return None
                continue
            self.failures = 0
            log.debug(
                "invocation %s: forked pid %d from zygote %d", task.invocation_id, child.pid, zygote.pid
            )
            return zygote, child, start_time
        return None

    def close(self) -> None:
        """Stop the zygotes (tasks they forked carry on)."""
        with self._lock:
            zygotes = list(self.live.values())
            self.live.clear()
        for zygote in zygotes:
            zygote.close()

    def _get(self, env: dict[str, str]) -> ZygoteClient | None:
        """The live zygote for this interpreter environment, started if needed; None: spawn instead."""
        key = interpreter_key(env)
        with self._lock:
            if self.failures >= _ZYGOTE_MAX_FAILURES:
                return None
            zygote = self.live.get(key)
            if zygote is not None and zygote.alive:
                return zygote
            if zygote is None and len(self.live) >= _ZYGOTE_MAX:
                return None
            try:
                zygote = ZygoteClient(self.python, dict(key))
            except ZygoteError as exc:
                log.warning("process runner: %s; spawning instead", exc)
                self.failures += 1
                return None
            self.live[key] = zygote
            return zygote

    def _failed(self, zygote: ZygoteClient) -> None:
        with self._lock:
            self.failures += 1
            for key, known in list(self.live.items()):
                if known is zygote:
                    del self.live[key]
            if self.failures >= _ZYGOTE_MAX_FAILURES:
                log.warning("process runner: the zygote failed %d times; spawning from now on", self.failures)
        zygote.close()
