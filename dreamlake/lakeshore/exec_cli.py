"""``lakeshore exec``: run a shell command on a nymph of a namespace and print its outcome
(:mod:`dreamlake.lakeshore.execs`): its stdout on stdout, its stderr on stderr, its typed result (what
it wrote to ``$LAKESHORE_RESULT``, decoded) as one line of JSON (``--result-only``: that line alone),
and the command's exit code as this one's."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from dreamlake.lakeshore.ops_cli import _jsonable, _settings, connection_options, guarded


@click.command("exec")
@connection_options
@click.option("--namespace", "-n", required=True, help="The namespace to run in (a namespace token's own).")
@click.option("--queue", "-q", default="default", show_default=True, help="The exec queue nymphs serve.")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Stop the command after this many s.")
@click.option(
    "--wait", type=float, default=300.0, show_default=True, help="How long to wait for the outcome."
)
@click.option("--result-only", is_flag=True, help="Print only the typed result (JSON).")
@click.argument("command", nargs=-1, required=True)
@guarded
def exec_command(
    url: str | None,
    token: str | None,
    namespace: str,
    queue: str,
    timeout_s: float | None,
    wait: float,
    result_only: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND (``bash -c``, on a nymph started with --allow-exec) and print its outcome."""
    from dreamlake.lakeshore.execs import Execs

    u, t = _settings(url, token)
    with Execs(u, t, namespace) as execs:
        outcome = execs.run(" ".join(command), queue=queue, timeout_s=timeout_s, wait=wait)
    if not result_only:
        sys.stdout.write(outcome.stdout)
        sys.stderr.write(outcome.stderr)
    if outcome.has_result:
        value: Any = _jsonable(outcome.result)
        click.echo(
            json.dumps(value, sort_keys=True)
            if result_only
            else f"result: {json.dumps(value, sort_keys=True)}"
        )
    sys.exit(outcome.exit_code if 0 <= outcome.exit_code < 256 else 1)
