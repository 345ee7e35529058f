"""Retention on a running control plane and from ``lakeshore gc`` (issue 12, item 7).

Before, the store never deleted anything. Here the server runs with a one-second retention and a
fast sweep: a finished invocation (with its frames) and a done exec job disappear by themselves,
the S3 object the exec job referenced is deleted from a real S3 server, and the counts show in
``/metrics``; work still running stays. ``lakeshore gc`` does the same once, from the CLI.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.config import ServerConfig, parse_duration, parse_queue_retention
from dreamlake.lakeshore.server.payloads import PayloadStore
from dreamlake.lakeshore.store import open_store
from tests.integration.conftest import ControlPlane, running_control_plane
from tests.integration.daemon_kit import poll
from tests.integration.s3_fixture import S3Service, s3_service  # noqa: F401 - the fixture
from tests.stack.wait import until


@pytest.fixture
def short_lived(store_url: str, s3_service: S3Service) -> Iterator[ControlPlane]:  # noqa: F811
    config = ServerConfig(retention_s=1.0, retention_queues=(("keep", 0.0),), gc_every_s=0.3, gc_batch=2)
    payloads = PayloadStore.from_env(s3_service.env())
    with running_control_plane(store_url, config=config, payloads=payloads) as cp:
        yield cp


def _deleted(cp: ControlPlane) -> dict[str, float]:
    text = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"}).text
    return {
        s.labels["kind"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "lakeshore_gc_deleted_total"
    }


def _run(cp: ControlPlane, queue: str) -> str:
    inv = cp.submit(queue)
    worker = new_ulid()
    assert poll(cp, worker, [queue])["commands"]
    frames = [wire.encode_frame(wire.FRAME_VALUE, s, wire.pack(s)) for s in range(3)]
    body = {"invocation_id": inv, "attempt": 1, "worker_id": worker, "frames": frames}
    assert cp.daemon("/v1/daemon/result-chunks", body)[0] == 200
    ack = {
        "invocation_id": inv,
        "state": "succeeded",
        "attempt": 1,
        "worker_id": worker,
        "result_blob": b"\xc0",
    }
    assert cp.daemon("/v1/daemon/ack", ack)[0] == 200
    return inv


def test_the_sweep_deletes_expired_work_its_frames_and_its_payloads(
    short_lived: ControlPlane,
    s3_service: S3Service,  # noqa: F811
) -> None:
    cp = short_lived
    done = [_run(cp, "q") for _ in range(3)]  # more than one batch (gc_batch=2)
    kept = _run(cp, "keep")  # a queue whose retention is off
    waiting = cp.submit("q")
    key = f"payloads/2026/01/01/{new_ulid()}/args"
    s3 = s3_service.client()
    s3.put_object(Bucket=s3_service.bucket, Key=key, Body=b"payload bytes")
    job = cp.store.create_exec(
        "default",
        "cat",
        payload_inline=None,
        payload_ref={"key": key},
        queue="q",
        worker_id=None,
        timeout_s=None,
    )
    cp.store.claim_exec("w", ["q"])
    assert cp.store.publish_exec_result("default", job, {"exit_code": 0}, worker_id="w").ok
    until(lambda: all(cp.store.get(i) is None for i in done), "the finished invocations to expire", 30.0)
    until(lambda: cp.store.get_exec("default", job) is None, "the exec job to expire", 30.0)
    assert all(cp.store.read_frames(i) == [] for i in done)
    assert cp.store.get(kept) is not None and cp.store.get(waiting) is not None

    def gone() -> bool:  # the rows go first, then (in the same sweep) the objects they named
        try:
            s3.head_object(Bucket=s3_service.bucket, Key=key)
        except Exception as exc:
            assert re.search(r"404|Not Found|NoSuchKey", str(exc)), exc
            return True
        return False

    until(gone, "the exec job's payload to be deleted from S3", 30.0)
    counts = _deleted(cp)
    print(f"retention sweep: {counts}")
    assert counts["invocations"] >= 3 and counts["frames"] >= 9
    assert counts["exec_jobs"] >= 1 and counts["payloads"] >= 1


def test_lakeshore_gc_deletes_expired_work_once(tmp_path: Path) -> None:
    db = str(tmp_path / "plane.db")
    store = open_store(db)
    try:
        from tests.contract.store_kit import ack, submit

        inv = submit(store)
        store.claim("w", ["q"])
        ack(store, inv, "succeeded", attempt=1, worker_id="w", result_blob=b"\xc0")
    finally:
        store.close()
    time.sleep(1.1)
    cmd = [sys.executable, "-m", "dreamlake.lakeshore.cli", "gc", "--db", db, "--data-dir", str(tmp_path)]
    out = subprocess.run([*cmd, "--retention", "1s"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "deleted 1 invocations" in out.stdout
    again = subprocess.run([*cmd, "--retention", "1s"], capture_output=True, text=True, timeout=60)
    assert "deleted 0 invocations" in again.stdout
    bad = subprocess.run([*cmd, "--retention", "soon"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "7d, 12h" in bad.stderr


def test_durations_and_queue_rules_parse_or_say_what_to_write() -> None:
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90m") == 5400 and parse_duration("off") == 0
    assert parse_queue_retention(["gpu=30d", "scratch=1h"]) == (("gpu", 30 * 86400.0), ("scratch", 3600.0))
    with pytest.raises(ValueError, match="QUEUE=DURATION"):
        parse_queue_retention(["gpu"])
    with pytest.raises(ValueError, match="7d"):
        parse_duration("-1d")
