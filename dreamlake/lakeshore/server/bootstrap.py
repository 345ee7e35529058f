"""First start of an embedded control plane: mint an admin and a daemon token, say how to use them.

On a store with no tokens, ``bootstrap_tokens`` creates both, writes ``{"admin", "daemon"}`` to
``<data-dir>/tokens.json`` (mode 0600, created that way, never world-readable for a moment) and
returns the lines to print: the tokens, the ``export LAKESHORE_URL=... LAKESHORE_TOKEN=...`` lines
the SDK and the CLI read, and a ready ``NYMPH_TOKEN=... nymph start`` command for the README's
queue (the daemon token in nymph's environment: on its command line ``ps`` would show it). ``start_line`` is what every start
prints: where the server listens and where its tokens are.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dreamlake.lakeshore.store.api import Store

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.json"
NYMPH_QUEUE = "gpu"  # the queue of the printed nymph line: the README's example uses it


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the first byte (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def bootstrap_tokens(store: Store, data_dir: Path, server_url: str) -> list[str] | None:
    """Mint the first tokens when the store has none; None when it already has some."""
    if store.count_tokens() > 0:
        return None
    admin = store.create_token("admin", "bootstrap-admin")
    daemon = store.create_token("daemon", "bootstrap-daemon")
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / TOKENS_FILE
    write_private(path, json.dumps({"admin": admin, "daemon": daemon}, indent=2) + "\n")
    log.debug("minted the first admin and daemon tokens into %s", path)
    return [
        f"lakeshore: first start, minted tokens (also in {path}, mode 0600):",
        f"  admin token:  {admin}",
        f"  daemon token: {daemon}",
        "use it from Python and the lakeshore CLI (lakeshore queues, ls, show ...):",
        f"  export LAKESHORE_URL={server_url}",
        f"  export LAKESHORE_TOKEN={admin}",
        f"start a node agent for @dls.udf functions on queue '{NYMPH_QUEUE}' (the README's; add --queue "
        "NAME per queue; the token goes in the environment, never on nymph's command line):",
        f"  NYMPH_TOKEN={daemon} nymph start --server {server_url} --runner process --queue {NYMPH_QUEUE}",
    ]


def start_line(server_url: str, data_dir: Path) -> str:
    """What the server says on every start: where it listens and where its tokens are."""
    path = data_dir / TOKENS_FILE
    tokens = (
        f"tokens in {path}"
        if path.exists()
        else "tokens: mint them with `lakeshore token create --kind KIND --name NAME`"
    )
    return f"lakeshore server: listening on {server_url} (dashboard {server_url}/ui); {tokens}"
