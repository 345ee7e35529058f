"""``lakeshore server`` as a real process: first-start tokens, tokens.json, and the admin commands."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from click.testing import CliRunner

from dreamlake.lakeshore.cli import main
from dreamlake.lakeshore.store import open_store
from tests.stack.ports import free_port


def test_server_first_start_mints_tokens_and_serves(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    env = {**os.environ, "LAKESHORE_DATA_DIR": str(data)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dreamlake.lakeshore.cli", "server", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        while not any("nymph start" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "server exited: " + "".join(lines)
            lines.append(line)
        tokens = json.loads((data / "tokens.json").read_text())
        assert stat.S_IMODE((data / "tokens.json").stat().st_mode) == 0o600
        assert set(tokens) == {"admin", "daemon"}
        start = next(line for line in lines if "nymph start" in line).split()
        # the token in nymph's environment (ps shows a command line), for the README's queue
        assert start == [
            f"NYMPH_TOKEN={tokens['daemon']}",
            "nymph",
            "start",
            "--server",
            f"http://127.0.0.1:{port}",
            "--runner",
            "process",
            "--queue",
            "gpu",
        ]
        assert "--token" not in " ".join(lines)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                assert httpx.get(url + "/healthz").json() == {"ok": True, "store": "sqlite"}
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        r = httpx.post(
            url + "/v1/daemon/poll",
            headers={"Authorization": f"Bearer {tokens['daemon']}"},
            content=msgpack.packb(
                {"worker_id": "01ARZ3NDEKTSV4RRFFQ69G5FAV", "queues": ["default"], "timeout_s": 0}
            ),
        )
        assert r.status_code == 200 and msgpack.unpackb(r.content) == {"commands": []}
    finally:
        proc.terminate()
        proc.wait(10)
    store = open_store(data / "lakeshore.db")
    try:
        assert store.count_tokens() == 2  # a second start mints nothing more
    finally:
        store.close()


def test_token_create_and_namespace_pin(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["--data-dir", str(tmp_path)]
    result = runner.invoke(
        main, ["token", "create", "--kind", "namespace", "--name", "ci", "--namespace", "ns1", *args]
    )
    assert result.exit_code == 0, result.output
    secret = result.output.strip()
    assert secret.startswith("lsk_")
    result = runner.invoke(main, ["token", "create", "--kind", "namespace", "--name", "x", *args])
    assert result.exit_code != 0 and "--namespace" in result.output
    result = runner.invoke(main, ["namespace", "pin", "ns1", "0.2.0", *args])
    assert result.exit_code == 0 and "0.2.0" in result.output
    store = open_store(tmp_path / "lakeshore.db")
    try:
        principal = store.verify_token(secret)
        assert principal is not None and principal.kind == "namespace" and principal.namespace == "ns1"
        assert store.pinned_version("ns1") == "0.2.0"
    finally:
        store.close()
    result = runner.invoke(main, ["namespace", "pin", "ns1", "--clear", *args])
    assert result.exit_code == 0
    result = runner.invoke(main, ["namespace", "pin", "ns1", *args])
    assert result.exit_code != 0


def test_a_missing_server_extra_is_named_with_its_pip_command(tmp_path: Path) -> None:
    """Without the server extra (starlette made unimportable), lakeshore server says which pip
    command brings it, before it opens or prints anything."""
    code = (
        "import sys; sys.modules['starlette'] = None\n"
        "from dreamlake.lakeshore.cli import main\n"
        f"main(['server', '--port', '0', '--data-dir', {str(tmp_path / 'data')!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert (
        "needs 'starlette', which is not installed: pip install 'dreamlake-lakeshore[server]'" in out.stderr
    )
    assert not (tmp_path / "data").exists()


def test_the_extras_map_agrees_with_pyproject() -> None:
    import tomllib

    from dreamlake.lakeshore.extras import EXTRA_OF

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for module, extra in EXTRA_OF.items():
        names = {re.split(r"[<>=\[; ]", req, maxsplit=1)[0].lower() for req in extras[extra]}
        assert module in names, f"{module} is not a requirement of the {extra!r} extra"


def test_both_clis_say_their_version() -> None:
    from dreamlake.lakeshore import __version__

    for cmd, name in (
        ([sys.executable, "-m", "dreamlake.lakeshore.cli"], "lakeshore"),
        ([sys.executable, "-m", "nymph"], "nymph"),
    ):
        for flag in ("--version", "-V"):
            out = subprocess.run([*cmd, flag], capture_output=True, text=True, timeout=60)
            assert (out.returncode, out.stdout.strip()) == (0, f"{name} {__version__}"), out.stderr


def _served_workers(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> int:
    """The ``workers`` ``lakeshore server ARGS`` would serve with (serving itself replaced)."""
    from dreamlake.lakeshore.server import serve as serving

    served: dict[str, Any] = {}

    def fake_serve(spec: Any, *, workers: int = 1, store: Any = None, **_: Any) -> None:
        served["workers"] = workers
        if store is not None:
            store.close()

    monkeypatch.setattr(serving, "serve", fake_serve)
    result = CliRunner().invoke(main, ["server", "--port", str(free_port()), *args])
    assert result.exit_code == 0, result.output
    return int(served["workers"])


def test_workers_auto_is_a_process_per_core_only_over_postgresql_with_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _pg_url: str
) -> None:
    from dreamlake.lakeshore.server.serve import AUTO_WORKERS_MAX, auto_workers, usable_cores

    monkeypatch.delenv("LAKESHORE_WORKERS", raising=False)
    data = ["--data-dir", str(tmp_path)]
    redis = ["--redis", "redis://127.0.0.1:1/0"]  # never dialled: serving is replaced
    expected = min(usable_cores(), AUTO_WORKERS_MAX)
    assert _served_workers(monkeypatch, [*data, "--db", _pg_url, *redis]) == expected
    assert _served_workers(monkeypatch, [*data, "--db", _pg_url]) == 1  # no Redis: frames stay in one process
    assert _served_workers(monkeypatch, [*data, *redis]) == 1  # SQLite: one writer anyway
    assert _served_workers(monkeypatch, [*data, "--workers", "3"]) == 3  # a number is taken as given
    monkeypatch.setenv("LAKESHORE_WORKERS", "2")
    assert _served_workers(monkeypatch, [*data, "--db", _pg_url, *redis]) == 2
    assert [auto_workers("postgresql", "redis://r", cores) for cores in (1, 2, 3, 64)] == [1, 2, 3, 4]


def test_workers_refuses_what_is_not_a_count_and_says_what_is(tmp_path: Path) -> None:
    for bad in ("0", "257", "many", "-1"):
        result = CliRunner().invoke(main, ["server", "--data-dir", str(tmp_path), "--workers", bad])
        assert result.exit_code == 2, result.output
        assert "from 1 to 256, or 'auto'" in result.output
    assert not (tmp_path / "lakeshore.db").exists()  # refused before anything was opened
