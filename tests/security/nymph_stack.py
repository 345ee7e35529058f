"""A nymph started as root, the way the systemd unit starts it, against a real control plane.

The security tests of nymph (issue 11) attack it as a producer would: through the producer routes,
with functions shipped by reference or scripts, and assert what the attacker sees (the ack's state
and error) and what happened on the host. Fixtures:

- :func:`task_user`: the task user :data:`TASK_USER` (``nymph-task``; ``nymph-task-gwN`` on an
  xdist worker), created with ``useradd --system`` when missing (and removed again at the end of
  the run: :mod:`tests.host_users`), with the first :data:`POOL` users of its pool
  ``{TASK_USER}-0`` .. (:func:`pool_uids`: the process runner runs
  each task as one of them, :mod:`nymph.taskuser`);
- :func:`readable_runtime`: an interpreter and a ``PYTHONPATH`` the task user can read (the system
  ``python3``, the entry bundle, and copies of the test modules): nymph's own venv may sit under a
  0700 ``/root``; nymph gets them as the process runner's ``python`` / ``pythonpath`` options;
- :func:`root_nymph`: starts ``nymph start`` (as root, token in a 0600 file) with extra flags.

Everything here needs root: it is skipped otherwise.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.envelope import Envelope
from tests.conftest import ROOT
from tests.host_users import ensure_user
from tests.integration.conftest import ControlPlane, running_control_plane, submit_body
from tests.stack.nymph import NymphProcess

# nymph's default task user on one test process; each pytest-xdist worker has a pool of its own
# (nymph-task-gw1, its pool nymph-task-gw1-0 ..): a root nymph reaps its pool users' processes as it
# leases and releases them (nymph.uidreap), and one worker's nymph must not kill another worker's
# nymph's start-up check or remove its tasks' files, as two nymphs sharing a pool on one host would
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
TASK_USER = f"nymph-task-{_WORKER}" if _WORKER else "nymph-task"
POOL = 4  # pool users the tests make: {TASK_USER}-0 .. -3 (concurrency 4 at most)
USER_FLAGS = ("--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin")
LIMIT_S = 60.0


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: these are the trust boundaries of a nymph that runs as root")


@pytest.fixture(scope="session")
def task_user() -> pwd.struct_passwd:
    require_root()
    for name in [TASK_USER, *(f"{TASK_USER}-{i}" for i in range(POOL))]:
        assert ensure_user(name, *USER_FLAGS), f"cannot create the task user {name}"
    return pwd.getpwnam(TASK_USER)


@pytest.fixture(scope="session")
def pool_uids(task_user: pwd.struct_passwd) -> set[int]:
    """The uids of the task user pool the tests made (a root nymph's process-runner tasks)."""
    return {pwd.getpwnam(f"{TASK_USER}-{i}").pw_uid for i in range(POOL)}


@pytest.fixture(scope="session")
def readable_runtime() -> Iterator[tuple[str, list[str]]]:
    """``(python, pythonpath)`` the task user can run and read."""
    from dreamlake.lakeshore.daemon.bundle import build_bundle

    require_root()
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")
    if not python:
        pytest.skip("needs a system python3 (/usr/bin/python3) the task user can run")
    base = Path(tempfile.mkdtemp(prefix="nymph-sec-runtime-"))
    try:
        os.chmod(base, 0o755)
        bundle = build_bundle(base / "lakeshore-entry.zip")
        for package, names in (
            ("tests", ("__init__.py", "nymph_fns.py")),
            ("tests/security", ("__init__.py", "attack_fns.py")),
        ):
            (base / package).mkdir(mode=0o755)
            for name in names:
                shutil.copyfile(ROOT / package / name, base / package / name)
        for path in base.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        yield python, [str(bundle), str(base)]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    with running_control_plane(str(tmp_path / "lakeshore.db")) as cp:
        yield cp


class RootNymph(NymphProcess):
    """``nymph start`` as root in a subprocess (its own session); its log in a file shown when a test fails."""

    def __init__(self, base: Path, args: list[str]) -> None:
        super().__init__(args, base / "nymph.log", base / "work", base / "state")
        self.base = base

    def start(self, env: dict[str, str] | None = None) -> RootNymph:
        super().start(env)
        return self


def nymph_args(cp: ControlPlane, base: Path, runtime: tuple[str, list[str]] | None, *extra: str) -> list[str]:
    """``nymph start`` as the systemd unit runs it: the token in a 0600 file, nothing else privileged.

    ``runtime``: the process runner's ``python`` / ``pythonpath`` (None: another runner, in ``extra``).
    """
    token_file = base / "token"
    token_file.write_text(cp.daemon_token + "\n")
    os.chmod(token_file, 0o600)
    args = [
        sys.executable, "-m", "nymph", "start", "--server", cp.url, "--token-file", str(token_file),
        "--queue", "default", "--workdir", str(base / "work"), "--state-dir", str(base / "state"),
        "--heartbeat-s", "0.5", "--poll-timeout-s", "2", "--stop-grace-s", "0.5",
        "--task-user", TASK_USER,  # (a test's own --task-user in ``extra`` comes later: it wins)
    ]  # fmt: skip
    if runtime is not None:
        python, pythonpath = runtime
        paths = ", ".join(f'"{p}"' for p in pythonpath)
        args += ["--runner-opt", f"python={python}", "--runner-opt", f"pythonpath=[{paths}]"]
    return [*args, *extra]


@pytest.fixture
def root_nymph(
    plane: ControlPlane, task_user: pwd.struct_passwd, readable_runtime: tuple[str, list[str]]
) -> Iterator[Callable[..., RootNymph]]:
    started: list[RootNymph] = []

    def make(*extra: str, process: bool = True) -> RootNymph:
        base = Path(tempfile.mkdtemp(prefix="nymph-sec-"))
        os.chmod(base, 0o711)
        n = RootNymph(base, nymph_args(plane, base, readable_runtime if process else None, *extra))
        started.append(n)
        return n.start()

    yield make
    for n in started:
        n.stop()
        if n.proc is not None and n.proc.returncode not in (0, None):
            print(n.output()[-5000:])
        shutil.rmtree(n.base, ignore_errors=True)


# --- the attacker's side: producer routes --------------------------------------------------------


def call(cp: ControlPlane, path: str, body: Any, token: str | None = None, timeout: float = 90.0) -> Any:
    resp = httpx.post(
        cp.url + path,
        content=msgpack.packb(body, use_bin_type=True),
        headers={
            "Authorization": f"Bearer {token or cp.admin_token}",
            "Content-Type": "application/x-msgpack",
        },
        timeout=timeout,
    )
    assert resp.status_code == 200, (resp.status_code, resp.content[:300])
    return msgpack.unpackb(resp.content, raw=False)


def submit(cp: ControlPlane, args_blob: bytes = b"\x90", **run_config: Any) -> str:
    """Submit an invocation (with the admin token: the control plane may keep scripts from others)."""
    body = submit_body(ids.new_ulid(), "default", run_config=run_config, args_blob=args_blob)
    return str(call(cp, "/v1/producer/submit", body)["invocation_id"])


def await_result(cp: ControlPlane, invocation_id: str, limit_s: float = LIMIT_S) -> dict[str, Any]:
    out = call(cp, "/v1/producer/await", {"invocation_id": invocation_id, "timeout_s": limit_s})
    assert out["state"] != "pending", f"invocation {invocation_id} did not finish"
    return dict(out)


def ref(module: str, qualname: str, *args: Any) -> bytes:
    """An Envelope naming ``module:qualname`` by reference (any importable callable)."""
    return Envelope.create({"kind": "ref", "module": module, "qualname": qualname}, args, {}).to_bytes()
