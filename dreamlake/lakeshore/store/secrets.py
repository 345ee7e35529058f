"""A namespace's secrets, as the store keeps them: sealed bytes only.

The control plane seals each value (server/secrets.py: AES-GCM under ``server_key("secrets")``,
the namespace and name as associated data) before it reaches here, and opens it only for the
task of a running attempt that asked for it; this table never sees a plain value. ``put_secret``
upserts, ``secret_names`` lists a namespace's names (never values), ``sealed_secrets`` reads the
sealed bytes of some names, ``delete_secret`` removes one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import sqlalchemy as sa

from . import schema as t
from .base import StoreBase


class SecretStore(StoreBase):
    def put_secret(self, namespace: str, name: str, sealed: bytes) -> None:
        s = t.secrets
        now = time.time()
        with self.db.tx(write=True) as conn:
            conn.execute(
                self._insert(s)
                .values(namespace=namespace, name=name, sealed=sealed, updated_at=now)
                .on_conflict_do_update(
                    index_elements=[s.c.namespace, s.c.name], set_={"sealed": sealed, "updated_at": now}
                )
            )

    def secret_names(self, namespace: str) -> list[tuple[str, float]]:
        """``(name, updated_at)`` of the namespace's secrets, by name."""
        s = t.secrets
        with self.db.tx(write=False) as conn:
            rows = conn.execute(
                sa.select(s.c.name, s.c.updated_at).where(s.c.namespace == namespace).order_by(s.c.name)
            ).all()
        return [(str(name), float(at)) for name, at in rows]

    def sealed_secrets(self, namespace: str, names: Iterable[str]) -> dict[str, bytes]:
        """The sealed bytes of those of ``names`` the namespace has (the others are absent)."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        s = t.secrets
        with self.db.tx(write=False) as conn:
            rows = conn.execute(
                sa.select(s.c.name, s.c.sealed).where(s.c.namespace == namespace, s.c.name.in_(wanted))
            ).all()
        return {str(name): bytes(sealed) for name, sealed in rows}

    def delete_secret(self, namespace: str, name: str) -> bool:
        s = t.secrets
        with self.db.tx(write=True) as conn:
            gone = conn.execute(sa.delete(s).where(s.c.namespace == namespace, s.c.name == name)).rowcount
        return bool(gone)
