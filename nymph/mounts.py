"""One ``--mount NAME=/host/path[:ro]`` declaration, parsed (the config resolver and the task
environment both read it; its own module so that neither imports the other)."""

from __future__ import annotations

import os

from dreamlake.lakeshore.runenv import MOUNT_NAME as _MOUNT_NAME  # what a call may ask for, too
from nymph.errors import ConfigError


def parse_mount(spec: str) -> tuple[str, str, bool]:
    """``NAME=/host/path[:ro|:rw]`` -> ``(name, path, read_only)``; ConfigError says what is wrong.

    A mount is read-write unless it says ``:ro``. ``NAME=pvc:CLAIM[:ro]`` names a
    PersistentVolumeClaim (the kube runner only)."""
    name, sep, rest = str(spec).partition("=")
    name = name.strip()
    if not sep or not _MOUNT_NAME.fullmatch(name):
        raise ConfigError(
            f"--mount: expected NAME=/host/path[:ro] with NAME of letters, digits, _ and -, got {spec!r}"
        )
    read_only = False
    for suffix, ro in ((":ro", True), (":rw", False)):
        if rest.endswith(suffix):
            rest, read_only = rest[: -len(suffix)], ro
            break
    if rest.startswith("pvc:") and len(rest) > 4:
        return name, rest, read_only
    if not os.path.isabs(rest):
        raise ConfigError(f"--mount {name}: the host path must be absolute, got {rest!r}")
    return name, os.path.normpath(rest), read_only
