"""A process of ``lakeshore server --workers N`` knows it has siblings: work they take in may wake
nothing here, so its polls re-check often and none skips its pass (``server/idle.py``), and its group
commit never runs on the event loop (a sibling may hold SQLite's file lock); over SQLite it runs no
PostgreSQL wake-up relay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_a_worker_process_does_not_trust_its_own_wake_ups_alone(tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from dreamlake.lakeshore.server.serve import SPEC_ENV, ServeSpec, app_from_env, plane_context\n"
        f"os.environ[SPEC_ENV] = ServeSpec(db={str(tmp_path / 'l.db')!r}).to_env()\n"
        "ctx = plane_context(app_from_env())\n"
        "assert ctx.polls.shared_store and not ctx.polls.reliable\n"
        "assert ctx.writer.inline_lock is None\n"
        # no PostgreSQL LISTEN relay over SQLite (it dialled postgresql:///<the SQLite path>)
        "from dreamlake.lakeshore.server.app import _relay\n"
        "assert _relay(ctx) is None and ctx.polls.relay is None\n"
        "ctx.daemons.wrote('w', ctx.daemons.begin(), None)\n"
        "assert ctx.daemons.known('w') is None\n"
    )
    # a process of its own: app_from_env tunes the garbage collector of the process it runs in
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_single_process_over_sqlite_writes_on_its_loop(tmp_path: Path) -> None:
    code = (
        "from dreamlake.lakeshore.server.serve import ServeSpec, build_app, plane_context\n"
        f"ctx = plane_context(build_app(ServeSpec(db={str(tmp_path / 'l.db')!r})))\n"
        "assert ctx.writer.inline_lock is not None\n"
        "assert ctx.writer.inline_lock is ctx.store.inline_write_lock()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
