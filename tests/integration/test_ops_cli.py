"""``lakeshore queues|workers|ls|show|cancel|stream|logs`` against a real control plane over HTTP,
through click's CliRunner, configured the ways a user does: environment, config file, flags. Also
the SDK's default plane from ``LAKESHORE_URL`` / ``LAKESHORE_TOKEN``, and its no-worker warning."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.cli import main
from dreamlake.lakeshore.default_dispatch import set_default_dispatch
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.ops_cli import parse_since, table
from tests.integration.conftest import ControlPlane, submit_body
from tests.integration.ops_kit import run


@pytest.fixture
def cp(sqlite_control_plane: ControlPlane) -> ControlPlane:
    return sqlite_control_plane


def _submit(cp: ControlPlane, queue: str = "q", token: str | None = None) -> str:
    inv = new_ulid()
    status, out = cp.call("/v1/producer/submit", submit_body(inv, queue), token or cp.producer_token)
    assert status == 200, out
    return inv


def _run_to_the_end(cp: ControlPlane, inv: str, queue: str = "q") -> str:
    """A worker claims ``inv``, writes two log lines and a value, ends the stream, acks succeeded."""
    worker = new_ulid()
    body = {"worker_id": worker, "hostname": "h1", "runner": "process", "queues": [queue], "slots": 2}
    assert cp.daemon("/v1/daemon/register", body)[0] == 200
    _, out = cp.daemon("/v1/daemon/poll", {"worker_id": worker, "queues": [queue], "timeout_s": 0})
    assert [c["body"]["invocation_id"] for c in out["commands"]] == [inv]
    frames = [
        wire.encode_frame(wire.FRAME_LOG, 0, b"hello out\n", {"stream": "stdout"}),
        wire.encode_frame(wire.FRAME_LOG, 1, b"hello err\n", {"stream": "stderr"}),
        wire.encode_frame(wire.FRAME_VALUE, 2, wire.pack({"left": 3})),
        wire.encode_frame(wire.FRAME_END, 3, wire.pack("done")),
    ]
    for seq, data in enumerate(frames):
        chunk = {
            "invocation_id": inv,
            "seq": seq,
            "bytes": data,
            "final": seq == 3,
            "attempt": 1,
            "worker_id": worker,
        }
        assert cp.daemon("/v1/daemon/result-chunk", chunk)[0] == 200
    ack = {"invocation_id": inv, "state": "succeeded", "result_blob": wire.pack("done"),
           "error": None, "worker_id": worker, "attempt": 1}  # fmt: skip
    assert cp.daemon("/v1/daemon/ack", ack)[0] == 200
    return worker


def test_queues_workers_ls_show_in_tables_and_json(cp: ControlPlane) -> None:
    done = _submit(cp)
    worker = _run_to_the_end(cp, done)
    waiting = _submit(cp, "backlog")

    result = run(cp, "queues")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["QUEUE", "QUEUED", "RUNNING", "LIMIT", "OLDEST", "QUEUED", "WORKERS",
                                "SUCCEEDED", "FAILED", "KILLED", "TIMEOUT", "CANCELLED"]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["q"] == ["q", "0", "0", "-", "-", "1", "1", "0", "0", "0", "0"]
    assert rows["backlog"][:2] == ["backlog", "1"] and rows["backlog"][5] == "0"
    out = json.loads(run(cp, "queues", "--json").stdout)
    assert {q["name"]: q["queued"] for q in out} == {"backlog": 1, "q": 0}

    result = run(cp, "workers")
    assert result.exit_code == 0
    header, row = result.stdout.splitlines()
    assert header.split()[:5] == ["WORKER", "HOST", "RUNNER", "QUEUES", "SLOTS"]
    assert row.split()[:5] == [worker, "h1", "process", "q", "0/2"]
    (w,) = json.loads(run(cp, "workers", "--json").stdout)
    assert w["worker_id"] == worker and w["live"] is True

    result = run(cp, "ls")
    assert [line.split()[:3] for line in result.stdout.splitlines()[1:]] == [
        [waiting, "backlog", "queued"],
        [done, "q", "succeeded"],
    ]
    result = run(cp, "ls", "--state", "succeeded", "--since", "10m", "--json")
    page = json.loads(result.stdout)
    assert [i["invocation_id"] for i in page["invocations"]] == [done] and page["next_cursor"] is None
    result = run(cp, "ls", "--limit", "1")
    assert len(result.stdout.splitlines()) == 2 and f"--cursor {waiting}" in result.stderr

    result = run(cp, "show", done)
    assert result.exit_code == 0
    assert "state       succeeded" in result.stdout and f"#1: succeeded on {worker}" in result.output
    assert "frames      4 (last seq 3)" in result.output
    assert json.loads(run(cp, "show", done, "--json").stdout)["attempts"][0]["outcome"] == "succeeded"


def test_show_prints_the_remote_traceback_and_unknown_ids_exit_2(cp: ControlPlane) -> None:
    inv = _submit(cp)
    worker = new_ulid()
    cp.daemon("/v1/daemon/register", {"worker_id": worker, "queues": ["q"]})
    cp.daemon("/v1/daemon/poll", {"worker_id": worker, "queues": ["q"], "timeout_s": 0})
    error = {
        "type": "KeyError",
        "message": "'x'",
        "traceback": "Traceback (most recent call last):\nKeyError: 'x'\n",
    }
    ack = {"invocation_id": inv, "state": "failed", "result_blob": b"", "error": error,
           "worker_id": worker, "attempt": 1}  # fmt: skip
    assert cp.daemon("/v1/daemon/ack", ack)[0] == 200
    result = run(cp, "show", inv)
    assert "error       KeyError: 'x'" in result.output
    assert "  Traceback (most recent call last):\n  KeyError: 'x'" in result.output
    result = run(cp, "show", new_ulid())
    assert result.exit_code == 2 and "unknown invocation" in result.stderr
    result = run(cp, "show", "nope")
    assert result.exit_code == 1 and "26-character ULID" in result.stderr


def test_stream_and_logs(cp: ControlPlane) -> None:
    inv = _submit(cp)
    _run_to_the_end(cp, inv)
    result = run(cp, "stream", inv, "--json")
    assert result.exit_code == 0, result.output
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(f["seq"], f["kind"]) for f in frames] == [(0, "log"), (1, "log"), (2, "value"), (3, "end")]
    assert frames[2]["value"] == {"left": 3} and frames[3]["value"] == "done"
    result = run(cp, "stream", inv, "--since", "1")
    assert result.stdout.splitlines() == ["     2  value  {'left': 3}", "     3  end    'done'"]

    result = run(cp, "logs", inv)
    assert result.exit_code == 0 and result.stdout == "hello out\n" and result.stderr == "hello err\n"
    result = run(cp, "logs", "-f", inv)
    assert result.stdout == "hello out\n"


def test_cancel_several_and_report_the_unknown(cp: ControlPlane) -> None:
    a, b = _submit(cp), _submit(cp)
    unknown = new_ulid()
    result = run(cp, "cancel", a, b, unknown)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [f"{a}  cancelled", f"{b}  cancelled"]
    assert unknown in result.stderr and "unknown invocation" in result.stderr
    assert cp.store.get(a).state == "cancelled"  # type: ignore[union-attr]


def test_a_namespace_token_sees_only_its_namespace(cp: ControlPlane) -> None:
    other = _submit(cp)
    mine_token = cp.store.create_token("producer", "team-a", "team-a")
    mine = _submit(cp, token=mine_token)
    result = run(cp, "ls", token=mine_token)
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == [mine]
    result = run(cp, "cancel", other, token=mine_token)
    assert result.exit_code == 1 and cp.store.get(other).state == "queued"  # type: ignore[union-attr]
    result = run(cp, "ls", token=cp.daemon_token)
    assert result.exit_code == 1 and "is a daemon token" in result.stderr


def test_config_file_flags_and_missing_settings(cp: ControlPlane, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'url = "{cp.url}"\ntoken = "{cp.admin_token}"\n')
    env = {"LAKESHORE_URL": None, "LAKESHORE_TOKEN": None, "LAKESHORE_CONFIG": str(config)}
    result = CliRunner().invoke(main, ["queues", "--json"], env=env)
    assert result.exit_code == 0 and json.loads(result.stdout) == []
    result = CliRunner().invoke(main, ["queues", "--token", "lsk_wrong"], env=env)
    assert result.exit_code == 1 and "unknown token" in result.stderr
    env["LAKESHORE_CONFIG"] = str(tmp_path / "missing.toml")
    result = CliRunner().invoke(main, ["queues"], env=env)
    assert result.exit_code == 2
    assert "LAKESHORE_URL and LAKESHORE_TOKEN" in result.output and "missing.toml" in result.output


def test_parse_since_and_table() -> None:
    assert parse_since("10m", now=1000.0) == 400.0
    assert parse_since("2h", now=10_000.0) == 2800.0
    assert parse_since("1700000000") == 1_700_000_000.0
    assert parse_since(None) is None
    with pytest.raises(Exception, match="use an age like 10m"):
        parse_since("yesterday")
    assert table(["A", "LONG"], [["xyz", 1], [None, "b"]]).splitlines() == ["A    LONG", "xyz  1", "     b"]


@pytest.fixture
def default_plane_env(cp: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("LAKESHORE_URL", cp.url)
    monkeypatch.setenv("LAKESHORE_TOKEN", cp.producer_token)
    monkeypatch.setenv("LAKESHORE_CONFIG", "/nonexistent/config.toml")
    set_default_dispatch(None)
    yield
    set_default_dispatch(None)


@dls.udf(queue="mnie")
def topk(xs: list[int], k: int) -> list[int]:
    return sorted(xs)[-k:]


def test_submit_uses_the_environment_and_warns_once_about_an_unserved_queue(
    cp: ControlPlane, default_plane_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    cp.daemon("/v1/daemon/register", {"worker_id": new_ulid(), "queues": ["gpu"]})
    with caplog.at_level(logging.WARNING, logger="dreamlake.lakeshore.dispatch.http"):
        first = topk.submit([3, 1, 2], 2)
        topk.submit([5, 4], 1)
    warnings = [r.getMessage() for r in caplog.records if "no worker" in r.getMessage()]
    assert warnings == ["no worker has polled queue 'mnie' in the last 5 min; known queues: gpu"]
    assert cp.store.get(first).queue == "mnie"  # type: ignore[union-attr]
    with pytest.raises(TimeoutError, match="no worker has polled queue 'mnie'"):
        dls.SyncQueue("mnie").result(first, timeout=0.2)


def test_show_lists_the_children_an_invocation_submitted(cp: ControlPlane) -> None:
    parent = _submit(cp)
    kids = [cp.submit("q", parent_invocation_id=parent) for _ in range(2)]
    result = run(cp, "show", parent)
    assert "children    2 (2 queued)" in result.output
    assert all(f"  {kid}  queued" in result.output for kid in kids)
    detail = json.loads(run(cp, "show", parent, "--json").stdout)
    assert detail["children"] == [{"invocation_id": kid, "state": "queued"} for kid in sorted(kids)]
    assert "children" not in run(cp, "show", kids[0]).output


def _claim_and_ack(cp: ControlPlane, inv: str, queue: str, state: str, error: dict[str, Any] | None) -> None:
    worker = new_ulid()
    cp.daemon("/v1/daemon/register", {"worker_id": worker, "queues": [queue]})
    _, out = cp.daemon("/v1/daemon/poll", {"worker_id": worker, "queues": [queue], "timeout_s": 0})
    assert [c["body"]["invocation_id"] for c in out["commands"]] == [inv]
    ack = {"invocation_id": inv, "state": state, "result_blob": b"", "error": error,
           "worker_id": worker, "attempt": 1}  # fmt: skip
    assert cp.daemon("/v1/daemon/ack", ack)[0] == 200


def test_queues_count_killed_and_timed_out_calls_and_a_final_failure_reads_final(cp: ControlPlane) -> None:
    """Issue 35: a cancelled running call (acked killed) and a timed-out one each have a column;
    a failure that is not retried (attempt 1 of up to 3) does not read as if retries were coming."""
    from dreamlake.lakeshore.envelope import Envelope

    outcomes = {"killed": "Cancelled", "timeout": "Timeout", "failed": "ValueError"}
    ids = {}
    for state, kind in outcomes.items():
        fn = {
            "kind": "ref",
            "module": "mylib.rank",
            "qualname": "topk",
            "src_hash": "sha256:0123456789abcdef",
        }
        blob = Envelope.create(fn, (1,), {}).to_bytes()
        inv = new_ulid()
        body = submit_body(inv, "ops", run_config={"max_attempts": 3}, args_blob=blob)
        status, out = cp.call("/v1/producer/submit", body, cp.producer_token)
        assert status == 200, out
        _claim_and_ack(cp, inv, "ops", state, {"type": kind, "message": "m"})
        ids[state] = inv
    lines = run(cp, "queues").stdout.splitlines()
    header = lines[0].replace("OLDEST QUEUED", "OLDEST_QUEUED").split()
    row = dict(zip(header, next(ln for ln in lines if ln.startswith("ops ")).split(), strict=True))
    assert (row["FAILED"], row["KILLED"], row["TIMEOUT"], row["CANCELLED"]) == ("1", "1", "1", "0")

    listed = {ln.split()[0]: ln.split() for ln in run(cp, "ls", "--queue", "ops").stdout.splitlines()[1:]}
    assert listed[ids["failed"]][2:5] == ["failed", "1", "final"]  # not "1/3"
    shown = run(cp, "show", ids["failed"]).stdout
    assert "attempts    1 of up to 3, final" in shown
    assert "function    mylib.rank.topk  (by reference, source sha256:0123456789abcdef)" in shown


def test_show_names_a_pickled_function_by_its_hash(cp: ControlPlane) -> None:
    from dreamlake.lakeshore.envelope import Envelope, fn_for

    def topk(x: int) -> int:
        return x

    blob = Envelope.create(fn_for(topk, "pickle"), (1,), {}).to_bytes()
    inv = new_ulid()
    assert cp.call("/v1/producer/submit", submit_body(inv, "p", args_blob=blob), cp.producer_token)[0] == 200
    line = next(ln for ln in run(cp, "show", inv).stdout.splitlines() if ln.startswith("function"))
    assert line.startswith("function    ") and "topk  (pickled, sha256:" in line and "None" not in line


def test_ls_and_show_name_the_sweep_of_a_map(cp: ControlPlane) -> None:
    sweep = new_ulid()
    calls = []
    for _ in range(3):
        inv = new_ulid()
        body = submit_body(inv, "sw", run_config={"sweep": sweep})
        assert cp.call("/v1/producer/submit", body, cp.producer_token)[0] == 200
        calls.append(inv)
    _submit(cp, "sw")  # not of the sweep
    listed = run(cp, "ls", "--sweep", sweep, "--json").stdout
    page = json.loads(listed)
    assert sorted(i["invocation_id"] for i in page["invocations"]) == sorted(calls)
    assert {i["sweep"] for i in page["invocations"]} == {sweep}
    assert f"sweep       {sweep}" in run(cp, "show", calls[0]).stdout
    bad = run(cp, "ls", "--sweep", "nope")
    assert bad.exit_code != 0 and "sweep" in bad.stderr
