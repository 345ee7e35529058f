"""An invocation's environment beyond its code: its pip environment, secrets, variables and mounts.

One :class:`CallEnv` per :class:`nymph.job.Job`, used in the job's steps (docs/nymph.md
"Environments"):

- :meth:`CallEnv.gate` (with the other worker-side gates, before anything is written): a
  ``cfg["pip"]`` only with ``--allow-pip`` and a runner that can build one (``PipRefused``,
  ``RunnerCapabilityMissing``); ``run_config.env`` checked and ``run_config.mounts`` resolved
  against the operator's ``--mount`` declarations (``InvalidRunConfig``, ``MountRefused``);
- :meth:`CallEnv.fetch_secrets`: the values of ``run_config.secrets``, read with the daemon token
  for the attempt this worker holds (``SecretRefused``), kept in memory for the task's environment
  only, never logged;
- :meth:`CallEnv.build`: the pip environment, built once per lock on this host as the task's user
  (:mod:`nymph.envcache`, ``EnvBuildFailed``), held until :meth:`CallEnv.release`;
- :meth:`CallEnv.variables`: the passed variables, the call's env and secrets and the mounts'
  ``LAKESHORE_MOUNT_<NAME>``, under which the job sets its own (:mod:`nymph.taskenv`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore.client import retrying
from dreamlake.lakeshore.errors import LakeshoreError
from nymph import envcache, taskenv
from nymph.errors import GateRefused

if TYPE_CHECKING:
    from nymph.config import NymphConfig
    from nymph.lifecycle import JobContext

FETCH_ATTEMPTS = 4  # reads of the secrets while the control plane is unreachable


class CallEnv:
    """The environment one invocation asked for (see the module docstring)."""

    def __init__(self) -> None:
        self.pip: dict[str, Any] | None = None  # cfg["pip"] of the Envelope
        self.held: str | None = None  # the sha256 of the pip environment held in the cache
        self.values: dict[str, str] = {}  # run_config.env, then the secrets' values
        self.mounts: dict[str, tuple[str, bool]] = {}  # name -> (host path or pvc:CLAIM, read_only)

    def gate(self, ctx: JobContext, pip: Any, run_config: Mapping[str, Any]) -> None:
        """Refuse what this worker cannot give the call; ``pip`` is ``cfg["pip"]`` (None for a script)."""
        if pip is not None:
            if not ctx.config.allow_pip:
                raise GateRefused(
                    "PipRefused",
                    "the call asks for a pip environment (pip=... / requirements=...) but this worker "
                    "builds none: run it where nymph was started with --allow-pip, or use an image "
                    "that has the packages (image=...)",
                )
            if not callable(getattr(ctx.runner, "pip_interpreter", None)):
                raise GateRefused(
                    "RunnerCapabilityMissing",
                    f"runner {ctx.runner.name!r} cannot give a task a pip environment; use an image "
                    "that has the packages",
                )
            self.pip = pip
        self.values, self.mounts = taskenv.call_env(ctx.config, run_config)

    def fetch_secrets(self, ctx: JobContext, invocation_id: str, attempt: int, names: Any) -> None:
        if not names:
            return
        client = ctx.client
        if client is None:
            raise GateRefused("SecretRefused", "the call names secrets but this nymph has no control plane")
        body = {"invocation_id": invocation_id, "attempt": attempt, "worker_id": ctx.worker_id}
        try:
            values = retrying(attempts=FETCH_ATTEMPTS, initial_s=0.5)(client.secrets, body)
        except LakeshoreError as exc:
            raise GateRefused(
                "SecretRefused", f"the secrets {', '.join(map(str, names))} could not be read: {exc}"
            ) from exc
        self.values.update(values)

    def build(self, ctx: JobContext, run_config: Mapping[str, Any], run_as: str | None) -> Path | None:
        """The pip environment's directory (built if new, as ``run_as``), held; None when none."""
        if self.pip is None:
            return None
        interp = ctx.runner.pip_interpreter(run_config)  # type: ignore[attr-defined]
        path = cache(ctx.config).acquire(self.pip, interp, run_as)
        self.held = path.name
        return path

    def hold(self, config: NymphConfig, sha256: Any) -> None:
        """Hold the environment a re-attached task runs from (named in its workdir's record)."""
        if isinstance(sha256, str) and cache(config).hold(sha256):
            self.held = sha256

    def release(self, config: NymphConfig) -> None:
        if self.held is not None:
            cache(config).release(self.held)
            self.held = None

    def variables(self, config: NymphConfig) -> dict[str, str]:
        """The task's variables of this layer (nymph.taskenv), under the job's own."""
        env = dict(taskenv.passed(config.pass_env))
        env.update(self.values)
        env.update(taskenv.mounts_env(self.mounts))
        return env


def cache(config: NymphConfig) -> envcache.EnvCache:
    """This nymph's pip-environment cache (one per process and root)."""
    return envcache.shared(
        config.env_cache_dir,
        max_bytes=config.env_cache_max_bytes,
        max_age_s=config.env_cache_max_age_s,
        index_url=config.pip_index_url,
        find_links=config.pip_find_links,
    )
