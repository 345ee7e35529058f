"""docs/deploy.md, tested: backup and restore of each store and of the blob directory, and upgrades
across the migrations from the oldest one with data in it (issue 35, item 8).

Every test runs the real ``lakeshore server`` (a subprocess, as systemd runs it) and the commands
the guide prints, literally: ``sqlite3 ... ".backup ..."`` against a running server (SQLite's online
backup), ``tar`` of the blob directory, ``pg_dump -Fc`` / ``pg_restore`` into a database of another
name. A restore counts when the restored server answers the invocations, their results and the
blobs it held before, to the same tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.store.engine import HEAD_REVISION, MIGRATIONS_DIR
from dreamlake.lakeshore.store.workers import _sha256
from tests.conftest import require
from tests.contract.conftest import pg_database
from tests.integration.conftest import submit_body
from tests.security.conftest import Stack

RESULT = {"top": [9, 7, 5], "note": "restored"}
BLOB = os.urandom(4096)


def _stack(data_dir: Path, db: str | None = None) -> Stack:
    s = Stack(data_dir)
    if db is not None:
        s.env["LAKESHORE_DB"] = db
        s.env["LAKESHORE_BLOBS_DIR"] = str(data_dir / "blobs")  # PostgreSQL: the blobs need a home
    return s


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    started: list[Stack] = []
    yield started
    for s in started:
        s.stop()


def _run(*cmd: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr}"
    return out.stdout


def _fill(s: Stack) -> dict[str, Any]:
    """What an operator must get back: a finished call with its result, a queued one, a blob."""
    producer = s.token("producer", "restore-check")
    done, queued = new_ulid(), new_ulid()
    for inv in (done, queued):
        status, out = s.call("/v1/producer/submit", submit_body(inv, "gpu"), producer)
        assert status == 200, out
    worker = new_ulid()
    assert s.call("/v1/daemon/register", {"worker_id": worker, "queues": ["gpu"]}, s.daemon)[0] == 200
    _, out = s.call("/v1/daemon/poll", {"worker_id": worker, "queues": ["gpu"], "timeout_s": 0}, s.daemon)
    assert [c["body"]["invocation_id"] for c in out["commands"]] == [done]  # oldest first
    ack = {"invocation_id": done, "state": "succeeded", "result_blob": wire.pack(RESULT),
           "error": None, "worker_id": worker, "attempt": 1}  # fmt: skip
    assert s.call("/v1/daemon/ack", ack, s.daemon)[0] == 200
    status, put = s.json(
        "POST", "/v1/namespaces/default/payloads/presign", {"op": "put", "size": len(BLOB)}, producer
    )
    assert status == 200, put
    assert httpx.put(put["url"], content=BLOB, timeout=30).status_code in (200, 201, 204)
    return {"producer": producer, "done": done, "queued": queued, "key": put["key"]}


def _check(s: Stack, f: dict[str, Any]) -> None:
    status, out = s.call("/v1/producer/await", {"invocation_id": f["done"], "timeout_s": 0}, f["producer"])
    assert status == 200 and out["state"] == "succeeded", out
    assert wire.unpack(out["result_blob"]) == RESULT
    status, out = s.call(f"/v1/producer/invocations/{f['queued']}", None, f["producer"], method="GET")
    assert status == 200 and out["state"] == "queued", out
    status, get = s.json(
        "POST", "/v1/namespaces/default/payloads/presign", {"op": "get", "key": f["key"]}, f["producer"]
    )
    assert status == 200, get
    assert httpx.get(get["url"], timeout=30).content == BLOB


def test_sqlite_online_backup_and_blob_directory_restore(tmp_path: Path, stacks: list[Stack]) -> None:
    require(shutil.which("sqlite3") is not None, "the sqlite3 command: apt-get install sqlite3")
    data, backup = tmp_path / "data", tmp_path / "backup"
    backup.mkdir()
    s = _stack(data).start()
    stacks.append(s)
    f = _fill(s)
    # docs/deploy.md, "Backup": while the server runs
    _run("sqlite3", str(data / "lakeshore.db"), f".backup '{backup / 'lakeshore.db'}'")
    _run("tar", "-C", str(data), "-czf", str(backup / "blobs.tar.gz"), "blobs")
    shutil.copy2(data / "tokens.json", backup / "tokens.json")
    s.stop()
    shutil.rmtree(data)  # the disk is gone

    # docs/deploy.md, "Restore": into an empty data directory, then start the server
    data.mkdir(mode=0o700)
    shutil.copy2(backup / "lakeshore.db", data / "lakeshore.db")
    _run("tar", "-C", str(data), "-xzf", str(backup / "blobs.tar.gz"))
    shutil.copy2(backup / "tokens.json", data / "tokens.json")
    restored = _stack(data).start()
    stacks.append(restored)
    _check(restored, f)


def test_postgresql_dump_and_restore_into_another_database(tmp_path: Path, stacks: list[Stack]) -> None:
    require(shutil.which("pg_dump") is not None, "pg_dump and pg_restore: apt-get install postgresql-client")
    data, backup = tmp_path / "data", tmp_path / "backup"
    backup.mkdir()
    with pg_database() as source, pg_database() as target:
        s = _stack(data, source).start()
        stacks.append(s)
        f = _fill(s)
        dump = backup / "lakeshore.dump"
        _run("pg_dump", "--format=custom", "--no-owner", f"--file={dump}", _libpq(source))
        _run("tar", "-C", str(data), "-czf", str(backup / "blobs.tar.gz"), "blobs")
        s.stop()
        _run("pg_restore", "--no-owner", "--exit-on-error", f"--dbname={_libpq(target)}", str(dump))
        shutil.rmtree(data / "blobs")
        _run("tar", "-C", str(data), "-xzf", str(backup / "blobs.tar.gz"))
        restored = _stack(data, target).start()  # the same data dir: its tokens.json; the new database
        stacks.append(restored)
        _check(restored, f)
        restored.stop()


def _libpq(url: str) -> str:
    """The SQLAlchemy URL as pg_dump takes it (no ``+psycopg`` driver suffix)."""
    return url.replace("postgresql+psycopg://", "postgresql://")


# --- upgrades from the oldest migration ------------------------------------------------------------


def _at_oldest_revision(url: str, admin: str, daemon: str) -> dict[str, str]:
    """A store at migration 0001 (the first release's schema) with data in it, written as that
    release wrote it: tokens, a finished invocation with its result, a queued one, a worker."""
    from alembic import command
    from alembic.config import Config

    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    done, queued, worker = new_ulid(), new_ulid(), new_ulid()
    now = time.time()
    rows = {
        "inv": (
            "INSERT INTO invocations (invocation_id, queue, state, priority, function_key, function, args_blob,"
            " run_config, code_context, namespace, content_hash, attempt, max_attempts, worker_id, submitted_at,"
            " started_at, finished_at, result_blob, cancel_requested) VALUES (:id, 'gpu', :state, 0, 'f',"
            " '{}', :args, '{\"queue\": \"gpu\"}', '{}', 'default', :id, :attempt, 3, :worker, :at, :started,"
            " :finished, :result, false)"
        ),
        "token": (
            "INSERT INTO tokens (token_id, secret_sha256, kind, namespace, name, created_at)"
            " VALUES (:id, :sha, :kind, NULL, :name, :at)"
        ),
    }
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        conn.execute(sa.text("INSERT INTO queues (name, created_at) VALUES ('gpu', :at)"), {"at": now})
        for inv, state, attempt, result in (
            (done, "succeeded", 1, wire.pack(RESULT)),
            (queued, "queued", 0, None),
        ):
            ran = state == "succeeded"
            conn.execute(
                sa.text(rows["inv"]),
                {"id": inv, "state": state, "args": b"\x90", "attempt": attempt, "worker": worker if ran else None,
                 "at": now - 60, "started": now - 30 if ran else None, "finished": now - 20 if ran else None,
                 "result": result},
            )  # fmt: skip
        for kind, secret in (("admin", admin), ("daemon", daemon)):
            conn.execute(sa.text(rows["token"]), {"id": new_ulid(), "sha": _sha256(secret), "kind": kind,
                                                   "name": f"old-{kind}", "at": now})  # fmt: skip
        conn.execute(
            sa.text(
                "INSERT INTO workers (worker_id, info, registered_at, last_seen) VALUES (:w, :info, :at, :at)"
            ),
            {"w": worker, "info": json.dumps({"queues": ["gpu"], "hostname": "old"}), "at": now - 30},
        )
        version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
    engine.dispose()
    assert version == "0001"  # the first release's schema
    return {"done": done, "queued": queued}


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_upgrade_from_the_oldest_migration_keeps_every_call(
    dialect: str, tmp_path: Path, stacks: list[Stack]
) -> None:
    admin, daemon = "lsk_old-admin-" + new_ulid(), "lsk_old-daemon-" + new_ulid()
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "tokens.json").write_text(json.dumps({"admin": admin, "daemon": daemon}))
    with pg_database() if dialect == "postgresql" else _sqlite(data) as url:
        ids = _at_oldest_revision(url, admin, daemon)
        s = _stack(data, url if dialect == "postgresql" else None).start()  # migrates to head on start
        stacks.append(s)
        assert (s.admin, s.daemon) == (admin, daemon)
        status, out = s.call("/v1/producer/await", {"invocation_id": ids["done"], "timeout_s": 0}, admin)
        assert status == 200 and out["state"] == "succeeded" and wire.unpack(out["result_blob"]) == RESULT
        worker = new_ulid()
        assert s.call("/v1/daemon/register", {"worker_id": worker, "queues": ["gpu"]}, daemon)[0] == 200
        _, out = s.call("/v1/daemon/poll", {"worker_id": worker, "queues": ["gpu"], "timeout_s": 0}, daemon)
        assert [c["body"]["invocation_id"] for c in out["commands"]] == [ids["queued"]]
        ack = {"invocation_id": ids["queued"], "state": "succeeded", "result_blob": wire.pack(1),
               "error": None, "worker_id": worker, "attempt": 1}  # fmt: skip
        assert s.call("/v1/daemon/ack", ack, daemon)[0] == 200
        status, detail = s.json("GET", f"/v1/ops/invocations/{ids['done']}", None, admin)
        assert status == 200 and detail["attempts"][0]["outcome"] == "succeeded", detail
        s.stop()
        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.connect() as conn:
            assert (
                conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() == HEAD_REVISION
            )
        engine.dispose()


class _sqlite:
    def __init__(self, data: Path) -> None:
        self.url = f"sqlite:///{data / 'lakeshore.db'}"

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        pass
