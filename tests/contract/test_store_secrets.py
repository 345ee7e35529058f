"""The secrets table on every store (SQLite file and memory, PostgreSQL): sealed bytes kept per
(namespace, name), upserted, listed by name without them, read by name, removed; a namespace never
sees another's. Sealing itself (AES-GCM under the server key) is server/secrets.py's, tested from
the attacker's side in tests/security/test_secrets.py."""

from __future__ import annotations

import pytest

from dreamlake.lakeshore.server.secrets import Sealer
from dreamlake.lakeshore.store.sql import SqlStore


def test_secrets_are_kept_per_namespace_and_name(store: SqlStore) -> None:
    store.put_secret("team-a", "HF_TOKEN", b"sealed-1")
    store.put_secret("team-a", "DB_URL", b"sealed-2")
    store.put_secret("team-b", "HF_TOKEN", b"sealed-b")
    store.put_secret("team-a", "HF_TOKEN", b"sealed-1-again")  # upsert
    assert [n for n, _ in store.secret_names("team-a")] == ["DB_URL", "HF_TOKEN"]
    assert store.sealed_secrets("team-a", ["HF_TOKEN", "NOPE"]) == {"HF_TOKEN": b"sealed-1-again"}
    assert store.sealed_secrets("team-b", ["HF_TOKEN", "DB_URL"]) == {"HF_TOKEN": b"sealed-b"}
    assert store.sealed_secrets("team-c", ["HF_TOKEN"]) == {} and store.secret_names("team-c") == []
    assert store.delete_secret("team-a", "HF_TOKEN") and not store.delete_secret("team-a", "HF_TOKEN")
    assert store.sealed_secrets("team-b", ["HF_TOKEN"]) == {"HF_TOKEN": b"sealed-b"}  # theirs stays


def test_a_sealed_value_opens_only_under_its_namespace_and_name(store: SqlStore) -> None:
    sealer = Sealer(store.server_key("secrets"))
    sealed = sealer.seal("team-a", "HF_TOKEN", "hf_value")
    assert (
        b"hf_value" not in sealed and sealer.seal("team-a", "HF_TOKEN", "hf_value") != sealed
    )  # fresh nonce
    store.put_secret("team-a", "HF_TOKEN", sealed)
    got = store.sealed_secrets("team-a", ["HF_TOKEN"])["HF_TOKEN"]
    assert sealer.open("team-a", "HF_TOKEN", got) == "hf_value"
    for ns, name in (("team-b", "HF_TOKEN"), ("team-a", "OTHER")):  # a row moved elsewhere does not open
        with pytest.raises(ValueError, match="does not open"):
            sealer.open(ns, name, got)
