"""What a task's environment is made of, the same on every runner (docs/nymph.md "Environments").

A task never inherits nymph's environment: a variable set for nymph (a cloud credential, a
database password) must not reach code a producer sent. A task's environment is, from lowest to
highest precedence:

1. the host base (:func:`host_base`, only for runners whose task runs on the host: process and
   slurm): ``PATH``, ``HOME``, ``LANG``, ``LANGUAGE``, ``LC_*``, ``TZ``, ``TMPDIR`` as nymph has them
   (a runner that becomes the task user resets ``HOME``, ``USER``, ``LOGNAME``, ``SHELL``); a
   container's come from its image;
2. nymph's own ``LAKESHORE_*`` variables (but ``LAKESHORE_TOKEN``: a task's credential is its own)
   and its CUDA / NVIDIA variables, and the operator's allow-list ``--pass-env NAME`` (repeatable):
   :func:`passed`;
3. the call's ``env`` (``@dls.udf(env={...})``, per call ``_env=``) and its secrets
   (``@dls.udf(secrets=[...])``): :func:`dreamlake.lakeshore.runenv.user_env` checks the names;
4. what nymph sets for the invocation (``LAKESHORE_INVOCATION_ID``, ``LAKESHORE_TOKEN``,
   ``LAKESHORE_CODE_PATH``, ``LAKESHORE_MOUNT_<NAME>``, ``CUDA_VISIBLE_DEVICES``, ...): a call
   cannot override them (a name starting with ``LAKESHORE_`` is refused in ``env``).

Both cached parts are recomputed only when ``os.environ`` changed (compared as its bytes: at C
speed, cheaper than one decode of every variable), so the per-task cost stays a dict copy.

Mounts (``--mount NAME=/host/path[:ro]``): :func:`parse_mount` reads one declaration;
:func:`mount_env_name` is the variable that names a mount's path inside the task.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import twoway
from dreamlake.lakeshore.daemon.entry import ALLOW_MODULES_ENV, CAPTURE_ENV
from dreamlake.lakeshore.runenv import mount_names, names, secret_names, user_env
from dreamlake.lakeshore.settings import TOKEN_FILE_ENV
from nymph import codecache
from nymph.errors import GateRefused
from nymph.flow import WINDOW_ENV
from nymph.mounts import parse_mount as parse_mount  # re-exported: the mount syntax lives there
from nymph.workdir import TOKEN

if TYPE_CHECKING:
    from nymph.config import NymphConfig

__all__ = [
    "call_env",
    "host_base",
    "invocation_env",
    "mount_env_name",
    "mounts_env",
    "names",
    "parse_mount",
    "passed",
    "user_env",
]

BASE_NAMES = frozenset(("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH"))
BASE_PREFIXES = ("LC_",)
PASSED_PREFIXES = ("LAKESHORE_", "CUDA_", "NVIDIA_")
NEVER_PASSED = frozenset(("LAKESHORE_TOKEN",))  # the task gets its own credential, never nymph's
MOUNT_ENV = "LAKESHORE_MOUNT_"

_cache: dict[Any, tuple[dict[bytes, bytes], dict[str, str]]] = {}


def _cached(key: Any, pick: Any) -> dict[str, str]:
    """``{name: value}`` of ``os.environ`` for which ``pick(name)``, recomputed when the environment changed."""
    raw = getattr(os.environ, "_data", None)  # CPython's mapping under os.environ
    seen = _cache.get(key)
    if seen is not None and raw is not None and seen[0] == raw:
        return seen[1]
    env = {k: v for k, v in os.environ.items() if pick(k)}
    if isinstance(raw, dict):
        _cache[key] = (dict(raw), env)
    return env


def host_base() -> dict[str, str]:
    """The host part of every host task's environment (see the module docstring). Do not modify."""
    return _cached("base", lambda k: k in BASE_NAMES or k.startswith(BASE_PREFIXES))


def passed(pass_env: Iterable[str] = ()) -> dict[str, str]:
    """nymph's ``LAKESHORE_*`` (less its token), CUDA and NVIDIA variables, and those ``pass_env``
    names, as nymph has them now. Do not modify the answer."""
    names = frozenset(pass_env)

    def pick(k: str) -> bool:
        return k in names or (k.startswith(PASSED_PREFIXES) and k not in NEVER_PASSED)

    return _cached(("passed", names), pick)


