"""The ``nymph`` console script: ``nymph start``, ``nymph doctor``, ``nymph runners``.

Configuration is resolved here, once (:func:`nymph.config.resolve`): flags over ``NYMPH_*``
environment over the TOML file named by ``--config``. Nothing else in nymph reads the environment
for settings.

A token given with ``--token`` is on the command line, where ``ps`` shows it to every local user:
``nymph start`` then re-executes itself at once (same PID) with the token moved to ``NYMPH_TOKEN``
(readable only by nymph's own user and root, and never passed to tasks) and a warning to use
``--token-file``. ``nymph start`` as root checks its task user first (:mod:`nymph.taskuser`), and
that the task user can run its tasks (:mod:`nymph.selfcheck`: the interpreter, the workdir, the
code cache); a problem stops it before it registers. ``nymph doctor`` runs the same checks and
registers nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import click

from dreamlake.lakeshore import __version__, tls
from nymph.config import NymphConfig, resolve
from nymph.errors import ConfigError, RunnerLoadError

ZYGOTES_MIN = 4  # the process runner's own default (nymph_process.forking.ZYGOTES_DEFAULT)


def _options(fn: Any) -> Any:
    opts = [
        click.option("--config", "config_file", type=click.Path(path_type=Path), help="TOML config file."),
        click.option("--server", help="Control plane URL (NYMPH_SERVER)."),
        click.option(
            "--token", help="Daemon token (NYMPH_TOKEN); shown by ps: prefer --token-file or NYMPH_TOKEN."
        ),
        click.option(
            "--token-file",
            type=click.Path(path_type=Path),
            help="File holding the daemon token (mode 0600 or 0400; NYMPH_TOKEN_FILE).",
        ),
        *tls.cli_options(),  # --ca-file, --client-cert, --client-key (LAKESHORE_CA_FILE, ...)
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
        click.option(
            "--warm/--no-warm",
            default=None,
            help="process runner: run trusted ref calls in long-lived warm workers (runner option warm).",
        ),
        click.option(
            "--warm-max-calls",
            type=int,
            help="process runner, --warm: recycle a warm worker after this many calls (0: never).",
        ),
        click.option("--queue", "queues", multiple=True, help="Queue to serve; repeatable."),
        click.option("--concurrency", type=int, help="Invocations run at once (slots)."),
        click.option("--workdir", type=click.Path(path_type=Path), help="Root of per-invocation workdirs."),
        click.option("--state-dir", type=click.Path(path_type=Path), help="Worker id and outbox."),
        click.option("--allow-pickled/--no-allow-pickled", default=None, help="Accept pickled functions."),
        click.option(
            "--allow-script/--no-allow-script",
            default=None,
            help="Run run_config.script (bash -c) invocations; off by default.",
        ),
        click.option(
            "--allow-exec/--no-allow-exec",
            default=None,
            help="Claim and run namespace exec jobs (bash -c, any command a producer sends); off by default.",
        ),
        click.option(
            "--allow-module",
            "allow_modules",
            multiple=True,
            metavar="PATTERN",
            help="Only run ref functions of modules matching PATTERN (fnmatch); repeatable.",
        ),
        click.option("--allow-user", "allow_users", multiple=True, help="User as_user may name; repeatable."),
        click.option(
            "--allow-pip/--no-allow-pip",
            default=None,
            help="Build the pip environments calls ask for (pip=..., with uv, as the task user); off by default.",
        ),
        click.option("--pip-index-url", help="Package index for pip environments (uv --index-url)."),
        click.option(
            "--pip-find-links",
            "pip_find_links",
            multiple=True,
            metavar="DIR|URL",
            help="Wheels for pip environments (uv --find-links); repeatable.",
        ),
        click.option(
            "--env-cache",
            type=click.Path(path_type=Path),
            help="Where pip environments are built (default {workdir}/.envs).",
        ),
        click.option(
            "--pass-env",
            "pass_env",
            multiple=True,
            metavar="NAME",
            help="Pass nymph's variable NAME to every task (tasks get a clean environment); repeatable.",
        ),
        click.option(
            "--mount",
            "mounts",
            multiple=True,
            metavar="NAME=/host/path[:ro]",
            help="A directory calls may ask for with mounts=[NAME]; repeatable.",
        ),
        click.option(
            "--task-user",
            help="Shared task user, and the prefix of the task user pool, of a root nymph (default nymph-task).",
        ),
        click.option(
            "--task-user-pool",
            type=int,
            help="process runner, root nymph: each task runs as its own user TASK_USER-0..N-1 (default 64; 0: none).",
        ),
        click.option(
            "--shared-task-user/--no-shared-task-user",
            default=None,
            help="Let tasks share the task user when the pool is missing or used up (no boundary between them).",
        ),
        click.option(
            "--allow-root-tasks/--no-allow-root-tasks",
            default=None,
            help="Let tasks run as root (nymph's own root, or as_user root); off by default.",
        ),
        click.option(
            "--task-memory-max",
            help="process runner: each task's memory.max unless it asks for less: a size or a share "
            "of the host ('90%', the default); 0: no cap.",
        ),
        click.option(
            "--task-pids-max",
            type=int,
            help="process runner: each task's pids.max unless it asks for less (default 4096; 0: no cap).",
        ),
        click.option("--label", "labels", multiple=True, help="k=v label of this worker; repeatable."),
        click.option("--namespace", help="Namespace this worker belongs to."),
        click.option(
            "--grace-s", type=float, help="Shutdown grace for running work; then it is acked preempted."
        ),
        click.option(
            "--checkpoint-max-mb",
            type=float,
            help="A task's dls.checkpoint_dir() is carried to the next attempt up to this size (default 1024).",
        ),
        click.option(
            "--drain-timeout",
            "drain_timeout_s",
            type=float,
            help="Drain (SIGUSR1, `nymph drain`): how long running work may finish (default: no bound).",
        ),
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
        click.option(
            "--stream-window-frames", type=int, help="A task pauses while this many frames are undelivered."
        ),
        click.option(
            "--stream-window-bytes", type=int, help="A task pauses while this many bytes are undelivered."
        ),
        click.option(
            "--stream-max-bytes", type=int, help="Undelivered stream bytes that fail an invocation."
        ),
        click.option("--stream-batch-frames", type=int, help="Frames per request at most."),
        click.option("--stream-batch-bytes", type=int, help="Bytes per request at most."),
        click.option(
            "--stream-log-max-bytes",
            type=int,
            help="stdout + stderr streamed per attempt (default 16 MiB); past it one line says truncated.",
        ),
        click.option(
            "--min-free-mb",
            type=int,
            help="No claims while the workdir's or state dir's filesystem has less free (default 100).",
        ),
        click.option(
            "--keep-failed-s",
            type=float,
            help="Failed workdirs (kept for their logs) are removed after this long (default 7 days).",
        ),
        click.option(
            "--keep-failed-mb",
            type=float,
            help="Failed workdirs are removed, oldest first, beyond this total size (default 1024).",
        ),
        click.option(
            "--stream-inotify/--no-stream-inotify",
            default=None,
            help="Notice journal writes with inotify (off: poll, for workdirs written from other hosts).",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _resolve(kwargs: dict[str, Any]) -> NymphConfig:
    config_file = kwargs.pop("config_file", None)
    warm_flags = _warm_flags(kwargs)
    try:
        cfg = resolve(kwargs, config_file=config_file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if warm_flags and cfg.runner != "process":
        raise click.UsageError(
            f"--warm and --warm-max-calls are modes of the process runner, not of {cfg.runner!r}; "
            "drop them, or run with --runner process"
        )
    opts = dict(cfg.runner_options)
    if cfg.runner == "process":  # the task cgroups' caps (nymph.limits); a runner option still wins
        opts.setdefault("memory", None if cfg.task_memory_max in ("", "0") else cfg.task_memory_max)
        opts.setdefault("pids", cfg.task_pids_max or None)
        # prefork's zygotes, one per namespace (and environment): one for each slot's task at least
        opts.setdefault("zygotes", max(ZYGOTES_MIN, cfg.concurrency))
        cfg = dataclasses.replace(cfg, runner_options=opts)
    if cfg.runner == "process" and opts.get("warm"):
        # one warm worker per slot: every slot's call finds one, none is kept beyond that
        opts.setdefault("warm_workers", cfg.concurrency)
        # a root nymph runs its tasks as its task user: its warm workers do too (an as_user task
        # stays cold, unless it names that same user)
        opts.setdefault("warm_users", [cfg.task_user])
        cfg = dataclasses.replace(cfg, runner_options=opts)
    return cfg


def _warm_flags(kwargs: dict[str, Any]) -> bool:
    """``--warm`` and ``--warm-max-calls N``: shorthands of the process runner's options ``warm``
    and ``warm_max_calls`` (``--runner-opt`` given for the same key still wins)."""
    warm, max_calls = kwargs.pop("warm", None), kwargs.pop("warm_max_calls", None)
    extra = [] if warm is None else [f"warm={'true' if warm else 'false'}"]
    if max_calls is not None:
        if max_calls < 0:
            raise click.UsageError(f"--warm-max-calls must be 0 (never recycle) or more, got {max_calls}")
        extra.append(f"warm_max_calls={max_calls}")
    if extra:
        kwargs["runner_opts"] = (*extra, *(kwargs.get("runner_opts") or ()))
    return bool(extra)


@click.group()
@click.version_option(__version__, "--version", "-V", prog_name="nymph", message="%(prog)s %(version)s")
def main() -> None:
    """nymph: the node agent that runs lakeshore invocations on this machine."""


@main.command()
@_options
def start(**kwargs: Any) -> None:
    """Register with the control plane and run invocations until SIGTERM."""
    if kwargs.get("token"):
        _reexec_without_token(kwargs["token"])
    cfg = _resolve(kwargs)
    from nymph.agent import Agent
    from nymph.observability import configure_logging
    from nymph.plugins import load_runner
    from nymph.selfcheck import task_setup_problems
    from nymph.taskuser import TaskUserError, check_task_user, nymph_is_root

    configure_logging(cfg.log_format, cfg.log_level)
    if cfg.log_level.upper() != "DEBUG":  # one line per poll is noise; our own lines say what matters
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        runner = load_runner(cfg.runner)(**dict(cfg.runner_options))
    except RunnerLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    except TypeError as exc:
        raise click.ClickException(f"runner {cfg.runner!r} rejects runner_options: {exc}") from exc
    try:
        check_task_user(cfg, runner)
    except TaskUserError as exc:
        runner.close()
        raise click.ClickException(str(exc)) from exc
    problems = task_setup_problems(cfg, runner)
    if problems:  # every task would fail later, with a misleading error: say it now, register nothing
        runner.close()
        raise click.ClickException("; ".join(problems) + " (`nymph doctor` runs the same checks)")
    if cfg.allow_root_tasks and nymph_is_root():
        logging.getLogger("nymph").warning(
            "--allow-root-tasks: tasks without as_user run as root on this host"
        )
    gpu_pool, gpu_total = _gpus()
    agent = Agent(cfg, runner, gpu_pool=gpu_pool, gpu_total=gpu_total)
    agent.install_signal_handlers()
    sys.exit(agent.run())


def strip_token(argv: list[str]) -> list[str]:
    """``argv`` without ``--token VALUE`` / ``--token=VALUE`` (after ``--``, nothing is touched)."""
    out: list[str] = []
    items = iter(argv)
    for arg in items:
        if arg == "--":
            out.append(arg)
            out.extend(items)
            break
        if arg == "--token":
            next(items, None)
            continue
        if arg.startswith("--token="):
            continue
        out.append(arg)
    return out


def _reexec_without_token(token: str) -> None:
    """Exec this command line again (same PID) with the token in ``NYMPH_TOKEN`` instead of argv."""
    import os

    from nymph.upgrade import reexec_argv

    argv = strip_token(reexec_argv())
    if argv == reexec_argv():  # the token came some other way click accepts: nothing to strip
        return
    click.echo(
        "nymph: --token puts the daemon token on the command line, where `ps` shows it to every "
        "local user; restarting without it. Use --token-file FILE or NYMPH_TOKEN instead.",
        err=True,
    )
    os.environ["NYMPH_TOKEN"] = token
    os.environ.pop("NYMPH_TOKEN_FILE", None)  # the flag won over it; one way of giving the token
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def _gpus() -> tuple[Any, int]:
    import os

    from nymph.gpus import GpuPool, discover_gpus

    gpus = discover_gpus(override=os.environ.get("NYMPH_GPUS"))
    return (GpuPool(gpus), len(gpus)) if gpus else (None, 0)


@main.command()
@_options
@click.option(
    "--fix", is_flag=True, help="Create what is missing that nymph can create (the task user pool)."
)
def doctor(fix: bool, **kwargs: Any) -> None:
    """Check the server, the token, the runner and the directories; say what to fix."""
    cfg = _resolve(kwargs)
    from nymph.doctor import fix_task_users, report, run_checks

    if fix:
        click.echo(fix_task_users(cfg))

    ok = report(run_checks(cfg), click.echo)
    sys.exit(0 if ok else 1)


@main.command()
@click.option(
    "--config", "config_file", type=click.Path(path_type=Path), help="TOML config file (its state_dir)."
)
@click.option("--state-dir", type=click.Path(path_type=Path), help="The running nymph's --state-dir.")
@click.option(
    "--drain-timeout",
    type=float,
    help="Running calls may finish for this long, then they are preempted (default: nymph's drain_timeout_s).",
)
@click.option("--wait/--no-wait", default=True, help="Wait until nymph exited (default) or return at once.")
def drain(config_file: Path | None, state_dir: Path | None, drain_timeout: float | None, wait: bool) -> None:
    """Drain this host's nymph: no new claims, running calls finish, then it exits 0."""
    from nymph import drain as draining
    from nymph.config import DEFAULT_STATE_DIR, load_file

    if drain_timeout is not None and not drain_timeout >= 0:
        raise click.UsageError(f"--drain-timeout must be a number of seconds >= 0, got {drain_timeout}")
    if state_dir is None:
        import os

        raw = os.environ.get("NYMPH_STATE_DIR") or (
            load_file(config_file).get("state_dir") if config_file else None
        )
        state_dir = Path(raw) if raw else DEFAULT_STATE_DIR
    assert state_dir is not None
    try:
        pid = draining.request(state_dir.absolute(), drain_timeout)
    except (draining.DrainError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"nymph (pid {pid}) is draining: no new claims; running calls finish")
    if wait:
        draining.wait_exit(pid, None)
        click.echo(f"nymph (pid {pid}) exited")


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
