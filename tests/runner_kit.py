"""Shared scaffolding for the runner tests: prepare tasks the way nymph does, start, clean up.

Used by ``tests/contract/test_runner_conformance.py`` and the docker, slurm and kube runner tests
in ``tests/integration``. Each of those keeps its own fixtures and builds them on :class:`TaskFactory`.

A ``@dls.udf`` function becomes the Envelope its ``.submit()`` would send (through its Thunk: the
``scope`` prefix in force is captured), and the task's invocation id is that Envelope's id, as on
the control plane. :data:`USER_CODE` holds user modules that live apart from the repository (the
README's module): it is put on ``sys.path`` here, so they import as top-level modules.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.decorator import UDF
from dreamlake.lakeshore.envelope import Envelope, fn_for
from nymph.runner import Handle, Runner, Task
from tests.conftest import require
from tests.stack.wait import until

LIMIT_S = 60.0
__all__ = ["until"]  # the stack's wait, for the runner tests that take it from here
USER_CODE = Path(__file__).resolve().parent / "user_code"
if str(USER_CODE) not in sys.path:
    sys.path.append(str(USER_CODE))


def user_module(name: str) -> Any:
    """The user module ``name`` from :data:`USER_CODE` (a top-level module, as a user's would be)."""
    import importlib

    return importlib.import_module(name)


def envelope_of(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    """What ``.submit()`` sends for a ``@dls.udf`` (scope prefix captured); any other function by ref."""
    if isinstance(fn, UDF):
        return fn.thunk(*args, **kwargs).to_envelope()
    return Envelope.create(fn_for(fn, "ref"), args, kwargs)


class TaskFactory:
    """Prepares workdirs the way nymph does, starts tasks, and destroys every started handle.

    ``env_extra`` and ``labels_extra`` are added to the base env (``LAKESHORE_INVOCATION_ID``,
    ``LAKESHORE_ALLOW_PICKLED=0``, ``LAKESHORE_CAPTURE_OUTPUT=1``, ``PYTHONUNBUFFERED=1``) and labels (``nymph.invocation``) of every task. The workdir and
    its files are chowned to ``owner`` when given per task, else to the ``as_user`` account when
    ``own_as_user`` is set, else to the factory's ``owner``.
    """

    def __init__(
        self,
        root: Path,
        *,
        env_extra: Mapping[str, str] | None = None,
        labels_extra: Mapping[str, str] | None = None,
        owner: tuple[int, int] | None = None,
        own_as_user: bool = False,
    ) -> None:
        self.root = root
        self.env_extra = dict(env_extra or {})
        self.labels_extra = dict(labels_extra or {})
        self.owner = owner
        self.own_as_user = own_as_user
        self.handles: list[tuple[Runner, Handle]] = []

    def task(
        self,
        fn: Callable[..., Any] | None,
        *args: Any,
        script: str | None = None,
        as_user: str | None = None,
        run_config: dict[str, Any] | None = None,
        gpus: list[str] | None = None,
        labels: Mapping[str, str] | None = None,
        owner: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> Task:
        """A fresh 0700 workdir holding args.msgpack for ``fn(*args, **kwargs)`` (none when ``fn`` is None)."""
        envelope = envelope_of(fn, args, kwargs) if fn is not None else None
        invocation_id = envelope.id if envelope is not None else ids.new_ulid()
        workdir = self.root / invocation_id
        workdir.mkdir(mode=0o700)
        if envelope is not None:
            (workdir / "args.msgpack").write_bytes(envelope.to_bytes())
        for name in ("stdout.log", "stderr.log"):  # as nymph's workdir.create leaves them
            (workdir / name).write_bytes(b"")
            os.chmod(workdir / name, 0o644)
        if owner is None and self.own_as_user and as_user:
            pw = pwd.getpwnam(as_user)
            owner = (pw.pw_uid, pw.pw_gid)
        if owner is None:
            owner = self.owner
        if owner is not None:
            for path in (workdir, *workdir.iterdir()):
                os.chown(path, *owner)
        return Task(
            invocation_id=invocation_id,
            attempt=1,
            workdir=workdir,
            env={
                "LAKESHORE_INVOCATION_ID": invocation_id,
                "LAKESHORE_ALLOW_PICKLED": "0",
                "LAKESHORE_CAPTURE_OUTPUT": "1",  # as nymph's Job sets it
                "PYTHONUNBUFFERED": "1",
                **self.env_extra,
            },
            script=script,
            as_user=as_user,
            run_config=run_config if run_config is not None else {},
            gpus=gpus if gpus is not None else [],
            labels={"nymph.invocation": invocation_id, **self.labels_extra, **(labels or {})},
        )

    def start(self, runner: Runner, task: Task) -> Handle:
        """Start ``task``, persist its handle in the workdir, and remember it for :meth:`destroy_all`."""
        handle = start_saved(runner, task)
        self.handles.append((runner, handle))
        return handle

    def destroy_all(self, ignore: tuple[type[BaseException], ...] = ()) -> None:
        """Destroy every handle :meth:`start` made; exceptions of the ``ignore`` types are swallowed."""
        for runner, handle in self.handles:
            try:
                runner.destroy(handle)
            except ignore:
                pass


def start_saved(runner: Runner, task: Task) -> Handle:
    """Start ``task`` and persist its handle in the workdir, as nymph does (not remembered)."""
    handle = runner.start(task)
    handle.save(task.workdir)
    return handle


def frames(workdir: Path) -> list[wire.Frame]:
    """The frames journal so far; empty when the task has written none yet."""
    try:
        return wire.FrameReader().feed((workdir / "frames.msgpack").read_bytes())
    except FileNotFoundError:
        return []


def result(task: Task) -> Any:
    """The unpacked result.msgpack of a finished task."""
    return wire.unpack((task.workdir / "result.msgpack").read_bytes())


def docker_runtimes() -> str | None:
    if shutil.which("docker") is None:
        return None
    try:
        out = subprocess.run(
            ["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def slurm_answers() -> bool:
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def options_for(name: str) -> dict[str, Any]:
    """Keyword options each runner is constructed with in this suite."""
    if name == "process":
        return {"prefork": False}
    if name == "process-prefork":  # the process runner's warm-fork (zygote) mode
        return {"prefork": True}
    if name == "process-warm":  # the process runner's warm mode (trusted code, many calls per worker)
        return {"warm": True, "warm_workers": 2}
    if name == "process-pgroup":  # no task cgroups: process groups and the stray walk
        return {"prefork": False, "cgroup": "off"}
    if name == "slurm":
        require(slurm_answers(), 'needs a Slurm controller: eval "$(scripts/services/slurm.sh)"')
        return {}
    runtimes = docker_runtimes()
    require(runtimes is not None, "needs a reachable Docker engine")
    if name == "gvisor":
        require("runsc" in (runtimes or ""), "needs the runsc runtime registered with Docker")
    image = os.environ.get("LAKESHORE_TEST_IMAGE")
    require(bool(image), "needs LAKESHORE_TEST_IMAGE (an image with python3 and msgpack)")
    return {"image": image}
