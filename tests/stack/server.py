"""``lakeshore server`` as a subprocess: started, stopped, killed and restarted on one port and data dir."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.stack.ports import free_port
from tests.stack.procs import ROOT, child_env, kill_group
from tests.stack.wait import LIMIT_S, until


class Server:
    """``python -m dreamlake.lakeshore.cli server`` over ``data_dir`` (SQLite) on a free loopback port.

    It runs in a session of its own: :meth:`kill` is ``kill -9`` of its whole group (a crash), and
    :meth:`stop` (SIGTERM, then the group killed after 20 s) is what fixtures call at teardown. The
    first start mints the admin and daemon tokens into ``tokens.json`` (:meth:`tokens`).
    ``extra``: more ``lakeshore server`` flags; ``env``: the environment (:func:`child_env` when
    None); ``ca_file``: the server serves HTTPS with a certificate this CA signed (its certificate
    and key come in ``env``), and :meth:`up` trusts it; ``port``: a given port (a free one when None).
    """

    def __init__(
        self,
        data_dir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        ca_file: str | None = None,
        port: int | None = None,
    ) -> None:
        self.data_dir = data_dir
        if log is None:  # the log's home; otherwise the server makes its data directory itself
            data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        self.ca_file = ca_file
        self.verify: Any = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.extra = list(extra)
        self.env = env if env is not None else child_env()
        self.log = log or data_dir / "server.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, limit_s: float = LIMIT_S) -> Server:
        """Start it and wait for ``/healthz``; fails with its log should it exit first."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
                start_new_session=True,
            )

        def up_or_exited() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"lakeshore server exited ({self.proc.returncode}):\n{self.output()[-5000:]}"
                )
            return self.up()

        until(up_or_exited, "the control plane to answer", limit_s)
        return self

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dreamlake.lakeshore.cli", "server", "--port", str(self.port),
                "--data-dir", str(self.data_dir), *self.extra]  # fmt: skip

    def up(self) -> bool:
        """Whether ``/healthz`` answers 200."""
        try:
            return httpx.get(self.url + "/healthz", timeout=2, verify=self.verify).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM, and the group killed should it not exit within 20 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        kill_group(self.proc)  # whatever the server's session still holds

    def kill(self) -> None:
        """``kill -9`` of the server and every process of its session (its leader gone or not)."""
        kill_group(self.proc, signal.SIGKILL)

    def tokens(self) -> dict[str, str]:
        """The tokens the first start minted (``admin``, ``daemon``)."""
        return dict(json.loads((self.data_dir / "tokens.json").read_text()))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
