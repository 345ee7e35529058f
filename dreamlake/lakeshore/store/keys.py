"""The control plane's secret keys, kept outside the database.

``Store.server_key(name)`` is the one way to a key (the task-token HMAC key ``task-token``, the blob
URL key ``payload-urls``, the stored-secrets key ``secrets``). Each is derived from one master
secret, ``HMAC-SHA256(master, "lakeshore/server-key/" + name)``, so naming a new key writes
nothing, and every replica holding the same master derives the same keys. The master lives where a
copy of the database does not reach it:

=============================== =================================================================
``LAKESHORE_SERVER_KEY``        the master as text (at least 32 characters; a mounted secret's
                                content); the same on every replica
``LAKESHORE_SERVER_KEY_FILE``   a JSON file ``{"master": "<hex>"}`` (0600), made on first use
                                when missing; the same file on every replica (a mounted secret)
(neither, SQLite file)          ``server-keys.json`` next to the database file, made on first use
(neither, ``:memory:``)         a fresh master for this process (nothing to share)
(neither, PostgreSQL)           refused: replicas must share the master, so set one of the two
=============================== =================================================================

Before this module the keys were rows of the ``server_keys`` table. The first ``server_key`` call
of an upgraded store moves them out (:meth:`KeyRing.adopt`): into the key file when there is one
(``{"keys": {name: hex}}``, which take precedence over derivation, so tokens and URLs in flight
stay valid), and deletes the rows (SQLite with ``secure_delete``, so the bytes are overwritten).
With ``LAKESHORE_SERVER_KEY`` the old keys are dropped: tokens of running tasks and presigned
blob URLs minted before the upgrade answer 401/403 and are minted again by their next claim or
presign. Rotation is the same move: see docs/security.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.errors import LakeshoreError

log = logging.getLogger(__name__)

ENV_KEY = "LAKESHORE_SERVER_KEY"
ENV_FILE = "LAKESHORE_SERVER_KEY_FILE"
FILE_NAME = "server-keys.json"
MIN_SECRET = 32
_LABEL = b"lakeshore/server-key/"


class KeyConfigError(LakeshoreError):
    """The keys cannot be had as configured; the message says what to set."""


class KeyRing:
    """A master secret and the keys adopted from the database, by name (see the module docstring)."""

    def __init__(
        self, master: bytes, pinned: Mapping[str, bytes] | None = None, path: Path | None = None
    ) -> None:
        if len(master) < MIN_SECRET:
            raise KeyConfigError(f"a server master key needs at least {MIN_SECRET} bytes")
        self._master = master
        self._pinned = dict(pinned or {})
        self.path = path  # the key file, when the master came from one
        self._lock = threading.Lock()

    def key(self, name: str) -> bytes:
        """The 32-byte key ``name``."""
        found = self._pinned.get(name)
        if found is not None:
            return found
        return hmac.new(self._master, _LABEL + name.encode(), hashlib.sha256).digest()

    def adopt(self, legacy: Mapping[str, bytes]) -> None:
        """Keep ``legacy`` keys (the old ``server_keys`` rows) under their names: written into the
        key file when there is one (a name it has already keeps its value), else dropped."""
        if not legacy:
            return
        with self._lock:
            if self.path is None:
                log.warning(
                    "dropped %d server key(s) from the database (%s): tokens of tasks running and blob "
                    "URLs presigned before this start are refused and minted again",
                    len(legacy),
                    ", ".join(sorted(legacy)),
                )
                return
            fresh = {n: v for n, v in legacy.items() if n not in self._pinned}
            if not fresh:
                return
            doc = _read(self.path)
            keys = dict(doc.get("keys") or {})
            for name, value in fresh.items():
                keys.setdefault(name, value.hex())
            doc["keys"] = keys
            _write(self.path, doc, replace=True)
            self._pinned.update({n: bytes.fromhex(v) for n, v in keys.items()})
            log.info("moved %d server key(s) out of the database into %s", len(fresh), self.path)

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, *, dialect: str, db_file: Path | None) -> KeyRing:
        """The key ring the environment (``env``, default ``os.environ``) and the store's kind call for
        (the module's table)."""
        text = envvars.raw(ENV_KEY, env)
        if text:
            if len(text.strip()) < MIN_SECRET:
                raise KeyConfigError(
                    f"{ENV_KEY} is {len(text.strip())} characters long; use at least {MIN_SECRET} random "
                    "characters (e.g. the output of: openssl rand -hex 32), the same on every replica"
                )
            return cls(hashlib.sha256(text.strip().encode()).digest())
        raw = envvars.string(ENV_FILE, env)
        if raw:
            return cls.from_file(Path(raw).expanduser())
        if db_file is not None:
            return cls.from_file(db_file.parent / FILE_NAME)
        if dialect == "postgresql":
            raise KeyConfigError(
                f"a PostgreSQL store needs its server key outside the database: set {ENV_KEY} (at least "
                f"{MIN_SECRET} random characters, e.g. openssl rand -hex 32) or {ENV_FILE} (a file, made "
                "on first use), the same on every replica"
            )
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_file(cls, path: Path) -> KeyRing:
        """The ring of the key file ``path``, made (0600, a fresh master) when missing."""
        try:
            doc = _read(path)
        except FileNotFoundError:
            doc = {"version": 1, "master": secrets.token_hex(32), "keys": {}}
            try:
                _write(path, doc, replace=False)
                log.info("made the server key file %s (0600): keep it, and back it up with the store", path)
            except FileExistsError:  # another process made it first: use theirs
                doc = _read(path)
            except OSError as exc:
                raise KeyConfigError(f"cannot make the server key file {path}: {exc}") from None
        try:
            master = bytes.fromhex(str(doc["master"]))
            pinned = {str(n): bytes.fromhex(str(v)) for n, v in dict(doc.get("keys") or {}).items()}
        except (KeyError, ValueError, TypeError) as exc:
            raise KeyConfigError(
                f"the server key file {path} is malformed ({type(exc).__name__}): restore it from a backup, "
                'or write {"master": "<64 hex characters>"} (which invalidates tokens and URLs in flight)'
            ) from None
        return cls(master, pinned, path)


def _read(path: Path) -> dict[str, Any]:
    if path.exists() and path.stat().st_mode & 0o077:
        log.warning("the server key file %s is readable by others: chmod 600 it", path)
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        raise KeyConfigError(f"the server key file {path} is not JSON: restore it from a backup") from None
    if not isinstance(doc, dict):
        raise KeyConfigError(f"the server key file {path} is not a JSON object: restore it from a backup")
    return doc


def _write(path: Path, doc: dict[str, Any], *, replace: bool) -> None:
    """Write ``doc`` to ``path`` (0600): atomically by rename when ``replace``, else only if absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(doc, indent=1) + "\n").encode()
    target = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp") if replace else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    if replace:
        try:
            os.replace(target, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
