"""``nymph doctor``: check that this nymph can work, and say what to fix when it cannot.

Checks, in order: the control plane answers ``/healthz``; the token is accepted as a daemon token
(``/v1/ops/whoami`` names its kind: an admin token works but is flagged; nothing is registered, so
the doctor leaves no worker behind); the runner loads and its ``check()`` passes; who tasks run as
(:mod:`nymph.taskuser`: a root nymph without its task user fails, one with ``--allow-root-tasks``
warns; with ``--fix``, the missing users of the task user pool are created first); whether those
users can run the tasks (:mod:`nymph.selfcheck`, the very checks ``nymph start`` makes before it
registers: the interpreter, the workdir, the code cache); for the process runner, whether each task
gets its own cgroup (:mod:`nymph.cgroup`; where not, a warning that says why and that nymph falls
back to the process group) and which controllers limit each task's memory and processes
(:mod:`nymph.limits`: a warning without them); the work and state directories exist (or can be
created) and are writable; the state directory is not readable by others, and the work directory
not listable by them (a warning: 0711 is right, task users must enter it).

A warning (``[warn]``) does not fail the doctor; a failure (``[FAIL]``) does.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamlake.lakeshore.errors import AuthError, PlaneError
from dreamlake.lakeshore.protocol import routes
from nymph.client import ControlPlaneClient
from nymph.config import NymphConfig
from nymph.errors import redact
from nymph.runner import Runner


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str  # what was found, or what to fix
    warn: bool = False  # works, but not as it should (ok stays True)


def _server(cfg: NymphConfig, client: ControlPlaneClient) -> Check:
    try:
        info = client.healthz()
    except PlaneError as exc:
        return Check(
            "server",
            False,
            redact(f"{cfg.server} is not reachable ({exc}); check --server and the network"),
        )
    return Check("server", True, f"{redact(cfg.server)} answers (store: {info.get('store', '?')})")


def _token(cfg: NymphConfig, client: ControlPlaneClient) -> Check:
    """The token's kind, from ``/v1/ops/whoami`` (every kind may ask; nothing is registered)."""
    try:
        kind = client.call_json(routes.WHOAMI, {}).get("kind")
    except AuthError as exc:
        return Check(
            "token",
            False,
            f"the control plane rejects the token ({exc}); mint one with "
            "`lakeshore token create --kind daemon --name <host>` and pass it with --token-file / NYMPH_TOKEN",
        )
    except PlaneError as exc:
        return Check("token", False, f"could not check the token: {exc}")
    if kind == "admin":
        return Check(
            "token",
            True,
            "accepted, but it is an admin token (it may do anything, anywhere); give nymph a daemon "
            "token: `lakeshore token create --kind daemon --name <host>`",
        )
    if kind != "daemon":
        return Check("token", False, f"a {kind} token, not a daemon token")
    return Check("token", True, "accepted as a daemon token")


def _runner(cfg: NymphConfig) -> tuple[Check, Runner | None]:
    """The runner's check, and the runner when it loads (the task set-up check runs through it)."""
    from nymph.errors import RunnerLoadError
    from nymph.plugins import load_runner
    from nymph.runner import RunnerUnavailable

    runner: Runner | None = None
    try:
        runner = load_runner(cfg.runner)(**dict(cfg.runner_options))
        runner.check()
    except RunnerLoadError as exc:
        return Check("runner", False, str(exc)), runner
    except RunnerUnavailable as exc:
        return Check("runner", False, f"runner {cfg.runner!r} cannot work here: {exc}"), runner
    except Exception as exc:
        check = Check("runner", False, f"runner {cfg.runner!r} failed its check: {type(exc).__name__}: {exc}")
        return check, runner
    return Check("runner", True, f"{cfg.runner!r} loads and its check passes"), runner


def _task_setup(cfg: NymphConfig, runner: Runner | None) -> Check:
    """What ``nymph start`` checks before it registers (:mod:`nymph.selfcheck`): the same function."""
    from nymph.selfcheck import task_setup_problems

    if runner is None:
        return Check("task-setup", False, "not checked: the runner does not load")
    problems = task_setup_problems(cfg, runner)
    if problems:
        return Check("task-setup", False, "; ".join(problems))
    return Check("task-setup", True, "tasks can run their interpreter and reach the workdir and code cache")


def _task_user(cfg: NymphConfig) -> Check:
    from nymph.taskuser import TaskUserError, check_task_user, nymph_is_root, task_users

    if not nymph_is_root():
        return Check("task-user", True, f"tasks run as nymph's own user (uid {os.geteuid()}), never root")
    if cfg.allow_root_tasks:
        return Check(
            "task-user",
            True,
            "nymph runs as root with --allow-root-tasks: tasks without as_user run as root; drop the "
            f"flag to run them as the task user {cfg.task_user!r}",
            warn=True,
        )
    try:
        check_task_user(cfg)
    except TaskUserError as exc:
        return Check("task-user", False, str(exc))
    users = task_users(cfg)
    if users.pooled and len(users.pool) >= cfg.concurrency:
        return Check(
            "task-user",
            True,
            f"nymph runs as root; each task runs as a user of its own from the pool of {len(users.pool)} "
            f"({users.pool[0]} ..)",
        )
    uid = pwd.getpwnam(cfg.task_user).pw_uid
    if users.pooled:  # allowed to share (--shared-task-user)
        return Check(
            "task-user",
            True,
            f"{users.pool_problem(cfg, short=True)}; tasks share the task user {cfg.task_user!r} (uid "
            f"{uid}), which does not keep them apart: run `nymph doctor --fix`",
            warn=True,
        )
    return Check("task-user", True, f"nymph runs as root; tasks run as {cfg.task_user!r} (uid {uid})")


