"""User packages written on the fly, shipped with the call as code archives (``cfg["code"]``).

:func:`write_package` writes ``<dir>/<name>/__init__.py``: a package a new user would have next to
their script, never installed and never on a worker's ``PYTHONPATH``. Its ``which(release)`` waits
for the file ``release`` in the task's workdir (when given) and returns its version (a literal in
its body, so two versions differ in ``src_hash``) and the file it ran from, so a test tells the shipped copy from any other. :func:`load` imports it
(again, after an edit) the way the producer's script would.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import uuid
from pathlib import Path
from types import ModuleType

PACKAGE = """\
import os
import time

import dreamlake.lakeshore as dls

from {name} import helpers

@dls.udf
def which(release=None):
    while release is not None and not os.path.exists(release):
        time.sleep(0.01)
    return {{"version": {version!r}, "helper": helpers.tag(), "file": __file__, "sys_path0": os.environ.get("PYTHONPATH", "")}}
"""
HELPERS = """\
def tag():
    return {version!r} + "-helper"
"""


def unique_name() -> str:
    """A package name no interpreter on this host has seen: ``lk_user_<hex>``."""
    return f"lk_user_{uuid.uuid4().hex[:12]}"


def write_package(base: Path, name: str, version: str) -> Path:
    """Write (or rewrite) the package ``name`` under ``base`` at ``version``; its directory."""
    pkg = base / name
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(PACKAGE.format(name=name, version=version))
    (pkg / "helpers.py").write_text(HELPERS.format(version=version))
    (pkg / "data.bin").write_bytes(b"\0" * 64)  # listed in .gitignore: never shipped
    (pkg / ".gitignore").write_text("*.bin\n")
    cache = pkg / "__pycache__"
    shutil.rmtree(cache, ignore_errors=True)  # the producer's own bytecode of the last version: an
    cache.mkdir()  # edit within the same second at the same size would otherwise import stale code
    (cache / "stale.cpython-311.pyc").write_bytes(b"junk")
    return pkg


def load(base: Path, name: str) -> ModuleType:
    """Import (or re-import after an edit) the package ``name`` from ``base``, as the producer does."""
    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    importlib.invalidate_caches()
    return importlib.import_module(name)
