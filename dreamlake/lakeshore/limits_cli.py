"""``lakeshore queue limit NAME --max-running N`` (or ``--clear``): a queue's fleet-wide limit.

At most N calls of the queue run at once across every nymph and every control-plane replica
(enforced in the claim transaction, docs/protocol.md "Placement"); the others stay ``queued``
and ``lakeshore show`` says why. ``lakeshore queues`` shows each queue's limit. Needs an admin
token: a queue's limit holds back every namespace's calls of it.
"""

from __future__ import annotations

import click

from dreamlake.lakeshore.ops_cli import _client, _echo_json, connection_options, guarded


@click.group("queue")
def queue() -> None:
    """One queue's settings."""


@queue.command("limit")
@connection_options
@click.argument("name")
@click.option(
    "--max-running",
    type=click.IntRange(0, 2**31 - 1),
    default=None,
    help="Calls of the queue running at once, fleet-wide (0 holds them all queued).",
)
@click.option("--clear", is_flag=True, help="Remove the queue's limit.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@guarded
def limit(
    url: str | None, token: str | None, name: str, max_running: int | None, clear: bool, as_json: bool
) -> None:
    """Cap how many calls of queue NAME run at once across the fleet (--max-running N), or lift
    the cap (--clear)."""
    if clear == (max_running is not None):
        raise click.UsageError("give one of --max-running N or --clear")
    with _client(url, token) as client:
        out = client.set_queue_limit(name, None if clear else max_running)
    if as_json:
        _echo_json(out)
        return
    most = out.get("max_running")
    click.echo(f"queue {name}: " + ("no limit" if most is None else f"at most {most} running at once"))
