"""The entry's runtime stays lean: a ref invocation imports no heavy module it does not use.

Every invocation spawns ``python3 -m dreamlake.lakeshore.daemon.entry``, so what the entry imports is
paid on each one. These tests run the entry's ``main()`` in a subprocess on a real workdir and look at
``sys.modules`` afterwards (a behaviour, not a timing: bench/entry_startup.py measures the time).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.envelope import Envelope
from tests.conftest import ROOT

# Modules a plain ref invocation must not import (the SDK's, the server's, and the stdlib's costly ones
# that only a codec, a log line, a pickle or the source-hash fallback needs).
HEAVY = {
    "logging",
    "inspect",
    "dataclasses",
    "tokenize",
    "ast",
    "uuid",
    "decimal",
    "pathlib",
    "hashlib",
    "platform",
    "threading",
    "traceback",
    "cloudpickle",
    "numpy",
    "torch",
    "PIL",
    "httpx",
    "sqlalchemy",
    "starlette",
    "anyio",
    "dreamlake.lakeshore.decorator",
    "dreamlake.lakeshore.queue",
    "dreamlake.lakeshore.dispatch",
    "dreamlake.lakeshore.server",
    "dreamlake.lakeshore.store",
}

# Runs the entry as the runner does (cwd = workdir), then reports what got imported.
WRAPPER = (
    "import sys\n"
    "from dreamlake.lakeshore.daemon.entry import main\n"
    "rc = main()\n"
    "sys.stdout.write(' '.join(sorted(sys.modules)))\n"
    "raise SystemExit(rc)\n"
)

NOOP_SOURCE = "def noop():\n    return None\n"


def _src_hash(source: str) -> str:
    return "sha256:" + hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def _invoke(tmp_path: Path, source: str, src_hash: str | None, *args: object) -> tuple[int, set[str], Path]:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "lean_user_mod.py").write_text(source)
    workdir = tmp_path / "inv"
    workdir.mkdir(mode=0o700)
    fn = {"kind": "ref", "module": "lean_user_mod", "qualname": "noop", "src_hash": src_hash}
    (workdir / "args.msgpack").write_bytes(Envelope.create(fn, args).to_bytes())
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": f"{ROOT}{os.pathsep}{mods}"}
    proc = subprocess.run(
        [sys.executable, "-s", "-c", WRAPPER],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, set(proc.stdout.split()), workdir


@pytest.mark.parametrize("with_hash", [True, False], ids=["src_hash", "no-src_hash"])
def test_ref_noop_imports_nothing_heavy(tmp_path: Path, with_hash: bool) -> None:
    src_hash = _src_hash(NOOP_SOURCE) if with_hash else None
    rc, modules, workdir = _invoke(tmp_path, NOOP_SOURCE, src_hash)
    assert rc == 0, (workdir / "error.json").read_text() if (workdir / "error.json").exists() else rc
    assert wire.unpack((workdir / "result.msgpack").read_bytes()) is None
    assert "dreamlake.lakeshore.daemon.entry" in modules  # the report is real
    assert sorted(modules & HEAVY) == []


def test_tuple_arguments_need_no_heavy_module(tmp_path: Path) -> None:
    source = "def noop(*args):\n    return args\n"
    rc, modules, workdir = _invoke(tmp_path, source, _src_hash(source), (1, "a"), {2, 3}, 1.5)
    assert rc == 0
    assert wire.unpack((workdir / "result.msgpack").read_bytes()) == ((1, "a"), {2, 3}, 1.5)
    assert sorted(modules & HEAVY) == []


def test_source_the_fast_hash_cannot_read_is_still_checked_by_inspect(tmp_path: Path) -> None:
    # A trailing comment inside the body is part of inspect's source but not of the cheap slice:
    # the entry falls back to inspect and accepts the (unchanged) function.
    source = "def noop():\n    return None\n    # a trailing comment\n"
    rc, modules, workdir = _invoke(tmp_path, source, _src_hash(source))
    assert rc == 0, (workdir / "error.json").read_text()
    assert "inspect" in modules


def test_stale_source_is_still_refused(tmp_path: Path) -> None:
    rc, _, workdir = _invoke(tmp_path, NOOP_SOURCE, _src_hash("def noop():\n    return 42\n"))
    assert rc == 2
    assert json.loads((workdir / "error.json").read_text())["type"] == "StaleSource"


DECORATED_SOURCE = (
    "import dreamlake.lakeshore as dls\n\n\n"
    '@dls.udf(queue="work")\n'
    "def noop():\n"
    "    with dls.scope('x'):\n"
    "        return [dls.run.id, dls.run.key('y')]\n"
)


def test_a_decorated_module_imports_nothing_heavy(tmp_path: Path) -> None:
    """A user's ``@dls.udf`` module pays for the decorator alone: no plane, HTTP client or settings."""
    function_source = DECORATED_SOURCE[DECORATED_SOURCE.index("@") :]  # from its decorator on
    rc, modules, workdir = _invoke(tmp_path, DECORATED_SOURCE, _src_hash(function_source))
    assert rc == 0, (workdir / "error.json").read_text() if (workdir / "error.json").exists() else rc
    run_id, key = wire.unpack((workdir / "result.msgpack").read_bytes())
    assert run_id == Envelope.from_bytes((workdir / "args.msgpack").read_bytes()).id and key == "x/y"
    assert "dreamlake.lakeshore.decorator" in modules
    heavy = (HEAVY - {"dreamlake.lakeshore.decorator"}) | {
        "typing",
        "tomllib",
        "dreamlake.lakeshore.settings",
    }
    assert sorted(modules & heavy) == []
