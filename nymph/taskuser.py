"""Who a task runs as: never root, unless the operator says so.

- A task with ``as_user`` runs as that user (the job gates check the ``allow_users`` list first).
- A task without one runs as nymph's own user, except when nymph runs as root: then it runs as the
  **task user** (``task_user``, ``--task-user``, default ``nymph-task``), a dedicated unprivileged
  system user the packaging creates (``systemd/nymph-sysusers.conf``, the Dockerfile). Its workdir
  is chowned to it, so every runner finds the same user there: the process and slurm runners switch
  to it (``runuser``, or the zygote's ``setuid``), the container runners run the container as its
  uid:gid.
- A task runs as uid 0 only on a nymph started with ``--allow-root-tasks``: then tasks without
  ``as_user`` run as nymph's own user (root, when nymph is root) and ``as_user`` may name a uid-0
  user. Without the flag, ``as_user`` naming a uid-0 user is refused before anything runs.

:func:`check_task_user` runs once before ``nymph start`` registers: a root nymph without the flag
refuses to start when the task user does not exist (the error names the ``useradd`` command and
both flags), is itself uid 0, or the runner cannot run tasks as another user.

**One uid per running task (the pool).** On the process runner, tasks share the host: two tasks as
one uid could write each other's workdir (forge ``result.msgpack`` / ``error.json``), read each
other's ``/proc/PID/environ`` and signal each other's processes. So a root nymph runs each task
without ``as_user`` as a user of its own, leased for the task's life from the **pool**
``{task_user}-0`` .. ``{task_user}-{N-1}`` (``--task-user-pool N``, default 64; the packaging
creates them: ``systemd/nymph-sysusers.conf``, the Dockerfile, ``nymph doctor --fix``). Each
workdir is chowned to its task's uid (0700), so nothing of one task is reachable from another; a
task's outputs are read without following links and only when they belong to that uid
(:mod:`nymph.safeio`). :class:`TaskUsers` (:func:`task_users`) is the one place that says which
user(s) nymph runs tasks as.

A pool user serves one tenant, then another. So before a user goes back to the pool
(:meth:`TaskUsers.release`), and before this nymph leases it for the first time, every process of
its uid outside a task cgroup is killed (:mod:`nymph.uidreap`: a pip build's daemon, a task's on a
host without cgroups); a user a reap cannot clear is leased only once one can. Then what the uid
left outside its workdir is removed (:mod:`nymph.uidsweep`: its files in ``/tmp``, ``/var/tmp``,
``/dev/shm``, its SysV IPC objects), so the next tenant cannot read it. A failed call's kept
workdir is taken back from the user before that (:func:`nymph.workdir.seal`, as the invocation
is released). None of this applies to the shared task user (several tasks share it) nor to
``as_user``.

The pool needs at least ``concurrency`` users (one per slot). When it has fewer (not set up, or
too small), ``nymph start`` says so and refuses, unless the operator allows the fallback with
``--shared-task-user``: then tasks beyond the pool (all of them, without a pool) run as the one
shared ``task_user``, as before the pool, with no boundary between them (logged once at start).

The pool is for the process runner. The container runners (docker, gvisor, kube) keep the task
user: each task is a container of its own (own PID and mount namespaces, only its own workdir
mounted), so a task neither sees another's files nor its processes whatever the uid. The Slurm
runner keeps it too (a pool would have to exist on every node). ``--warm`` (trusted code, many
calls per worker, no isolation between calls by design) runs as the shared task user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import subprocess
import threading

from nymph import uidreap, uidsweep
from nymph.config import NymphConfig
from nymph.errors import TaskUserError as TaskUserError  # re-exported: raised here
from nymph.runner import Runner

log = logging.getLogger(__name__)

ROOT_FLAG = "--allow-root-tasks"
SHARED_FLAG = "--shared-task-user"


def nymph_is_root() -> bool:
    return os.geteuid() == 0


def useradd_command(name: str) -> str:
    """The command that creates ``name`` as the packaging does."""
    return f"useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {name}"


def check_task_user(cfg: NymphConfig, runner: Runner | None = None) -> None:
    """Raise :class:`TaskUserError` when this nymph would have to run its tasks as root, or share
    one uid between them without the operator's leave (:func:`task_users`)."""
    if not nymph_is_root() or cfg.allow_root_tasks:
        return
    users = task_users(cfg)
    if users.pooled:
        if len(users.pool) >= cfg.concurrency:
            return
        if not cfg.shared_task_user:
            raise TaskUserError(users.pool_problem(cfg))
        log.warning(
            "%s; %s: tasks beyond the pool run as the shared task user %r, which does not keep them apart",
            users.pool_problem(cfg, short=True),
            SHARED_FLAG,
            cfg.task_user,
        )
    _check_shared(cfg, runner)


