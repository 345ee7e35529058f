"""The payload store without a bucket: a private blob directory served by the control plane itself.

Seed 003 puts payloads over ``INLINE_THRESHOLD_BYTES`` in S3 behind presigned URLs. The embedded
control plane (``lakeshore server`` on its SQLite file, no ``LAKESHORE_BLOBS_BUCKET``) has no S3,
so :class:`BlobDir` plays the bucket's part with the same wire: the presign route answers
``{url, bucket: "local", key, expires_at}`` exactly as it does for S3, and the URL points at the
control plane's own ``PUT`` / ``GET /v1/blobs/<key>``. Clients (``dreamlake.lakeshore.blobs``)
therefore use one flow for both tiers.

The URLs are signed like S3's: ``?expires=<unix s>&size=<n>[&sha256=<hex>]&sig=<hex>`` where
``sig`` is HMAC-SHA256, under a key every replica shares (``server_key(KEY_NAME)``, see
``server/keys.py``), of the method, the key, the expiry and (for a PUT) the exact size, content
type and, when the presign named it, the sha256 of the bytes. The route refuses (403) a URL whose
signature does not match, one past its expiry (``PAYLOAD_PRESIGN_TTL_S``, 900 s), an upload whose
``Content-Length`` differs from the signed size (411 without one), and one whose bytes do not hash
to the signed sha256, so the size cap of seed 003 holds twice here too. A key once uploaded is
never overwritten with other bytes (409; the same bytes again answer 200): a URL replayed later
changes nothing. The bytes stream to a temp file and are renamed into place once complete and
flushed: a reader never sees half a blob.

Layout: ``<root>/payloads/<namespace>/<YYYY>/<MM>/<DD>/<job_id>/<kind>`` (the key, checked by
:func:`~.payloads.check_key`), directories 0700 and files 0600, owned by the control plane's user;
the default root is ``blobs/`` next to the SQLite file (``LAKESHORE_BLOBS_DIR`` sets another).
Blobs older than ``LAKESHORE_BLOBS_RETENTION_S`` (default 7 days) are removed by :meth:`prune`,
which the app runs hourly, as an S3 lifecycle rule would.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.server.payloads import (
    PayloadConfig,
    PayloadError,
    check_digests,
    check_key,
    check_put,
    mint_key,
)

log = logging.getLogger(__name__)

KEY_NAME = "payload-urls"  # the server_keys row whose secret signs blob URLs
BUCKET = "local"  # the ``bucket`` a presign answer names for this tier
ROUTE = "/v1/blobs/"
TMP_DIR = ".tmp"
DEFAULT_RETENTION_S = 7 * 86400
_VERSION = "lakeshore-blob-v1"


def _iso_utc(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _private_dir(path: Path) -> None:
    """``path`` and every missing parent, each 0700 (``mkdir(parents=True)`` gives parents the
    default mode); an existing ``path`` others can enter is narrowed to 0700."""
    if not path.parent.is_dir():
        _private_dir(path.parent)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


class BlobDir:
    """Presigned URLs onto a local directory (see the module docstring). Same presign methods as
    :class:`~.payloads.PayloadStore`; ``base_url`` is the control plane as the caller reached it."""

    bucket = BUCKET

    def __init__(
        self,
        root: str | Path,
        config: PayloadConfig,
        secret: bytes,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("BlobDir needs a secret of at least 16 bytes to sign its URLs")
        self.root = Path(root)
        self.config = config
        self.retention_s = retention_s
        self._secret = secret
        _private_dir(self.root)
        _private_dir(self.root / TMP_DIR)

    @classmethod
    def for_store(cls, store: Any, env: Mapping[str, str] | None, config: PayloadConfig) -> BlobDir | None:
        """The blob directory of ``store``: ``LAKESHORE_BLOBS_DIR`` when set, else ``blobs/`` next to
        a SQLite file; None for an in-memory store or PostgreSQL without ``LAKESHORE_BLOBS_DIR``
        (replicas share no directory: configure a bucket)."""
        raw = envvars.string("LAKESHORE_BLOBS_DIR", env)
        retention = envvars.number(
            "LAKESHORE_BLOBS_RETENTION_S", env, default=float(DEFAULT_RETENTION_S), positive=True
        )
        db = getattr(store, "db", None)
        url = str(getattr(db, "url", ""))
        if raw:
            root = Path(raw).expanduser()
        elif url.startswith("sqlite:///") and not getattr(db, "memory", False):
            root = Path(url[len("sqlite:///") :]).parent / "blobs"
        else:
            return None
        return cls(root, config, store.server_key(KEY_NAME), retention_s=retention)

    # -- presign -----------------------------------------------------------------------------------

    def _sign(
        self,
        method: str,
        key: str,
        expires: int,
        size: int | None,
        content_type: str | None,
        sha256: str | None = None,
    ) -> str:
        message = "\n".join([_VERSION, method, key, str(expires), "" if size is None else str(size)])
        message += "\n" + (content_type or "")
        if sha256 is not None:  # (a URL without one signs exactly what it signed before)
            message += "\nsha256:" + sha256
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()

    def _url(
        self,
        base_url: str,
        method: str,
        key: str,
        size: int | None = None,
        content_type: str | None = None,
        sha256: str | None = None,
    ) -> dict[str, str]:
        expires = int(time.time()) + self.config.presign_ttl_s
        query: dict[str, str] = {"expires": str(expires)}
        if size is not None:
            query["size"] = str(size)
        if content_type is not None:
            query["type"] = content_type
        if sha256 is not None:
            query["sha256"] = sha256
        query["sig"] = self._sign(method, key, expires, size, content_type, sha256)
        url = f"{base_url.rstrip('/')}{ROUTE}{quote(key)}?{urlencode(query)}"
        return {"url": url, "bucket": BUCKET, "key": key, "expires_at": _iso_utc(expires)}

    def presign_put(
        self,
        namespace: str,
        size: int,
        content_type: str | None = None,
        job_id: str | None = None,
        kind: str = "args",
        *,
        base_url: str = "",
        sha256: str | None = None,
        md5: str | None = None,
    ) -> dict[str, str]:
        """A URL that accepts one upload of exactly ``size`` bytes (of ``sha256``, when given) to
        a freshly minted key of ``namespace``; ``md5`` is checked as S3 would, then not signed
        (the sha256 binds the bytes here)."""
        check_put(self.config, size, content_type)
        check_digests(sha256, md5)
        key = mint_key(namespace, job_id, kind)
        log.info("presigned local PUT ns=%s key=%s size=%d", namespace, key, size)
        return self._url(base_url, "PUT", key, size, content_type, sha256)

    def presign_get(self, key: str, *, base_url: str = "") -> dict[str, str]:
        """A URL that downloads ``key`` (under ``payloads/``) until it expires."""
        return self._url(base_url, "GET", check_key(key))

    # -- the blob route's side -----------------------------------------------------------------------

    def verify(
        self, method: str, key: str, query: Mapping[str, str]
    ) -> tuple[int | None, str | None, str | None]:
        """Check a request's signed query -> (signed size or None, signed content type or None,
        signed sha256 or None).

        PayloadError 403 for a missing, malformed, mismatched or expired signature; 400 for a key
        outside ``payloads/``."""
        key = check_key(key)
        again = "presign again: POST /v1/namespaces/:ns/payloads/presign"
        try:
            expires = int(query["expires"])
            size = int(query["size"]) if "size" in query else None
            sig = query["sig"]
        except (KeyError, ValueError):
            raise PayloadError(403, f"blob URL is not presigned (expires, sig): {again}") from None
        content_type = query.get("type")
        sha256 = query.get("sha256")
        want = self._sign(method, key, expires, size, content_type, sha256)
        if not hmac.compare_digest(want, sig):
            raise PayloadError(403, f"blob URL signature does not match this request: {again}")
        if time.time() >= expires:
            raise PayloadError(403, f"blob URL expired at {_iso_utc(expires)}: {again}")
        return size, content_type, sha256

    def path(self, key: str) -> Path:
        """Where ``key``'s bytes live (the key is checked: no way out of the root)."""
        return self.root.joinpath(*check_key(key).split("/"))

    def open_upload(self) -> tuple[int, Path]:
        """A new private temp file for an upload: (fd, path)."""
        tmp = self.root / TMP_DIR / f"{secrets.token_hex(12)}.part"
        flags = (
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
        return os.open(tmp, flags, 0o600), tmp

    def commit(self, fd: int, tmp: Path, key: str, sha256: str) -> None:
        """Flush ``fd``, close it and move the temp file (whose bytes hash to ``sha256``) to
        ``key``, atomically: all or nothing. A key that holds other bytes already is not
        overwritten (PayloadError 409); the same bytes again change nothing."""
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        final = self.path(key)
        _private_dir(final.parent)
        try:
            os.link(tmp, final)  # never replaces: the first upload of a key is the one
        except FileExistsError:
            with open(final, "rb") as f:
                same = hashlib.file_digest(f, "sha256").hexdigest() == sha256
            if not same:
                raise PayloadError(
                    409, f"{key} was uploaded already, with other bytes: presign a new key to upload"
                ) from None
        finally:
            tmp.unlink(missing_ok=True)

    def prune(self, now: float | None = None) -> int:
        """Remove blobs (and stale temp files) older than the retention; the number removed."""
        cutoff = (now if now is not None else time.time()) - self.retention_s
        removed = 0
        for dirpath, _dirnames, filenames in os.walk(self.root, topdown=False):
            for name in filenames:
                path = Path(dirpath, name)
                try:
                    if path.lstat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
                except FileNotFoundError:
                    continue
            here = Path(dirpath)
            if here != self.root and here.name != TMP_DIR and not any(here.iterdir()):
                try:
                    here.rmdir()
                except OSError:
                    pass
        if removed:
            log.info("pruned %d blob(s) older than %.0f s from %s", removed, self.retention_s, self.root)
        return removed
