"""First start of an embedded control plane: mint an admin and a daemon token, say how to use them.

On a store with no tokens, ``bootstrap_tokens`` creates both, writes ``{"admin", "daemon"}`` to
``<data-dir>/tokens.json`` (mode 0600, created that way, never world-readable for a moment) and
returns the lines to print, among them a ready ``nymph start`` command.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dreamlake.lakeshore.store.api import Store

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.json"


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
    log.info("minted the first admin and daemon tokens into %s", path)
    return [
        f"lakeshore: first start, minted tokens (also in {path}, mode 0600):",
        f"  admin token:  {admin}",
        f"  daemon token: {daemon}",
        "start a node agent with:",
        f"  nymph start --server {server_url} --token {daemon} --runner process --queue default",
    ]
