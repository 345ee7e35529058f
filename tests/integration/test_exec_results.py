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