def mount_env_name(name: str) -> str:
    """``LAKESHORE_MOUNT_<NAME>``: the mount's name upper-cased, ``-`` as ``_``."""
    return MOUNT_ENV + name.upper().replace("-", "_")


def call_env(
    config: NymphConfig, run_config: Mapping[str, Any]
) -> tuple[dict[str, str], dict[str, tuple[str, bool]]]:
    """A call's ``run_config.env`` checked and the mounts it asks for, resolved against this
    nymph's ``--mount`` declarations: ``(env, {name: (path, read_only)})``. GateRefused
    (``InvalidRunConfig``, ``MountRefused``) before anything runs, with what to do."""
    try:
        env = user_env(run_config.get("env"))
        secret_names(run_config.get("secrets"))  # their values land here too (callenv)
        wanted = mount_names(run_config.get("mounts"))
    except ValueError as exc:
        raise GateRefused("InvalidRunConfig", str(exc)) from None
    unknown = [m for m in wanted if m not in config.mounts]
    if unknown:
        offered = ", ".join(sorted(config.mounts)) or "none"
        raise GateRefused(
            "MountRefused",
            f"mount {unknown[0]!r} is not offered by this worker (its mounts: {offered}); ask for one "
            f"of those, or have the operator start nymph with --mount {unknown[0]}=/host/path[:ro]",
        )
    return env, {m: config.mounts[m] for m in wanted}


def mounts_env(mounts: Mapping[str, tuple[str, bool]]) -> dict[str, str]:
    """``LAKESHORE_MOUNT_<NAME>``: each mount's host path (a container runner rewrites it)."""
    return {mount_env_name(name): path for name, (path, _ro) in mounts.items()}


def invocation_env(
    cfg: NymphConfig,
    invocation_id: str,
    attempt: int,
    run_config: dict[str, Any],
    *,
    token: bool,
    code_dirs: list[Path],
    gpus: list[str] | None,
) -> dict[str, str]:
    """What nymph sets for the invocation (the top layer: a call cannot override it). ``token``:
    the task has its own credential in the workdir; ``gpus``: its ``CUDA_VISIBLE_DEVICES`` (None:
    leave it unset, a host with no GPUs nymph manages)."""
    env = {
        "LAKESHORE_ALLOW_PICKLED": "1" if cfg.allow_pickled else "0",
        ALLOW_MODULES_ENV: ",".join(cfg.allow_modules),
        "LAKESHORE_RUNTIME_POLICY": cfg.runtime_policy,
        "LAKESHORE_INVOCATION_ID": invocation_id,
        "LAKESHORE_ATTEMPT": str(attempt),  # dls.attempt()
        WINDOW_ENV: cfg.stream_limits.env,
        # the entry appends its fd 1/2 to the workdir's logs (every runner: the pump streams
        # them live as LOG frames); Python processes the task starts write through too
        CAPTURE_ENV: "1",
        "PYTHONUNBUFFERED": "1",
    }
    if token:
        # the task's own credential (submit children, read and cancel its descendants; it dies
        # with this attempt's ack): dls .submit() / SyncQueue inside the task use these two. The
        # token is in a file only the task's user reads (workdir.TOKEN), not in the environment
        # every child inherits; the variable names it relative to the workdir, the task's cwd
        # (the entry makes it absolute before the user's code runs)
        env["LAKESHORE_URL"] = cfg.task_url or cfg.server
        env[TOKEN_FILE_ENV] = TOKEN
    if os.environ.get("PYTHONPATH"):  # absolute: the task's cwd is not nymph's (a zygote runs in /)
        parts = os.environ["PYTHONPATH"].split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p for p in parts)
    env.update(codecache.code_env(code_dirs))  # first on the task's import path
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if run_config.get("two_way"):  # the entry waits at each yield for its send
        env[twoway.SENDS_ENV] = f"{twoway.timeout_of(run_config):g}"
    return env
