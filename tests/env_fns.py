"""Functions of the environment tests (docs/nymph.md "Environments"): importable by the tasks
through the checkout on PYTHONPATH; ``lsdemo`` and ``lsdep`` exist only in the wheels
tests/pip_kit.py makes, never on the host."""

from __future__ import annotations

import os
from typing import Any

import dreamlake.lakeshore as dls


@dls.udf(pip=["lsdemo==1.0"])
def uses_lsdemo() -> dict[str, Any]:
    import lsdemo

    return {"value": lsdemo.VALUE, "file": lsdemo.__file__, "msgpack": __import__("msgpack").__file__}


@dls.udf(pip=["lsdep"])
def uses_lsdep() -> str:
    import lsdep

    return str(lsdep.__file__)


@dls.udf(pip=["nosuchpkg-lakeshore-zz==9.9"], max_attempts=3)
def needs_a_missing_package() -> None:
    raise AssertionError("never runs: its environment cannot be built")


@dls.udf(env={"OMP_NUM_THREADS": "4", "LS_FROM_UDF": "udf"})
def env_of(*names: str) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


@dls.udf(mounts=["datasets"])
def read_mount(name: str) -> dict[str, Any]:
    path = os.environ["LAKESHORE_MOUNT_DATASETS"]
    with open(os.path.join(path, name)) as fh:
        return {"path": path, "text": fh.read()}


@dls.udf(mounts=["nosuchmount"])
def wants_unknown_mount() -> None:
    raise AssertionError("never runs: the mount is not offered")


@dls.udf(secrets=["LS_TEST_SECRET"])
def secret_digest() -> dict[str, Any]:
    """The secret's sha256 (never the value: a result is stored) and the task's own credential."""
    import hashlib

    value = os.environ.get("LS_TEST_SECRET")
    token = os.environ.get("LAKESHORE_TOKEN")
    if token is None and os.environ.get("LAKESHORE_TOKEN_FILE"):  # the credential in its file
        with open(os.environ["LAKESHORE_TOKEN_FILE"]) as fh:
            token = fh.read().strip()
    return {
        "sha256": None if value is None else hashlib.sha256(value.encode()).hexdigest(),
        "token": token,
        "invocation_id": os.environ.get("LAKESHORE_INVOCATION_ID"),
    }