def _check_shared(cfg: NymphConfig, runner: Runner | None) -> None:
    name = cfg.task_user
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise TaskUserError(
            f"nymph runs as root and its task user {name!r} does not exist: create it with "
            f"`{useradd_command(name)}` (the systemd unit's sysusers.d file and the Docker image do), "
            f"name another with --task-user NAME (task_user in the config file), or pass {ROOT_FLAG} "
            "to run tasks as root"
        ) from None
    if pw.pw_uid == 0:
        raise TaskUserError(
            f"task user {name!r} is uid 0: name an unprivileged user with --task-user NAME, or pass "
            f"{ROOT_FLAG} to run tasks as root"
        )
    if runner is not None and not runner.capabilities.as_user:
        raise TaskUserError(
            f"nymph runs as root and runner {runner.name!r} cannot run tasks as another user: run "
            f"nymph as an unprivileged user, or pass {ROOT_FLAG} to run tasks as root"
        )


def pool_names(cfg: NymphConfig) -> list[str]:
    """The names of the task user pool: ``{task_user}-0`` .. ``{task_user}-{task_user_pool - 1}``."""
    return [f"{cfg.task_user}-{i}" for i in range(cfg.task_user_pool)]


def _unprivileged(name: str) -> bool:
    try:
        return pwd.getpwnam(name).pw_uid != 0
    except KeyError:
        return False


class TaskUsers:
    """Who this nymph runs its tasks as: a user of the pool per running task (``pooled``), or the
    one ``shared`` task user (None: nymph's own user). Thread-safe: jobs lease and release users
    from their own threads."""

    def __init__(self, shared: str | None, pool: list[str], *, pooled: bool, fallback: bool) -> None:
        self.shared = shared
        self.pool = pool  # the pool's users that exist here
        self.pooled = pooled
        self.fallback = fallback  # the operator allows the shared user when the pool is used up
        self._lock = threading.Lock()
        self._leased: dict[int, str] = {}  # id(holder) -> user
        self._clean: set[str] = set()  # reaped since their last lease: nothing of theirs runs

    def users(self) -> list[str]:
        """Every user tasks without ``as_user`` may run as here (the pool's, then the shared one)."""
        out = list(self.pool) if self.pooled else []
        if self.shared and (not self.pooled or self.fallback):
            out.append(self.shared)
        return out

    def acquire(self, holder: object) -> str | None:
        """A user for ``holder``'s task: a free user of the pool, else the shared one when allowed.

        A user this nymph has not leased yet (or whose last reap left a process) is reaped first
        (:mod:`nymph.uidreap`: a previous life's leftovers); one that cannot be is skipped.
        Raises :class:`TaskUserError` when the pool is used up and the fallback is not allowed."""
        if not self.pooled:
            return self.shared
        skipped: set[str] = set()
        while True:
            with self._lock:
                if id(holder) in self._leased:
                    return self._leased[id(holder)]
                busy = set(self._leased.values()) | skipped
                free = [name for name in self.pool if name not in busy]
                name = next((n for n in free if n in self._clean), free[0] if free else None)
                if name is None:
                    break
                self._leased[id(holder)] = name  # no other job takes it while it is reaped
                if name in self._clean:
                    self._clean.discard(name)
                    return name
            if _reaped(name):
                return name
            skipped.add(name)
            with self._lock:
                self._leased.pop(id(holder), None)
        if self.fallback:
            return self.shared
        raise TaskUserError(
            f"every user of the task user pool ({len(self.pool)}) runs a task: make the pool bigger "
            f"(--task-user-pool, `nymph doctor --fix`), lower --concurrency, or pass {SHARED_FLAG}"
        )

    def pool_uids(self) -> set[int]:
        """The uids of the pool's users (empty when tasks get no user of the pool)."""
        out = set()
        for name in self.pool if self.pooled else ():
            with contextlib.suppress(KeyError):
                out.add(pwd.getpwnam(name).pw_uid)
        return out

    def lease_of(self, holder: object) -> str | None:
        """The pool user leased to ``holder`` (None: it runs as no user of the pool)."""
        with self._lock:
            return self._leased.get(id(holder))

    def hold(self, holder: object, name: str | None) -> None:
        """``holder`` is a recovered task that runs as ``name``: its user stays leased to it."""
        if self.pooled and name in self.pool:
            with self._lock:
                self._leased[id(holder)] = name

    def release(self, holder: object) -> None:
        """Give ``holder``'s pool user back, once every process of that uid outside a task cgroup
        is killed (:mod:`nymph.uidreap`: what a build or an escaped process left must not meet
        the next tenant's task) and what it left in ``/tmp`` & co. is removed (:mod:`nymph.uidsweep`);
        a user that cannot be reaped now is reaped at its next lease."""
        with self._lock:
            name = self._leased.get(id(holder))
        if name is None:  # the shared user, an as_user, nymph's own: not the pool's, never reaped
            return
        clean = _reaped(name)
        with self._lock:
            self._leased.pop(id(holder), None)
            if clean:
                self._clean.add(name)

    def pool_problem(self, cfg: NymphConfig, *, short: bool = False) -> str:
        """What is wrong with the pool (fewer users than ``concurrency``), and what to do."""
        names = pool_names(cfg)
        have = f"{len(self.pool)} of {names[0]} .. {names[-1]} exist" if names else "the pool is empty"
        why = (
            f"nymph runs as root and runs each task as a user of its own from the task user pool, but "
            f"{have} and --concurrency {cfg.concurrency} needs {cfg.concurrency}"
        )
        if short:
            return why
        return (
            f"{why}: create them with `nymph doctor --fix` (or systemd-sysusers with nymph's "
            f"sysusers.d file, or `{useradd_command(names[0] if names else cfg.task_user)}` for each), "
            f"name another prefix with --task-user NAME, pass {SHARED_FLAG} to let tasks share the one "
            f"task user {cfg.task_user!r} (no boundary between them), or pass {ROOT_FLAG} to run "
            "tasks as root"
        )


