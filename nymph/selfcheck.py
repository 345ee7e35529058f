"""What nymph checks of its own set-up before it registers; ``nymph doctor`` runs the same checks.

A root nymph runs its tasks as its task user(s) (:func:`nymph.taskuser.task_users`: a user of the
task user pool per task, or the one shared task user). Every task
then needs, as that user: to enter the workdir (``{workdir}/{invocation_id}`` is the task's, but
its parent is nymph's) and the code cache (code shipped with a call), and, for the process runner,
to run the tasks' interpreter, read its standard library and import the entry. When any of that
fails, every task would fail later with a misleading error (an unreadable standard library reads as
``cloudpickle is not installed``, an unreachable workdir as ``cannot import module``). So
:func:`task_setup_problems`, called by ``nymph start`` before it registers and by ``nymph doctor``:

- walks each path the task user needs (for the runners whose tasks use host paths: process,
  slurm), component by component, with the user's uid and groups against each directory's owner,
  group and mode bits, and names the first it cannot enter;
- runs the runner's interpreter as the task user (``runuser -u USER -- python -c ...``) with the
  tasks' ``PYTHONPATH``, importing the standard library, the entry and (with ``--allow-pickled``)
  cloudpickle; when that fails, the path it could not read is named (the interpreter's own
  ``sys.path``, as nymph sees it, walked the same way), else its error.

Each problem is one sentence that names the user, the path and the fix.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
from collections.abc import Iterable
from pathlib import Path

from nymph.config import NymphConfig
from nymph.runner import Runner
from nymph.taskuser import task_users

PROBE_TIMEOUT_S = 60.0
# Runners whose tasks reach the workdir and the code cache by their host paths, every directory on
# the way (a container runner mounts the task's own directories: the parents do not matter there).
HOST_PATH_RUNNERS = ("process", "slurm")
ENTRY_MODULE = "dreamlake.lakeshore.daemon.entry"
# Modules of the standard library every task imports (the entry's own imports, a sample of them).
STDLIB_PROBE = ("encodings", "json", "traceback", "importlib.util", "zipfile")
INTERPRETER_FIX = (
    "install nymph system-wide, or give the runner an interpreter it can run "
    "(--runner-opt python=/usr/bin/python3 with --runner-opt pythonpath=[the entry bundle]; "
    "docs/nymph.md, 'Who a task runs as')"
)


def _who(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _may(st: os.stat_result, pw: pwd.struct_passwd, groups: set[int], bits: int) -> bool:
    """Whether ``pw`` has ``bits`` (a combination of 4 = read, 2 = write, 1 = search/execute) on a
    file with ``st``, by its mode bits (as the kernel decides it, ACLs aside)."""
    if pw.pw_uid == 0:
        return True
    if st.st_uid == pw.pw_uid:
        mode = (st.st_mode >> 6) & 7
    elif st.st_gid in groups:
        mode = (st.st_mode >> 3) & 7
    else:
        mode = st.st_mode & 7
    return mode & bits == bits


def _components(path: Path) -> list[Path]:
    path = Path(os.path.abspath(path))
    return [*reversed(path.parents), path]


def blocked(path: Path, pw: pwd.struct_passwd, *, read: bool = False) -> str | None:
    """Why ``pw`` cannot reach ``path`` (search every directory on the way; with ``read``, also
    read it), naming the first path in the way with its mode and owner; None when it can.

    Both the path as written and its symbolic links resolved are walked. A ``path`` that does not
    exist yet is checked up to its nearest existing parent (nymph creates the rest, traversable)."""
    groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
    for walk in (_components(path), _components(Path(os.path.realpath(path)))):
        for i, part in enumerate(walk):
            try:
                st = os.stat(part)
            except FileNotFoundError:
                break  # nymph makes the rest (mode 0711)
            except OSError:
                continue
            last = i == len(walk) - 1
            need = 1 if stat.S_ISDIR(st.st_mode) else 0
            if last and read:
                need |= 4
            if need and not _may(st, pw, groups, need):
                what = "read" if last and read else "enter"
                return (
                    f"task user {pw.pw_name} cannot {what} {part} (mode {stat.S_IMODE(st.st_mode):04o}, "
                    f"owner {_who(st.st_uid)}:{_group(st.st_gid)})"
                )
    return None


def _directory_problem(name: str, path: Path, pw: pwd.struct_passwd) -> str | None:
    why = blocked(path, pw)
    if why is None:
        return None
    return (
        f"{why}, so it cannot reach the {name} {path}: make every directory on the way searchable "
        f"by it (`chmod o+x` or `chmod 711`; nymph makes its own 0711), or choose a {name} it can reach"
    )


def _runs_interpreter(runner: Runner) -> tuple[str, str | None, str] | None:
    """``(python, pythonpath, runuser)`` of a runner that runs the tasks' interpreter on this host
    as the task user (the process runner); None for runners whose tasks run elsewhere (a container
    image, a Slurm node)."""
    python = getattr(runner, "python", None)
    if runner.name != "process" or not isinstance(python, str):
        return None
    pythonpath = getattr(runner, "pythonpath", None)
    return (
        python,
        pythonpath if isinstance(pythonpath, str) else None,
        str(getattr(runner, "runuser", "runuser")),
    )


def _tasks_pythonpath(pythonpath: str | None) -> str:
    return pythonpath if pythonpath is not None else os.environ.get("PYTHONPATH", "")


def _probe_script(modules: Iterable[str]) -> str:
    imports = "; ".join(f"import {m}" for m in modules)
    return f"import sys; {imports}; sys.stdout.write('ok')"


def _sys_path(python: str, pythonpath: str) -> list[str]:
    """The interpreter's ``sys.path`` as nymph (root) sees it: where the task user must read."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('\\n'.join(sys.path))"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=env,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [p for p in out.stdout.splitlines() if p]


