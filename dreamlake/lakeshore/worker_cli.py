"""``lakeshore worker start``: run invocations of one queue in this process, against a control plane.

The click group ``worker`` is attached to the ``lakeshore`` console script by ``cli.py``. The
control plane is found as every ``lakeshore`` command finds it (``dreamlake.lakeshore.settings``):
``--url`` (``--server``) / ``--token`` over ``LAKESHORE_URL`` / ``LAKESHORE_TOKEN`` over the config
file; ``LAKESHORE_SERVER``, the variable of earlier versions, is read (with a deprecation warning)
when ``LAKESHORE_URL`` is unset (``envvars.DEPRECATED``).
"""

from __future__ import annotations

import logging
import sys
import threading

import click

__all__ = ["worker"]

log = logging.getLogger(__name__)


@click.group()
def worker() -> None:
    """Run invocations in this process (the SDK's worker; nymph is the production agent)."""


@worker.command("start")
@click.option(
    "--url",
    "--server",
    "server",
    default=None,
    help="Control plane URL (default: $LAKESHORE_URL, then the config file, as every lakeshore command).",
)
@click.option(
    "--token",
    default=None,
    help="A daemon (or admin) token (default: $LAKESHORE_TOKEN, then the config file).",
)
@click.option("--queue", "queue", default="default", show_default=True, help="The queue to claim from.")
@click.option(
    "--allow-pickled",
    is_flag=True,
    default=False,
    help="Run pickled functions (arbitrary code from the submitter); refused by default over HTTP.",
)
@click.option(
    "--runtime-policy",
    type=click.Choice(["strict", "minor", "off"]),
    default="minor",
    show_default=True,
    help="How closely a pickle's python/cloudpickle must match this worker's.",
)
@click.option("--once", is_flag=True, default=False, help="Run exactly one job, then exit.")
@click.option(
    "--poll-timeout",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Long-poll seconds.",
)
@click.option(
    "--prefetch",
    type=click.IntRange(min=1, max=256),
    default=1,
    show_default=True,
    help="Invocations claimed per poll and run one after another (more for many short calls).",
)
def start(
    server: str | None,
    token: str | None,
    queue: str,
    allow_pickled: bool,
    runtime_policy: str,
    once: bool,
    poll_timeout: float,
    prefetch: int,
) -> None:
    """Claim and run invocations of QUEUE until interrupted (or one, with --once)."""
    from dreamlake.lakeshore.dispatch.http import HttpDispatch
    from dreamlake.lakeshore.errors import LakeshoreError
    from dreamlake.lakeshore.queue import SyncQueue
    from dreamlake.lakeshore.settings import load
    from dreamlake.lakeshore.worker import run_worker

    try:
        server, token = load(server, token).require()
    except LakeshoreError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        plane = HttpDispatch(server, token)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    stop = threading.Event()
    try:
        state = run_worker(
            SyncQueue(queue, dispatch=plane),
            once=once,
            allow_pickled=allow_pickled,
            runtime_policy=runtime_policy,
            poll_timeout=poll_timeout,
            stop=stop,
            prefetch=prefetch,
        )
    except KeyboardInterrupt:
        stop.set()
        click.echo("worker stopped", err=True)
        return
    except LakeshoreError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        plane.close()
    if once:
        click.echo(state or "no job arrived")
        if state is None:
            sys.exit(3)
