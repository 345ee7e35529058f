"""Typed exec results (seed 003's "not wired yet", wired): a command that writes
``$LAKESHORE_RESULT`` (msgpack) or ``result.json`` gets its value back through the result route,
inline or by reference, decoded by the SDK (``dreamlake.lakeshore.execs``) and ``lakeshore exec``.
A real ``lakeshore server`` and ``nymph start`` (LocalStack), real HTTP, real bash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore.devstack import LocalStack
from dreamlake.lakeshore.execs import Execs

PACK = (
    f'{sys.executable} -c "import msgpack, os; '
    "open(os.environ['LAKESHORE_RESULT'], 'wb').write(msgpack.packb({'rows': 3, 'ok': True}))\""
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(
        queues=["default"], quiet=True, data_dir=tmp_path_factory.mktemp("stack"), nymph_args=["--allow-exec"]
    ) as s:
        yield s


@pytest.fixture
def execs(stack: LocalStack) -> Iterator[Execs]:
    with Execs(stack.url, stack.tokens["admin"], "default") as e:
        yield e


def test_a_msgpack_result_comes_back_inline_and_decoded(execs: Execs) -> None:
    out = execs.run(f"echo working; {PACK}", wait=90)
    assert (out.exit_code, out.stdout) == (0, "working\n")
    assert out.result == {"rows": 3, "ok": True}


def test_a_json_result_and_a_command_without_one(execs: Execs) -> None:
    out = execs.run("""echo '{"loss": 0.25, "steps": [1, 2]}' > result.json; exit 4""", wait=90)
    assert out.exit_code == 4 and out.result == {"loss": 0.25, "steps": [1, 2]}
    plain = execs.run("echo no result", wait=90)
    assert not plain.has_result and plain.stdout == "no result\n"


def test_a_big_result_travels_by_reference(execs: Execs) -> None:
    big = (
        f'{sys.executable} -c "import msgpack, os; '
        "open(os.environ['LAKESHORE_RESULT'], 'wb').write(msgpack.packb(b'x' * (600 * 1024)))\""
    )
    out = execs.run(big, wait=90)
    assert out.exit_code == 0, out.stderr
    assert out.result == b"x" * (600 * 1024)  # over the 256 KiB inline threshold: a resultRef


def test_a_damaged_result_is_dropped_with_a_line_that_says_so(execs: Execs) -> None:
    out = execs.run("printf '\\xc1\\xc1' > \"$LAKESHORE_RESULT\"; echo '{not json' > result.json", wait=90)
    assert out.exit_code == 0 and not out.has_result
    assert "nymph: result.msgpack does not decode" in out.stderr


def test_lakeshore_exec_prints_the_result(stack: LocalStack, tmp_path: Path) -> None:
    env = {**os.environ, "LAKESHORE_URL": stack.url, "LAKESHORE_TOKEN": stack.tokens["admin"]}
    cli = [
        sys.executable,
        "-m",
        "dreamlake.lakeshore.cli",
        "exec",
        "-n",
        "default",
        "--result-only",
        "--",
        PACK,
    ]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"ok": True, "rows": 3}


def test_a_5_mib_output_is_archived_whole_under_the_seeds_prefix(stack: LocalStack, execs: Execs) -> None:
    """The result keeps the last 1 MiB inline; the archive (exec/<YYYY>/<MM>/<DD>/<id>/out) all of it."""
    write = (
        f"{sys.executable} -c \"import sys; [sys.stdout.write(f'{{i:07d}}' + 'x' * 56 + chr(10)) "
        'for i in range(5 * 16384)]"; ' + PACK
    )
    exec_id = execs.submit(write)
    out = execs.result(exec_id, wait=120)
    assert out.exit_code == 0, out.stderr
    assert out.result == {"rows": 3, "ok": True}
    whole = execs.output(exec_id)
    assert len(whole) == 5 * 2**20  # 81,920 lines of 64 bytes
    assert whole.splitlines()[-1].startswith(b"0081919") and whole.startswith(b"0000000")
    tail = out.stdout.encode()
    assert len(tail) == 2**20 and whole.endswith(tail)  # the inline tail: the last 1 MiB
    archived = list((stack.dir / "cp" / "blobs" / "exec").glob(f"*/*/*/{exec_id}/out/stdout"))
    assert len(archived) == 1 and archived[0].stat().st_size == 5 * 2**20, archived


def test_the_archive_is_the_namespaces_own(stack: LocalStack, execs: Execs) -> None:
    import httpx

    exec_id = execs.submit("echo secret-output")
    execs.result(exec_id, wait=90)
    assert execs.output(exec_id) == b"secret-output\n"
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        other = http.get(
            f"/v1/namespaces/default/jobs/{exec_id}/output/stdout",
            headers={"Authorization": f"Bearer {stack.tokens['daemon']}"},  # a daemon reads nothing
        )
        assert other.status_code == 403
        elsewhere = http.get(
            f"/v1/namespaces/team-b/jobs/{exec_id}/output/stdout",
            headers={"Authorization": f"Bearer {stack.tokens['admin']}"},
        )
        assert elsewhere.status_code == 404  # not a job of that namespace


def test_the_archive_in_an_s3_bucket(
    s3_service: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a bucket the archive is an object under exec/<YYYY>/<MM>/<DD>/<id>/out, read back whole."""
    for name, value in s3_service.env().items():
        monkeypatch.setenv(name, value)
    with (
        LocalStack(queues=["default"], quiet=True, data_dir=tmp_path, nymph_args=["--allow-exec"]) as s3stack,
        Execs(s3stack.url, s3stack.tokens["admin"], "default") as execs,
    ):
        exec_id = execs.submit("seq 1 200000; echo oops >&2")
        out = execs.result(exec_id, wait=120)
        assert out.exit_code == 0, out.stderr
        whole = execs.output(exec_id)
        assert whole == b"".join(b"%d\n" % i for i in range(1, 200001))
        assert execs.output(exec_id, "stderr") == b"oops\n"
        listed = s3_service.client().list_objects_v2(Bucket=s3_service.bucket, Prefix="exec/")
        keys = [o["Key"] for o in listed.get("Contents", []) if f"/{exec_id}/out/" in o["Key"]]
        assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["stderr", "stdout"], keys
