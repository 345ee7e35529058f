"""The README's "Using it" works as written: start ``lakeshore server``, export the two lines it
prints, run the snippet; and every start (also a restart) says where it listens and where its
tokens are, with no library noise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dreamlake.lakeshore.devstack import free_port
from tests.conftest import ROOT

LISTENING = re.compile(r"^lakeshore server: listening on (http://\S+) \(dashboard \S+/ui\); tokens in (\S+)$")


def _snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using it", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


class Server:
    def __init__(self, data: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "LAKESHORE_DATA_DIR": str(data), "LAKESHORE_LOG_LEVEL": "info"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dreamlake.lakeshore.cli", "server", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        self.lines: list[str] = []

    def read_until(self, pattern: re.Pattern[str]) -> re.Match[str]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            assert line, "server exited:\n" + "".join(self.lines)
            self.lines.append(line)
            m = pattern.match(line.rstrip("\n"))
            if m:
                return m

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "data")
    try:
        yield s
    finally:
        s.stop()


def test_the_snippet_runs_as_written_with_the_printed_exports(server: Server, tmp_path: Path) -> None:
    m = server.read_until(LISTENING)
    url, tokens_path = m.group(1), m.group(2)
    assert url == f"http://127.0.0.1:{server.port}" and tokens_path == str(tmp_path / "data" / "tokens.json")
    exports = dict(re.findall(r"^\s+export (LAKESHORE_\w+)=(\S+)$", "".join(server.lines), re.M))
    assert set(exports) == {"LAKESHORE_URL", "LAKESHORE_TOKEN"} and exports["LAKESHORE_URL"] == url
    assert not [line for line in server.lines if "alembic" in line or " INFO " in line]  # no library noise

    script = tmp_path / "snippet.py"
    script.write_text(_snippet() + "\nprint(inv)\n")
    env = {**os.environ, **exports, "LAKESHORE_CONFIG": str(tmp_path / "none.toml")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for _ in range(100):  # the listening line comes just before uvicorn binds
        try:
            httpx.get(url + "/healthz", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    inv = run.stdout.strip().splitlines()[-1]
    assert "no worker has polled queue 'gpu' in the last 5 min" in run.stderr
    headers = {"Authorization": f"Bearer {exports['LAKESHORE_TOKEN']}"}
    detail = httpx.get(f"{url}/v1/ops/invocations/{inv}", headers=headers).json()
    assert detail["state"] == "queued" and detail["queue"] == "gpu"
    assert detail["function"]["qualname"] == "topk"


def test_a_restarted_server_says_where_it_listens_and_where_its_tokens_are(tmp_path: Path) -> None:
    first = Server(tmp_path / "data")
    try:
        first.read_until(LISTENING)
    finally:
        first.stop()
    again = Server(tmp_path / "data")
    try:
        m = again.read_until(LISTENING)
        assert m.group(2) == str(tmp_path / "data" / "tokens.json")
        assert not any("token:" in line or "export" in line for line in again.lines)  # no secrets again
    finally:
        again.stop()
