"""The README's "Using it" works as written: its blocks run as printed, in a fresh shell, against a
fresh ``lakeshore server`` and the lines it printed (the ``nymph start`` line and the two
``export`` lines), and print the result; a pickled submit to a queue whose nymphs refuse pickles
warns at once, naming the flag; and every start (also a restart) says where it listens and where
its tokens are, with no library noise."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from dreamlake.lakeshore.devstack import free_port
from tests.conftest import ROOT

LISTENING = re.compile(r"^lakeshore server: listening on (http://\S+) \(dashboard \S+/ui\); tokens in (\S+)$")
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
PRINTED = ("export LAKESHORE_URL=", "export LAKESHORE_TOKEN=")  # README lines the server prints


def quick_start() -> list[tuple[str, str]]:
    """The fenced blocks of README's "Using it", before its first subsection, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return BLOCK.findall(section)


def fresh_env(home: Path) -> dict[str, str]:
    """A new login's environment: PATH and HOME (and the code under test on the import path,
    as an installed dreamlake-lakeshore would be); nothing of this test process's settings."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "runners")]),
    }


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


@contextlib.contextmanager
def shell(command: str, env: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` in a new bash, in its own process group (killed, all of it, at the end)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", command], env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def printed_line(lines: list[str], marker: str) -> str:
    """The last line the server printed that starts with ``marker`` (leading spaces aside)."""
    found = [line.strip() for line in lines if line.strip().startswith(marker)]
    assert found, f"the server printed no line starting {marker!r}:\n" + "".join(lines)
    return found[-1]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "lakeshore server exited:\n" + log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline, "lakeshore server did not answer /healthz:\n" + log.read_text()
        time.sleep(0.1)


def test_using_it_runs_as_written_against_the_printed_lines(tmp_path: Path) -> None:
    blocks = quick_start()
    server_blocks = [b for kind, b in blocks if kind == "bash" and b.lstrip().startswith("lakeshore server")]
    nymph_blocks = [b for kind, b in blocks if kind == "bash" and "nymph start" in b]
    files = [b for kind, b in blocks if kind == "python"]
    user = [b for kind, b in blocks if kind == "bash" and b not in server_blocks + nymph_blocks]
    assert len(server_blocks) == 1 and len(nymph_blocks) == 1 and user and files, blocks
    assert len(server_blocks) + len(nymph_blocks) + len(files) + len(user) == len(blocks)

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = fresh_env(home)
    port = free_port()
    # shell 1: the README's server command, on a free port (tests run side by side)
    server_cmd = server_blocks[0].split("#", 1)[0].strip() + f" --port {port}"
    with shell(server_cmd, env, work, tmp_path / "server.log") as server:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server, tmp_path / "server.log")
        lines = (tmp_path / "server.log").read_text().splitlines(keepends=True)
        exports = {m: printed_line(lines, m) for m in PRINTED}
        nymph_line = printed_line(lines, "NYMPH_TOKEN=")
        assert not [line for line in lines if "alembic" in line]  # no library noise (migrations are quiet)

        # shell 2: the nymph line as the server printed it (the README shows that line)
        (readme_nymph,) = [ln for ln in nymph_blocks[0].splitlines() if "nymph start" in ln]
        assert readme_nymph.split("--server")[1].split()[1:] == nymph_line.split("--server")[1].split()[1:]
        nymph_env = {
            **env,
            "NYMPH_WORKDIR": str(tmp_path / "nymph-work"),
            "NYMPH_STATE_DIR": str(tmp_path / "nymph-state"),
        }
        if os.geteuid() == 0:  # CI runs as root, and nymph runs no task as root unless allowed
            nymph_env["NYMPH_ALLOW_ROOT_TASKS"] = "1"
        with shell(nymph_line, nymph_env, work, tmp_path / "nymph.log"):
            for block in files:  # each python block names its file on its first line
                name = block.splitlines()[0].removeprefix("# ").strip()
                assert re.fullmatch(r"\w+\.py", name), f"a python block starts with '# NAME.py': {block!r}"
                (work / name).write_text(block)
            script = []
            for line in "".join(user).splitlines():
                marker = next((m for m in PRINTED if line.startswith(m)), None)
                script.append(exports[marker] if marker else line)  # a line the server printed
            run = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", "\n".join(script)], env=env, cwd=work,
                capture_output=True, text=True, timeout=150,
            )  # fmt: skip
            assert run.returncode == 0, run.stdout + run.stderr + (tmp_path / "nymph.log").read_text()[-3000:]
            out = run.stdout.splitlines()
            assert out[0] == "[2, 3]"  # the local call
            assert re.fullmatch(r"[0-9A-HJKMNP-TV-Z]{26} \[2, 3\]", out[-1]), run.stdout  # id, then the value

            # the same function in the script itself travels pickled: the submit warns, naming the flag
            (work / "pickled.py").write_text(
                "import dreamlake.lakeshore as dls\n\n\n"
                '@dls.udf(queue="gpu")\n'
                "def topk(xs, k):\n"
                "    return sorted(xs)[-k:]\n\n\n"
                "inv = topk.submit([3, 1, 2], 2)\n"
                "try:\n"
                "    inv.result(timeout=60)\n"
                "except dls.DispatchError as exc:\n"
                "    print(exc)\n"
            )
            exports_sh = "\n".join(exports.values())
            run = subprocess.run(
                ["bash", "-euc", f"{exports_sh}\npython pickled.py"], env=env, cwd=work,
                capture_output=True, text=True, timeout=150,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr
            assert "every live worker of queue 'gpu' refuses pickled functions" in run.stderr, run.stderr
            assert "--allow-pickled" in run.stderr
            assert "PickleRefused" in run.stdout, run.stdout


def test_no_token_goes_on_a_command_line_in_the_quick_start() -> None:
    for _kind, block in quick_start():
        assert "--token " not in block and "--token=" not in block, block


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
