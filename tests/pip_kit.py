"""Wheels made by hand for the pip-environment tests: a local find-links directory, no index, no
network, no build backend (a wheel is a zip with a dist-info directory: PEP 427)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(
    dest: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()
) -> Path:
    """Write ``{name}-{version}-py3-none-any.whl`` holding ``files`` (path -> source) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = dict(files)
    entries[f"{dist}/METADATA"] = meta
    entries[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: lakeshore-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    entries[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in entries.items():
            zf.writestr(path, text)
    return wheel


def wheelhouse(dest: Path) -> Path:
    """``lsdemo`` 1.0 (``lsdemo.VALUE == 42``, needs ``lsdep``) and ``lsdep`` 1.0, in ``dest``."""
    make_wheel(
        dest,
        "lsdemo",
        "1.0",
        {"lsdemo/__init__.py": "from lsdep import BASE\nVALUE = BASE + 41\n"},
        ("lsdep",),
    )
    make_wheel(dest, "lsdep", "1.0", {"lsdep/__init__.py": "BASE = 1\n"})
    return dest
