"""The process runner's warm fork: its zygotes, one per namespace and interpreter environment.

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
module.

Zygotes are keyed by the task's namespace (``Task.namespace``, its tenant) and its environment (all but ``LAKESHORE_*`` and the GPU variables, which are read after start-up): a task is forked
only by a zygote that only ever handled its own namespace's requests, so nothing another tenant's
request left in a zygote's memory (freed, not cleared: every child inherits the heap) can reach
it. A request carries the task's per-task variables and never its arguments: the runner writes
``args.msgpack`` in the workdir and the child reads it once it is the task's user.

Code a call shipped (``Task.code_dirs``, nymph's code cache) reaches the task as
``LAKESHORE_CODE_PATH``, a per-task variable like every ``LAKESHORE_*`` one: it is not part of a
zygote's key, so one zygote serves every version of a namespace's code, and the entry (in the
forked child or the spawned process alike) puts the directories first on ``sys.path`` and
``PYTHONPATH``.

:class:`Zygotes` keeps at most ``limit`` of them (the runner option ``zygotes``; nymph sets it to
its concurrency, at least :data:`ZYGOTES_DEFAULT`): a key without one starts one (the first task
waits for it to be ready), closing the least recently used idle one (no fork in flight, every child
it forked ended) when the limit is reached; when none is idle the task is spawned the normal way.
After three consecutive failures none: the runner spawns from then on. :meth:`Zygotes.fork` forks
a task through the one for its key.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from nymph.runner import RunnerError, Task
from nymph_process.prefork import ForkedChild, ZygoteClient, ZygoteError
from nymph_process.warm import passwd_record

log = logging.getLogger(__name__)

ZYGOTE_TIMEOUT_S = 30.0  # start-up (imports on a cold page cache) and one fork answer
_ZYGOTE_MAX_FAILURES = 3  # consecutive zygote failures before prefork gives up for this runner
ZYGOTES_DEFAULT = 4  # zygotes kept at once (one per namespace and interpreter environment)
# per-invocation variables: read after start-up, so a zygote serves tasks that differ only in them
_PER_TASK_ENV = ("LAKESHORE_",)
_PER_TASK_ENV_KEYS = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)

EnvKey = tuple[tuple[str, str], ...]
Key = tuple[str | None, EnvKey]  # (the task's namespace, its interpreter environment)


def interpreter_key(env: Mapping[str, str]) -> EnvKey:
    """What of a task's environment shapes an interpreter: all but the per-task variables."""
    return tuple(
        sorted(
            (k, v) for k, v in env.items() if k not in _PER_TASK_ENV_KEYS and not k.startswith(_PER_TASK_ENV)
        )
    )


class Zygotes:
    """The zygotes of one runner, by namespace and interpreter environment (see the module docstring)."""

    def __init__(self, python: str, limit: int = ZYGOTES_DEFAULT) -> None:
        self.python = python
        self.limit = max(1, int(limit))
        self.live: OrderedDict[Key, ZygoteClient] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._forking: dict[ZygoteClient, int] = {}  # forks under way through each (not closed)
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
        key = (task.namespace, interpreter_key(env))
        for _attempt in range(2):  # a zygote found dead is restarted once for this task
            zygote = self._get(key)
            if zygote is None:
                return None
            try:
                child, start_time = zygote.fork(workdir, env, ZYGOTE_TIMEOUT_S, cgroup=procs, user=user)
            except ZygoteError as exc:
                log.warning("invocation %s: zygote %d: %s", task.invocation_id, zygote.pid, exc)
                self._failed(zygote)
                if exc.maybe_forked:  # a child may run it: only the entry lock decides from here
                    return None
                continue
            finally:
                self._release(zygote)
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

    def _get(self, key: Key) -> ZygoteClient | None:
        """The live zygote for ``key``, started if needed (held for one fork: :meth:`_release`);
        None: spawn instead."""
        closing: list[ZygoteClient] = []
        try:
            with self._lock:
                if self.failures >= _ZYGOTE_MAX_FAILURES:
                    return None
                zygote = self.live.get(key)
                if zygote is not None and zygote.alive:
                    self.live.move_to_end(key)
                    self._forking[zygote] = self._forking.get(zygote, 0) + 1
                    return zygote
                if zygote is not None:  # dead: its children are watched without it already
                    closing.append(self.live.pop(key))
                if len(self.live) >= self.limit:
                    spare = self._spare()
                    if spare is None:
                        return None  # every zygote is busy: spawn this one
                    closing.append(self.live.pop(spare))
                try:
                    zygote = ZygoteClient(self.python, dict(key[1]))
                except ZygoteError as exc:
                    log.warning("process runner: %s; spawning instead", exc)
                    self.failures += 1
                    return None
                self.live[key] = zygote
                self._forking[zygote] = 1
                return zygote
        finally:
            for old in closing:  # outside the lock: closing one waits for it to exit
                old.close()

    def _spare(self) -> Key | None:
        """The key of the least recently used zygote that can be closed without orphaning anything:
        dead, or idle (no fork under way through it, every child it forked ended). Under the lock."""
        for key, zygote in self.live.items():
            if not zygote.alive or (zygote not in self._forking and zygote.idle):
                return key
        return None

    def _release(self, zygote: ZygoteClient) -> None:
        with self._lock:
            left = self._forking.pop(zygote, 1) - 1
            if left > 0:
                self._forking[zygote] = left

    def _failed(self, zygote: ZygoteClient) -> None:
        with self._lock:
            self.failures += 1
            for key, known in list(self.live.items()):
                if known is zygote:
                    del self.live[key]
            if self.failures >= _ZYGOTE_MAX_FAILURES:
                log.warning("process runner: the zygote failed %d times; spawning from now on", self.failures)
        zygote.close()