def _interpreter_problem(cfg: NymphConfig, runner: Runner, pw: pwd.struct_passwd) -> str | None:
    runs = _runs_interpreter(runner)
    if runs is None:
        return None
    python, pythonpath, runuser = runs
    why = blocked(Path(python), pw, read=True)
    if why is not None:
        return f"{why}, so it cannot run the tasks' interpreter {python}: {INTERPRETER_FIX}"
    path = _tasks_pythonpath(pythonpath)
    modules = [*STDLIB_PROBE, ENTRY_MODULE, *(["cloudpickle"] if cfg.allow_pickled else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NYMPH_", "LAKESHORE_"))}
    env["PYTHONPATH"] = path
    cmd = [runuser, "-u", pw.pw_name, "--", python, "-c", _probe_script(modules)]
    try:
        probe = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env, cwd="/")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run the tasks' interpreter as task user {pw.pw_name} ({' '.join(cmd[:5])}): {exc}"
    if probe.returncode == 0 and probe.stdout.endswith("ok"):
        return None
    for entry in _sys_path(python, path):
        why = blocked(Path(entry), pw, read=True)
        if why is not None:
            return f"{why} on the tasks' sys.path, so its tasks cannot import from it: {INTERPRETER_FIX}"
    detail = (probe.stderr or probe.stdout).strip().splitlines()
    last = detail[-1] if detail else f"exit code {probe.returncode}"
    return (
        f"task user {pw.pw_name} cannot import {', '.join(modules[len(STDLIB_PROBE) :])} with {python} "
        f"(PYTHONPATH={path or '(none)'}): {last}; install dreamlake-lakeshore where that interpreter "
        "finds it, or set the runner's pythonpath"
    )


def task_setup_problems(cfg: NymphConfig, runner: Runner) -> list[str]:
    """What keeps this nymph's task user(s) from running its tasks (empty: nothing); see the module
    docstring. Tasks that run as nymph's own user (a nymph not run as root) need no check. Every
    user of a pool is walked; the interpreter runs once per set of groups (users alike, as a pool
    made by one rule is, read the same files: a pool of 32 starts no 32 interpreters); the first
    user with a problem is reported (the fix is the same for the others)."""
    probed: set[frozenset[int]] = set()
    for name in task_users(cfg).users():  # the pool's users, and the shared one
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue  # check_task_user says so, with the useradd command
        checks: list[str | None] = []
        if runner.name in HOST_PATH_RUNNERS:
            checks += [
                _directory_problem("workdir", cfg.workdir, pw),
                _directory_problem("code cache", cfg.code_cache_dir, pw),
            ]
        groups = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
        if not any(checks) and groups not in probed:
            probed.add(groups)
            checks.append(_interpreter_problem(cfg, runner, pw))
        problems = [c for c in checks if c]
        if problems:
            return problems
    return []
