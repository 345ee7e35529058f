"""A whole stack on one machine: ``lakeshore server`` + ``nymph start``, as real processes.

This is what the README's main job, the dispatch benchmark and a user trying lakeshore on a laptop
run: the control plane on its embedded SQLite default in a temporary data directory, one nymph with
the process runner (or ``runner="docker"`` / ``"gvisor"`` with ``runner_options`` such as
``{"image": ...}``, passed as ``--runner-opt``), both on loopback, torn down on exit::

    with LocalStack(queues=["demo"], pythonpath=["examples"]) as stack:
        q = dls.SyncQueue("demo", dispatch=stack.plane())
        inv = add.submit(2, 3, _dispatch=stack.plane())
        print(q.result(inv))

``start()`` returns once nymph has registered for every queue (so a first submit never races its
start-up). With ``quiet=True`` both processes write to ``server.log`` and ``nymph.log`` in the
stack's directory instead of the terminal; a failed start quotes the log's last lines.

Nothing here is a fake: the processes, HTTP and SQLite are the ones production uses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from dreamlake.lakeshore.dispatch.http import HttpDispatch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _console_script(name: str) -> list[str]:
    """The console script beside this interpreter, or ``python -m`` of its module."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return [str(candidate)]
    module = {"lakeshore": "dreamlake.lakeshore.cli", "nymph": "nymph"}[name]
    return [sys.executable, "-m", module]


def runner_opt_value(value: Any) -> str:
    """A runner option as ``nymph start --runner-opt KEY=VALUE`` reads it (a TOML value, or a string)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {runner_opt_value_toml(v)}" for k, v in value.items()) + "}"
    return runner_opt_value_toml(value)


def runner_opt_value_toml(value: Any) -> str:
    if isinstance(value, Mapping):
        return runner_opt_value(value)
    return json.dumps(value)  # bools, numbers, strings and lists of them are the same in TOML


class StackError(RuntimeError):
    """The local stack could not start; the message says which process and why."""


class LocalStack:
    """Start a control plane and a nymph; stop both (SIGTERM, then SIGKILL) on exit."""

    def __init__(
        self,
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int = 2,
        runner: str = "process",
        runner_options: Mapping[str, Any] | None = None,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        nymph_args: Sequence[str] = (),
        data_dir: Path | None = None,
        quiet: bool = False,
    ) -> None:
        self.queues = list(queues)
        self.concurrency = concurrency
        self.runner = runner
        self.runner_options = dict(runner_options or {})
        self.pythonpath = [str(Path(p).resolve()) for p in pythonpath]
        self.nymph_args = list(nymph_args)
        self._own_dir = data_dir is None
        self.dir = data_dir or Path(tempfile.mkdtemp(prefix="lakeshore-stack-"))
        self.quiet = quiet
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tokens: dict[str, str] = {}
        self.server: subprocess.Popen[bytes] | None = None
        self.nymph: subprocess.Popen[bytes] | None = None
        self._planes: list[HttpDispatch] = []
        self._logs: list[Any] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        path = [*self.pythonpath, env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        return env

    def log_path(self, name: str) -> Path:
        """Where a quiet stack's ``server`` or ``nymph`` writes its output."""
        return self.dir / f"{name}.log"

    def _out(self, name: str) -> Any:
        if not self.quiet:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        fh = open(self.log_path(name), "ab")  # noqa: SIM115 (closed in stop())
        self._logs.append(fh)
        return fh

    def _tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return ""
        return "; its log ends:\n" + "\n".join(text.splitlines()[-lines:]) if text else ""

    def start(self) -> None:
        cp_dir = self.dir / "cp"
        out = self._out("server")
        self.server = subprocess.Popen(
            [*_console_script("lakeshore"), "server", "--port", str(self.port), "--data-dir", str(cp_dir)],
            env=self._env(),
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
        )
        self.wait_healthy()
        self.tokens = json.loads((cp_dir / "tokens.json").read_text())
        self.start_nymph()
        self.wait_registered()

    def start_nymph(self) -> None:
        """``nymph start`` with the daemon token in its environment (never on a command line).

        A development stack runs its tasks as the user who started it, like the code around it;
        run as root (a CI container), that takes ``--allow-root-tasks``, passed here.
        """
        args = [
            *_console_script("nymph"), "start", "--server", self.url,
            "--runner", self.runner, "--concurrency", str(self.concurrency),
            "--workdir", str(self.dir / "work"), "--state-dir", str(self.dir / "state"),
        ]  # fmt: skip
        if os.geteuid() == 0:
            args.append("--allow-root-tasks")
        for q in self.queues:
            args += ["--queue", q]
        for key, value in self.runner_options.items():
            args += ["--runner-opt", f"{key}={runner_opt_value(value)}"]
        out = self._out("nymph")
        self.nymph = subprocess.Popen(
            [*args, *self.nymph_args],
            env={**self._env(), "NYMPH_TOKEN": self.tokens["daemon"]},
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
        )

    def wait_registered(self, timeout: float = 60.0) -> None:
        """Until a live worker serves every queue of the stack (nymph has registered)."""
        headers = {"Authorization": f"Bearer {self.tokens['admin']}"}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.nymph is not None
            if self.nymph.poll() is not None:
                raise StackError(
                    f"nymph exited early with status {self.nymph.returncode}{self._tail('nymph')}"
                )
            try:
                r = httpx.get(f"{self.url}/v1/ops/queues", headers=headers, timeout=5.0)
                served = {q["name"] for q in r.json()["queues"] if q["workers_live"]}
                if r.status_code == 200 and served >= set(self.queues):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        raise StackError(
            f"nymph did not register with {self.url} within {timeout:.0f} s{self._tail('nymph')}"
        )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.server is not None
            if self.server.poll() is not None:
                raise StackError(
                    f"lakeshore server exited early with status {self.server.returncode}{self._tail('server')}"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise StackError(f"lakeshore server did not answer /healthz at {self.url} within {timeout:.0f} s")

    def plane(self) -> HttpDispatch:
        """An HttpDispatch with the admin token (closed with the stack)."""
        from dreamlake.lakeshore.dispatch.http import HttpDispatch

        plane = HttpDispatch(self.url, self.tokens["admin"])
        self._planes.append(plane)
        return plane

    def stop(self, timeout: float = 30.0) -> None:
        for plane in self._planes:
            plane.close()
        self._planes.clear()
        for proc in (self.nymph, self.server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for fh in self._logs:
            fh.close()
        self._logs.clear()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
