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
"""

from __future__ import annotations

import os
import pwd

from nymph.config import NymphConfig
from nymph.errors import TaskUserError as TaskUserError  # re-exported: raised here
from nymph.runner import Runner

ROOT_FLAG = "--allow-root-tasks"


def nymph_is_root() -> bool:
    return os.geteuid() == 0


def useradd_command(name: str) -> str:
    """The command that creates ``name`` as the packaging does."""
    return f"useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {name}"


def check_task_user(cfg: NymphConfig, runner: Runner | None = None) -> None:
    """Raise :class:`TaskUserError` when this nymph would have to run its tasks as root."""
    if not nymph_is_root() or cfg.allow_root_tasks:
        return
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


def task_users(cfg: NymphConfig) -> list[str]:
    """The local users tasks without ``as_user`` run as on this nymph; empty when they run as
    nymph's own user (a nymph not run as root, or one with ``--allow-root-tasks``). The one place
    that says so: the set-up checks (:mod:`nymph.selfcheck`) go through it."""
    if nymph_is_root() and not cfg.allow_root_tasks:
        return [cfg.task_user]
    return []


def run_as(cfg: NymphConfig, as_user: str | None) -> str | None:
    """The local user a task runs as: ``as_user``, the task user, or None (nymph's own user)."""
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