def _reaped(name: str) -> bool:
    """Kill what the pool user ``name`` left running (:func:`nymph.uidreap.reap`), then remove what
    it left in ``/tmp`` & co. (:func:`nymph.uidsweep.sweep`); True when no process is left. Never
    raises: a failure to kill keeps the user from the next lease (False)."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:  # not a user (any more): nothing runs as it
        return True
    if pw.pw_uid == 0:
        return False
    try:
        if uidreap.reap(pw.pw_uid, pw.pw_gid):
            return False
    except Exception:
        log.exception("task user %s: killing what it left running failed; not leased until it can be", name)
        return False
    uidsweep.sweep(pw.pw_uid)  # its files in /tmp & co., its SysV IPC objects: never keeps it out
    return True


_USERS: dict[tuple[object, ...], TaskUsers] = {}
_USERS_LOCK = threading.Lock()


def uses_pool(cfg: NymphConfig) -> bool:
    """Whether tasks without ``as_user`` get a pool user each: a root nymph (without
    ``--allow-root-tasks``) on the process runner, not in warm mode, with a pool configured."""
    if not nymph_is_root() or cfg.allow_root_tasks or cfg.task_user_pool <= 0:
        return False
    warm = str(cfg.runner_options.get("warm", "")).lower() in ("1", "true", "yes", "on")
    return cfg.runner == "process" and not warm


def task_users(cfg: NymphConfig) -> TaskUsers:
    """The one :class:`TaskUsers` of this configuration (one per nymph process)."""
    key = (cfg.task_user, cfg.task_user_pool, cfg.shared_task_user, cfg.allow_root_tasks, uses_pool(cfg))
    with _USERS_LOCK:
        found = _USERS.get(key)
        if found is None:
            shared = run_as(cfg, None)
            if uses_pool(cfg):
                pool = [name for name in pool_names(cfg) if _unprivileged(name)]
                found = TaskUsers(shared, pool, pooled=True, fallback=cfg.shared_task_user)
            else:
                found = TaskUsers(shared, [], pooled=False, fallback=True)
            _USERS[key] = found
        return found


def create_pool(cfg: NymphConfig) -> list[str]:
    """Create the pool's missing users (``nymph doctor --fix``) as the packaging does; the names made."""
    if shutil.which("useradd") is None:
        raise TaskUserError("useradd is not installed: create the task user pool with systemd-sysusers")
    made = []
    for name in pool_names(cfg):
        try:
            pwd.getpwnam(name)
            continue
        except KeyError:
            pass
        out = subprocess.run(useradd_command(name).split(), capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise TaskUserError(f"`{useradd_command(name)}` failed: {out.stderr.strip() or out.returncode}")
        made.append(name)
    with _USERS_LOCK:
        _USERS.clear()  # the next task_users() sees them
    return made


def run_as(cfg: NymphConfig, as_user: str | None) -> str | None:
    """The local user a task runs as when no pool applies: ``as_user``, the shared task user, or
    None (nymph's own user). A pooled task's user comes from :meth:`TaskUsers.acquire`."""
    if as_user:
        return as_user
    if nymph_is_root() and not cfg.allow_root_tasks:
        return cfg.task_user
    return None


def root_refusal(cfg: NymphConfig, user: str | None) -> str | None:
    """Why a task may not run as ``user`` (None: nymph's own user); None when it may."""
    if cfg.allow_root_tasks:
        return None
    try:
        uid = os.geteuid() if user is None else pwd.getpwnam(user).pw_uid
    except KeyError:
        return None  # not a user here: the as_user gate says so
    if uid != 0:
        return None
    who = f"as_user {user!r} is" if user else "nymph runs as root and the task would run"
    return f"{who} root (uid 0): tasks run as root only on a nymph started with {ROOT_FLAG}"