def fix_task_users(cfg: NymphConfig) -> str:
    """``nymph doctor --fix``: create the missing users of the task user pool (root only)."""
    from nymph.taskuser import TaskUserError, create_pool, nymph_is_root, uses_pool

    if not nymph_is_root():
        return "[fix] task users: not root, nothing to create (tasks run as nymph's own user)"
    if not uses_pool(cfg):
        return "[fix] task users: this configuration runs no task user pool"
    try:
        made = create_pool(cfg)
    except TaskUserError as exc:
        return f"[fix] task users: {exc}"
    return f"[fix] task users: created {len(made)} ({', '.join(made) or 'none missing'})"


def _cgroups(cfg: NymphConfig) -> Check:
    if cfg.runner != "process":
        return Check("cgroups", True, f"runner {cfg.runner!r} contains each task itself (its engine, Slurm)")
    mode = str(cfg.runner_options.get("cgroup", "auto"))
    fallback = (
        "tasks are tracked by process group; a descendant that leaves it (setsid) is found by "
        "walking the process tree, best effort"
    )
    if mode == "off":
        return Check("cgroups", True, f'turned off (cgroup = "off"): {fallback}', warn=True)
    from nymph.cgroup import detect

    found = detect(None if mode == "auto" else mode)
    if found.tree is None:
        return Check("cgroups", mode == "auto", f"no task cgroups: {found.problem}; {fallback}", warn=True)
    from nymph.limits import detect as controllers

    held = controllers(found.tree.base)
    detail = f"each task gets its own cgroup v2 under {found.tree.base}; {held.describe()}"
    # no memory / pids controller: works, but a task can take the host's memory or process table
    return Check("cgroups", True, detail, warn=len(held.available) < 2)


def _directory(name: str, path: Path, private: str, min_free_mb: int = 0) -> Check:
    check = _directory_access(name, path, private)
    if not check.ok or not path.exists():
        return check
    free = os.statvfs(path)
    free_mb = free.f_bavail * free.f_frsize / 2**20
    if free_mb < min_free_mb:  # nymph would start, and claim nothing (docs/nymph.md "Full disks")
        return Check(
            name,
            False,
            f"{path} has {free_mb:.0f} MiB free, below --min-free-mb {min_free_mb}: nymph claims nothing "
            "until there is room; free some space or lower --min-free-mb",
        )
    return Check(name, True, f"{check.detail}, {free_mb:.0f} MiB free", warn=check.warn)


def _directory_access(name: str, path: Path, private: str) -> Check:
    """``private``: ``"traversable"`` (the workdir: 0711, task users enter it, nobody else lists
    it; readable by others is a warning) or ``"closed"`` (the state dir: 0700)."""
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), Path("/"))
        if os.access(parent, os.W_OK):
            return Check(name, True, f"{path} does not exist yet; nymph will create it")
        return Check(name, False, f"{path} does not exist and {parent} is not writable; create it")
    if not path.is_dir():
        return Check(name, False, f"{path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        return Check(name, False, f"{path} is not writable by uid {os.getuid()}; fix its owner or mode")
    mode = stat.S_IMODE(path.stat().st_mode)
    if private == "closed" and mode & stat.S_IROTH:
        return Check(name, False, f"{path} is readable by others (mode {mode:o}); run `chmod o-rwx {path}`")
    if private == "traversable" and mode & stat.S_IROTH:
        # each invocation's own directory is 0700: others can list the invocation ids, no more
        return Check(
            name,
            True,
            f"{path} (mode {mode:o}): other users can list its invocation ids; `chmod 711 {path}` "
            "keeps it enterable by task users and unlistable (never o-x: tasks must enter it)",
            warn=True,
        )
    return Check(name, True, f"{path} (mode {mode:o})")


def run_checks(cfg: NymphConfig, client: ControlPlaneClient | None = None) -> list[Check]:
    own = client is None
    client = client or ControlPlaneClient(cfg.server, cfg.token, timeout_s=10.0)
    try:
        checks = [_server(cfg, client)]
        checks.append(
            _token(cfg, client) if checks[0].ok else Check("token", False, "not checked: server unreachable")
        )
        runner_check, runner = _runner(cfg)
        checks.append(runner_check)
        try:
            checks.append(_task_user(cfg))
            checks.append(_task_setup(cfg, runner) if checks[-1].ok else _not_checked("task user"))
        finally:
            if runner is not None:
                runner.close()
        checks.append(_cgroups(cfg))
        checks.append(_directory("workdir", cfg.workdir, "traversable", min_free_mb=cfg.min_free_mb))
        checks.append(_directory("state-dir", cfg.state_dir, "closed", min_free_mb=cfg.min_free_mb))
        return checks
    finally:
        if own:
            client.close()


def _not_checked(why: str) -> Check:
    return Check("task-setup", False, f"not checked: the {why} check failed")


def report(checks: list[Check], echo: Callable[[str], Any] = print) -> bool:
    """Print one line per check; True when all passed."""
    for check in checks:
        mark = "FAIL" if not check.ok else "warn" if check.warn else "ok"
        echo(f"[{mark}] {check.name}: {check.detail}")
    failed = [c.name for c in checks if not c.ok]
    warned = [c.name for c in checks if c.ok and c.warn]
    note = f" ({len(warned)} warning(s): {', '.join(warned)})" if warned else ""
    echo(("all checks passed" + note) if not failed else f"{len(failed)} problem(s): {', '.join(failed)}")
    return not failed
