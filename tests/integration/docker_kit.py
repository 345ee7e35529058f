"""The Docker engine as the docker and gVisor tests use it: the engine, its runtimes, the suite's image.

``LAKESHORE_TEST_IMAGE`` names the image ``scripts/services/docker.sh`` builds (python3 and msgpack,
no dreamlake). :func:`suite_image` skips (a failure in CI) when the engine or the image is missing;
:func:`image` is the same as a module-scoped fixture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``docker ARGS`` with its output captured, bounded by ``timeout``."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def runtimes() -> dict[str, object] | None:
    """The engine's runtimes (``docker info``), or None without a reachable engine."""
    if shutil.which("docker") is None:
        return None
    try:
        out = docker("info", "--format", "{{json .Runtimes}}", timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return dict(json.loads(out.stdout)) if out.returncode == 0 else None


def suite_image() -> str:
    """``LAKESHORE_TEST_IMAGE`` when the engine has it; skips otherwise."""
    if runtimes() is None:
        pytest.skip("needs a reachable Docker engine (scripts/services/docker.sh)")
    name = os.environ.get("LAKESHORE_TEST_IMAGE", "")
    if not name or docker("image", "inspect", name).returncode != 0:
        pytest.skip("needs LAKESHORE_TEST_IMAGE on the engine (scripts/services/docker.sh builds one)")
    return name


@pytest.fixture(scope="module")
def image() -> str:
    return suite_image()


def require_kind(kind: str) -> None:
    """Skip a ``gvisor`` test when the engine has no ``runsc`` runtime."""
    if kind == "gvisor" and "runsc" not in (runtimes() or {}):
        pytest.skip("needs the runsc runtime registered with the engine")


def labelled(worker_id: str) -> list[str]:
    """The containers (any state) labelled for nymph's worker ``worker_id``."""
    out = docker("ps", "-a", "-q", "--filter", f"label=nymph.worker={worker_id}")
    return out.stdout.split()


def read_stripped(path: Path) -> str:
    """The file's text stripped, or "" while it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""
