"""The ``nymph`` console script: ``nymph start``, ``nymph doctor``, ``nymph runners``.

Configuration is resolved here, once (:func:`nymph.config.resolve`): flags over ``NYMPH_*``
environment over the TOML file named by ``--config``. Nothing else in nymph reads the environment
for settings.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from nymph.config import NymphConfig, resolve
from nymph.errors import ConfigError, RunnerLoadError


def _options(fn: Any) -> Any:
    opts = [
        click.option("--config", "config_file", type=click.Path(path_type=Path), help="TOML config file."),
        click.option("--server", help="Control plane URL (NYMPH_SERVER)."),
        click.option("--token", help="Daemon token (NYMPH_TOKEN)."),
        click.option(
            "--task-url",
            help="The control plane's URL as tasks reach it: LAKESHORE_URL inside a task (default: --server).",
        ),
        click.option("--runner", help="Runner plugin name (default: process)."),
        click.option(
            "--runner-opt",
            "runner_opts",
            multiple=True,
            metavar="KEY=VALUE",
            help="Runner keyword option (VALUE read as TOML when it is, else a string); repeatable.",
        ),
        click.option("--queue", "queues", multiple=True, help="Queue to serve; repeatable."),
        click.option("--concurrency", type=int, help="Invocations run at once (slots)."),
        click.option("--workdir", type=click.Path(path_type=Path), help="Root of per-invocation workdirs."),
        click.option("--state-dir", type=click.Path(path_type=Path), help="Worker id and outbox."),
        click.option("--allow-pickled/--no-allow-pickled", default=None, help="Accept pickled functions."),
        click.option("--allow-user", "allow_users", multiple=True, help="User as_user may name; repeatable."),
        click.option("--label", "labels", multiple=True, help="k=v label of this worker; repeatable."),
        click.option("--namespace", help="Namespace this worker belongs to."),
        click.option("--grace-s", type=float, help="Shutdown grace for running work."),
        click.option(
            "--stop-grace-s", type=float, help="Grace between SIGTERM and SIGKILL on cancel/timeout."
        ),
        click.option("--heartbeat-s", type=float, help="Heartbeat period (default: the server's)."),
        click.option("--poll-timeout-s", type=float, help="Long-poll timeout."),
        click.option("--metrics-port", type=int, help="Serve /healthz and /metrics on this port."),
        click.option("--metrics-host", help="Address for --metrics-port (default 127.0.0.1)."),
        click.option("--log-format", type=click.Choice(["text", "json"]), help="Log format."),
        click.option("--log-level", help="Log level (INFO, DEBUG, ...)."),
        click.option(
            "--auto-upgrade/--no-auto-upgrade", default=None, help="Install a pinned version and re-exec."
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _resolve(kwargs: dict[str, Any]) -> NymphConfig:
    config_file = kwargs.pop("config_file", None)
    try:
        return resolve(kwargs, config_file=config_file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


@click.group()
def main() -> None:
    """nymph: the node agent that runs lakeshore invocations on this machine."""


@main.command()
@_options
def start(**kwargs: Any) -> None:
    """Register with the control plane and run invocations until SIGTERM."""
    cfg = _resolve(kwargs)
    from nymph.agent import Agent
    from nymph.observability import configure_logging
    from nymph.plugins import load_runner

    configure_logging(cfg.log_format, cfg.log_level)
    if cfg.log_level.upper() != "DEBUG":  # one line per poll is noise; our own lines say what matters
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        runner = load_runner(cfg.runner)(**dict(cfg.runner_options))
    except RunnerLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    except TypeError as exc:
        raise click.ClickException(f"runner {cfg.runner!r} rejects runner_options: {exc}") from exc
    gpu_pool, gpu_total = _gpus()
    agent = Agent(cfg, runner, gpu_pool=gpu_pool, gpu_total=gpu_total)
    agent.install_signal_handlers()
    sys.exit(agent.run())


def _gpus() -> tuple[Any, int]:
    import os

    from nymph.gpus import GpuPool, discover_gpus

    gpus = discover_gpus(override=os.environ.get("NYMPH_GPUS"))
    return (GpuPool(gpus), len(gpus)) if gpus else (None, 0)


@main.command()
@_options
def doctor(**kwargs: Any) -> None:
    """Check the server, the token, the runner and the directories; say what to fix."""
    cfg = _resolve(kwargs)
    from nymph.doctor import report, run_checks

    ok = report(run_checks(cfg), click.echo)
    sys.exit(0 if ok else 1)


@main.command()
def runners() -> None:
    """List the registered runner plugins and whether each can work on this host."""
    from nymph.plugins import list_runners

    infos = list_runners()
    if not infos:
        click.echo("no runner plugins registered (entry-point group nymph.runners)")
        return
    for info in infos:
        dist = f"{info.distribution} {info.version}" if info.distribution else "?"
        state = "usable" if info.usable else f"NOT usable: {info.problem}"
        click.echo(f"{info.name:10} {dist:28} {state}")
