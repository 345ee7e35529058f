"""``lakeshore secret set|ls|rm``: a namespace's secrets (server/secrets.py), from the shell.

``set NAME VALUE`` (or ``--from-file F``, or the value typed at a hidden prompt / piped on stdin,
which keeps it out of the shell's history and ``ps``), ``ls`` (names and when they were set,
never values), ``rm NAME``. The namespace is the token's; an admin token names one with
``--namespace`` (default ``default``). Connection settings as every operator command:
``--url`` / ``--token``, else ``LAKESHORE_URL`` / ``LAKESHORE_TOKEN``, else the config file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from dreamlake.lakeshore.ops_cli import _client, connection_options, guarded, table

_namespace_option = click.option(
    "--namespace", "-n", default=None, help="The namespace (default: the token's; an admin's: default)."
)


def _namespace(client: Any, namespace: str | None) -> str:
    if namespace:
        return namespace
    return str(client.whoami().get("namespace") or "default")


@click.group()
def secret() -> None:
    """A namespace's secrets: values tasks get in their environment by name (secrets=[...])."""


@secret.command("set")
@connection_options
@_namespace_option
@click.argument("name")
@click.argument("value", required=False)
@click.option(
    "--from-file", "from_file", type=click.Path(path_type=Path, dir_okay=False), help="Read the value from F."
)
@guarded
def secret_set(
    url: str | None,
    token: str | None,
    namespace: str | None,
    name: str,
    value: str | None,
    from_file: Path | None,
) -> None:
    """Set secret NAME to VALUE (or --from-file F, or the hidden prompt / stdin)."""
    if value is not None and from_file is not None:
        raise click.UsageError("give VALUE or --from-file, not both")
    if from_file is not None:
        value = from_file.read_text()
    elif value is None:
        value = click.prompt(f"value of {name}", hide_input=True) if sys.stdin.isatty() else sys.stdin.read()
    with _client(url, token) as client:
        ns = _namespace(client, namespace)
        client.secret_set(ns, name, value)
    click.echo(f"secret {name} set in namespace {ns}")


@secret.command("ls")
@connection_options
@_namespace_option
@guarded
def secret_ls(url: str | None, token: str | None, namespace: str | None) -> None:
    """List the namespace's secrets (names and when they were set; never values)."""
    with _client(url, token) as client:
        rows = client.secret_names(_namespace(client, namespace))
    when = [time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["updated_at"])) for r in rows]
    click.echo(table(["NAME", "SET"], [[r["name"], w] for r, w in zip(rows, when, strict=True)]))


@secret.command("rm")
@connection_options
@_namespace_option
@click.argument("name")
@guarded
def secret_rm(url: str | None, token: str | None, namespace: str | None, name: str) -> None:
    """Remove secret NAME (calls naming it are refused from then on)."""
    with _client(url, token) as client:
        ns = _namespace(client, namespace)
        client.secret_remove(ns, name)
    click.echo(f"secret {name} removed from namespace {ns}")
