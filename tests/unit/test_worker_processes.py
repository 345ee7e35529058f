"""A process of ``lakeshore server --workers N`` knows it has siblings: work they take in may wake
nothing here, so its polls re-check often and none skips its pass (``server/idle.py``)."""

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
        "ctx.daemons.wrote('w', ctx.daemons.begin(), None)\n"
        "assert ctx.daemons.known('w') is None\n"
    )
    # a process of its own: app_from_env tunes the garbage collector of the process it runs in
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
