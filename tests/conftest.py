"""Shared fixtures. Real services skip on a laptop but fail in CI (LAKESHORE_REQUIRE_SERVICES=1)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# tests.host_users: the system users tests run tasks as, made once a run (even across xdist workers)
pytest_plugins = ["tests.integration.s3_fixture", "tests.integration.redis_fixture", "tests.host_users"]

ROOT = Path(__file__).resolve().parent.parent
# The suite deploys its own functions (tests/*) on every worker through PYTHONPATH, as a fleet with
# the code installed does, so its calls ship no code archive: the SDK's default ("auto") would pack
# the whole tests/ package into every call. The code-archive tests opt in (tests/code_kit.py);
# subprocesses (README examples, producers) inherit the same default.
os.environ.setdefault("LAKESHORE_CODE", "none")
REQUIRE_SERVICES = os.environ.get("LAKESHORE_REQUIRE_SERVICES") == "1"


def require(available: bool, reason: str) -> None:
    """Skip with ``reason`` when a real service is missing; in CI that is a failure instead."""
    if available:
        return
    if REQUIRE_SERVICES:
        pytest.fail(f"required service missing in CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def python_exe() -> str:
    """The interpreter the tests run under (the venv's python, which sees the installed packages)."""
    return sys.executable
