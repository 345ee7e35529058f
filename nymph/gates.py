"""The worker-side gates an invocation passes before anything is written or spawned.

:meth:`nymph.job.Job.prepare` runs them in this order, each refusal a :class:`GateRefused` whose
``type`` is the acked error type: a sane ``timeout_s`` and ``script`` only with ``--allow-script``
(:func:`check_run_config`); for a Python function its envelope header, pickle only with
``--allow-pickled`` and its module in ``--allow-module`` (:func:`check_function`; the modules of a
shipped code archive too, :func:`shipped_refusal`); the ``as_user`` allow-list and that user on
this host (:func:`check_as_user`); who the task runs as, never root unless allowed
(:func:`check_run_as`, :mod:`nymph.taskuser`); and what the runner can honour: GPUs, ``image``,
``network``, resource limits (:func:`check_runner`).
"""

from __future__ import annotations

import pwd
from pathlib import Path
from typing import Any

from dreamlake.lakeshore.daemon.entry import module_allowed, module_refusal
from dreamlake.lakeshore.envelope import Envelope, is_pickled
from dreamlake.lakeshore.errors import LakeshoreError
from nymph import codecache, refs, taskuser
from nymph.config import NymphConfig
from nymph.errors import GateRefused
from nymph.runner import Runner
from nymph.slots import gpus_requested


def check_run_config(cfg: NymphConfig, bad_timeout: str | None, script: str | None) -> None:
    if bad_timeout:
        raise GateRefused("InvalidRunConfig", bad_timeout)
    if script is not None and not cfg.allow_script:
        raise GateRefused(
            "ScriptRefused",
            "script invocations are refused: this nymph runs only Python functions; start it with "
            "--allow-script to run run_config.script with bash (that is running any shell command "
            "its producers send)",
        )


def check_function(
    cfg: NymphConfig, staged: Path | None, body: dict[str, Any]
) -> tuple[dict[str, Any] | None, Any]:
    """The envelope's function passes pickle and module policy -> ``(cfg["code"], cfg["pip"])``:
    its shipped code archive and its pip environment (:mod:`nymph.callenv`), when it has them."""
    try:
        if staged is not None:
            header = refs.header_of(staged)
        else:
            header = Envelope.header(bytes(body.get("args_blob") or b""))
    except LakeshoreError as exc:
        raise GateRefused(type(exc).__name__, f"bad envelope: {exc}") from exc
    fn = header.get("fn") or {}
    code = (header.get("cfg") or {}).get("code")
    if code is not None and not isinstance(code, dict):
        raise GateRefused("CodeArchiveRefused", f"cfg.code must be a map, got {type(code).__name__}")
    pip = (header.get("cfg") or {}).get("pip")
    if is_pickled(fn) and not cfg.allow_pickled:
        raise GateRefused(
            "PickleRefused",
            f"pickled function {fn.get('where') or fn.get('qualname')!r} refused: "
            "this nymph runs only functions shipped by reference; start it with --allow-pickled "
            "to accept pickled functions (that is code execution)",
        )
    module = str(fn.get("module") or "")
    if not is_pickled(fn) and cfg.allow_modules and not module_allowed(module, cfg.allow_modules):
        raise GateRefused(
            "ModuleRefused", module_refusal(module, str(fn.get("qualname")), list(cfg.allow_modules))
        )
    return code, pip


def shipped_refusal(path: Path, patterns: list[str]) -> GateRefused | None:
    """The refusal of a shipped code archive (unpacked at ``path``) with a module the policy
    does not allow; None when every module it ships is allowed."""
    refused = [m for m in codecache.shipped_modules(path) if not module_allowed(m, patterns)]
    if not refused:
        return None
    return GateRefused(
        "ModuleRefused",
        f"the call ships code with module {refused[0]!r} (of {len(refused)} refused) but this "
        f"worker runs only modules matching {' / '.join(patterns)}; ship only allowed "
        f"packages (code=[...]), deploy the code instead (code=None), or start nymph with "
        f"--allow-module matching {refused[0]!r}",
    )


def check_as_user(cfg: NymphConfig, runner: Runner, as_user: str) -> None:
    if as_user not in cfg.allow_users:
        raise GateRefused(
            "UserNotAllowed",
            f"as_user {as_user!r} is not allowed on this nymph (allowed: "
            f"{', '.join(cfg.allow_users) or 'none'}); start it with --allow-user {as_user}",
        )
    if not runner.capabilities.as_user:
        raise GateRefused("RunnerCapabilityMissing", f"runner {runner.name!r} cannot run as another user")
    try:
        pwd.getpwnam(as_user)
    except KeyError:
        raise GateRefused(
            "UserNotAllowed",
            f"as_user {as_user!r} is allowed but is not a user on this host (its workdir is "
            f"owned by that user); create it with useradd",
        ) from None


def check_run_as(cfg: NymphConfig, runner: Runner, run_as: str | None, as_user: str | None) -> None:
    """Who the task runs as (``as_user``, else a task user nymph picked) is fine to run as."""
    refusal = taskuser.root_refusal(cfg, run_as)
    if refusal is not None:
        raise GateRefused("RootRefused", refusal)
    if run_as and not as_user:  # nymph is root: the task runs as its task user
        if not runner.capabilities.as_user:
            raise GateRefused(
                "RunnerCapabilityMissing",
                f"runner {runner.name!r} cannot run the task as the task user "
                f"{run_as!r}; start nymph with {taskuser.ROOT_FLAG} to run tasks as root",
            )
        try:
            pwd.getpwnam(run_as)
        except KeyError:
            raise GateRefused(
                "TaskUserMissing",
                f"task user {run_as!r} is not a user on this host (any more); create it with "
                f"`{taskuser.useradd_command(run_as)}`",
            ) from None


def check_runner(runner: Runner, run_config: dict[str, Any]) -> None:
    """The runner honours what ``run_config`` asks: GPUs, ``image``, ``network``, resource limits."""
    caps = runner.capabilities
    if gpus_requested(run_config) and not caps.gpus:
        raise GateRefused("RunnerCapabilityMissing", f"runner {runner.name!r} cannot expose GPUs")
    for key, needed in (("image", caps.image), ("network", caps.network)):
        if run_config.get(key) and not needed:
            raise GateRefused(
                "RunnerCapabilityMissing",
                f"runner {runner.name!r} does not honour run_config.{key}",
            )
    resources = run_config.get("resources") or {}
    limits = [k for k in resources if k != "gpus"] if isinstance(resources, dict) else []
    if limits and not caps.resources:
        raise GateRefused(
            "RunnerCapabilityMissing",
            f"runner {runner.name!r} does not enforce resource limits ({', '.join(sorted(limits))})",
        )
