"""A copy of the database alone mints nothing: the control plane's HMAC keys live outside it.

The attacker holds a read-only copy of the SQLite store of a running ``lakeshore server`` (a
backup, a stolen volume snapshot) and a running invocation's id, and tries to mint that
invocation's task token. The keys are in ``server-keys.json`` beside the store (0600), so the copy
holds no key, not even in its freed pages, and a token minted from the copy is refused (401).
Keys an older version kept in the ``server_keys`` table move out into the file at the first start.
"""

from __future__ import annotations

import shutil
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.task_tokens import KEY_NAME, TaskTokens
from dreamlake.lakeshore.store import open_store
from dreamlake.lakeshore.store.keys import ENV_KEY, FILE_NAME, KeyConfigError, KeyRing
from tests.integration.conftest import submit_body
from tests.security.conftest import Stack


@pytest.fixture(scope="module")
def keyfile_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The README stack as an operator runs it: no key in the environment, so the file beside the store."""
    s = Stack(tmp_path_factory.mktemp("keys") / "data")
    s.env.pop(ENV_KEY, None)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _running_task_token(stack: Stack) -> tuple[str, str]:
    """Submit, claim: (the invocation id, the task token its run command carries)."""
    queue = f"q{new_ulid().lower()[-8:]}"
    producer = stack.token("producer", f"p{queue}", "--namespace", "team-a")
    inv = new_ulid()
    assert stack.call("/v1/producer/submit", submit_body(inv, queue), producer)[0] == 200
    body = {"worker_id": new_ulid(), "queues": [queue], "timeout_s": 5}
    assert stack.call("/v1/daemon/register", body, stack.daemon)[0] == 200
    status, out = stack.call("/v1/daemon/poll", body, stack.daemon)
    assert status == 200
    return inv, out["commands"][0]["body"]["task_token"]


def test_a_copy_of_the_database_holds_no_key_and_mints_no_task_token(
    keyfile_stack: Stack, tmp_path: Path
) -> None:
    stack = keyfile_stack
    inv, real = _running_task_token(stack)
    assert stack.json("GET", "/v1/ops/whoami", None, real)[0] == 200  # the genuine token works
    keyfile = stack.data_dir / FILE_NAME
    assert stat.S_IMODE(keyfile.stat().st_mode) == 0o600
    ring = KeyRing.from_file(keyfile)
    secrets_ = [
        ring.key(KEY_NAME),
        ring.key("payload-urls"),
        bytes.fromhex(keyfile.read_text().split('"master": "')[1][:64]),
    ]

    # the attacker's copy: every file of the store (the WAL too), nothing else
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in stack.data_dir.iterdir():
        if f.name.startswith("lakeshore.db"):
            shutil.copy(f, copy / f.name)
    raw = b"".join(f.read_bytes() for f in copy.iterdir())
    for secret in secrets_:
        assert secret not in raw and secret.hex().encode() not in raw
    db = next(copy.glob("lakeshore.db")) if any(copy.glob("lakeshore.db")) else next(copy.glob("*.db"))
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT count(*) FROM server_keys").fetchone() == (0,)

    # what the copy yields (its own fresh key file) mints a token the server refuses
    opened = open_store(str(db))
    try:
        forged = TaskTokens(opened.server_key(KEY_NAME)).mint(inv, 1, "team-a", time.time() + 600)
    finally:
        opened.close()
    status, out = stack.json("GET", "/v1/ops/whoami", None, forged)
    assert status == 401, out


def test_keys_of_an_older_version_move_out_of_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    db = tmp_path / "lakeshore.db"
    open_store(str(db)).close()
    legacy = bytes(range(32))
    with sqlite3.connect(db) as conn:  # as the version before kept it
        conn.execute(
            "INSERT INTO server_keys (name, secret, created_at) VALUES (?, ?, 0)", (KEY_NAME, legacy)
        )
    store = open_store(str(db))
    try:
        assert store.server_key(KEY_NAME) == legacy  # tokens in flight stay valid
        assert store.server_key("payload-urls") != legacy
    finally:
        store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM server_keys").fetchone() == (0,)
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("lakeshore.db*"))
    assert legacy not in raw  # secure_delete overwrote the row's page
    assert KeyRing.from_file(tmp_path / FILE_NAME).key(KEY_NAME) == legacy


def test_postgresql_without_a_key_refuses_to_start_saying_what_to_set() -> None:
    with pytest.raises(KeyConfigError, match=r"LAKESHORE_SERVER_KEY.*same on every replica"):
        KeyRing.resolve({}, dialect="postgresql", db_file=None)
    with pytest.raises(KeyConfigError, match="at least 32"):
        KeyRing.resolve({ENV_KEY: "short"}, dialect="postgresql", db_file=None)
    one = KeyRing.resolve({ENV_KEY: "r" * 40}, dialect="postgresql", db_file=None)
    two = KeyRing.resolve({ENV_KEY: "r" * 40}, dialect="postgresql", db_file=None)
    assert one.key("secrets") == two.key("secrets") != one.key(KEY_NAME)  # replicas agree
