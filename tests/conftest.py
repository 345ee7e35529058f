"""Shared fixtures. Real services skip on a laptop but fail in CI (LAKESHORE_REQUIRE_SERVICES=1)."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# tests.host_users: the system users tests run tasks as, made once a run (even across xdist workers)
pytest_plugins = [
    "tests.integration.s3_fixture",
    "tests.integration.redis_fixture",
    "tests.host_users",
    "tests.stack.fixtures",  # the one test stack: nymph_factory, server
]

ROOT = Path(__file__).resolve().parent.parent
# The suite deploys its own functions (tests/*) on every worker through PYTHONPATH, as a fleet with
# the code installed does, so its calls ship no code archive: the SDK's default ("auto") would pack
# the whole tests/ package into every call. The code-archive tests opt in (tests/code_kit.py);
# subprocesses (README examples, producers) inherit the same default.
os.environ.setdefault("LAKESHORE_CODE", "none")
REQUIRE_SERVICES = os.environ.get("LAKESHORE_REQUIRE_SERVICES") == "1"
# The master of the control plane's keys (store/keys.py) as a PostgreSQL deployment sets it: every
# in-process replica and ``lakeshore server`` subprocess of the suite shares it. Tests of the key
# file (tests/security/test_tenant_attacks.py) unset it for their own stack.
os.environ.setdefault("LAKESHORE_SERVER_KEY", "suite-only-server-key-" + "0123456789abcdef" * 2)


def require(available: bool, reason: str) -> None:
    """Skip with ``reason`` when a real service is missing; in CI that is a failure instead."""
    if available:
        return
    if REQUIRE_SERVICES:
        pytest.fail(f"required service missing in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def run_owned(cmd: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that owns what it started: the
    command runs in a session of its own, and whatever it leaves (its process group, and any
    descendant that made a session of its own: a ``lakeshore server`` a benchmark started) is
    killed when it ends, times out, or the test is interrupted (pytest-timeout)."""
    import psutil

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in family:
            with contextlib.suppress(psutil.Error):
                child.kill()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture(scope="session")
def python_exe() -> str:
    """The interpreter the tests run under (the venv's python, which sees the installed packages)."""
    return sys.executable


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``scripts/test.sh``), the files with the most ``slow`` tests go first.

    Each worker is handed whole files (``--dist loadfile``) in collection order
    (``--no-loadscope-reorder``): a long file handed out last would run on alone while the other
    workers sit idle, so the files of slow tests (real nymphs on every runner, the benchmarks, the
    fault suite) start first, then the rest, most tests first (small files fill the gaps at the end).
    Every worker sorts alike, as xdist requires; a run without xdist keeps the files' own order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        count[path] += 1
        slow[path] += item.get_closest_marker("slow") is not None
        first.setdefault(path, i)

    def order(item: pytest.Item) -> tuple[int, int, int]:
        path = item.nodeid.split("::", 1)[0]
        return (-slow[path], -count[path], first[path])

    items.sort(key=order)  # stable: a file's tests keep their order
