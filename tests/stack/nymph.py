"""``nymph start`` as a subprocess: the operator's way (the console script, signals), its log in a file.

:class:`NymphProcess` owns one ``nymph`` process in a session of its own (so ``kill -9`` reaches
nymph alone, as a crash would, and teardown kills what is left of its group); :class:`Nymph` builds
the command line the integration suite uses (short heartbeat, poll and grace); :class:`UserNymph`
also puts ``tests/user_code`` on the tasks' ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.stack.procs import child_env, kill_group
from tests.stack.wait import LIMIT_S

NYMPH = [sys.executable, "-m", "nymph"]
# Tests run nymph as whoever runs them (root in CI) and their tasks import from the checkout: tasks
# run as nymph's own user, which for root takes the operator's flag (tests/security/ runs nymph as
# root with a task user instead).
ROOT_TASKS = ["--allow-root-tasks"] if os.geteuid() == 0 else []
USER_CODE = Path(__file__).resolve().parents[1] / "user_code"


class NymphProcess:
    """One ``nymph`` command line (``args``) in a session of its own, logging to ``log``."""

    def __init__(self, args: list[str], log: Path, workdir: Path, state_dir: Path) -> None:
        self.args = args
        self.log = log
        self.workdir = workdir
        self.state_dir = state_dir
        self.cwd: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """The environment ``nymph start`` runs with."""
        return child_env()

    def start(self, env: dict[str, str] | None = None) -> NymphProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env or self.env(),
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = LIMIT_S) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """``kill -9`` of nymph alone: its tasks live on, as after a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(20)

    def stop(self) -> None:
        """Two SIGINTs (stop now), the process killed after 20 s; then whatever is left of its group."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_group(self.proc)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Nymph(NymphProcess):
    """``nymph start`` against ``server`` with ``token``, its work and state under ``base``."""

    def __init__(self, server: str, token: str, base: Path, *extra: str, queue: str = "default") -> None:
        workdir, state_dir = base / "work", base / "state"
        args = [
            *NYMPH, "start", "--server", server, "--token", token, "--queue", queue,
            "--workdir", str(workdir), "--state-dir", str(state_dir),
            "--heartbeat-s", "0.5", "--poll-timeout-s", "2", "--stop-grace-s", "0.5",
            "--log-level", "INFO", *ROOT_TASKS, *extra,
        ]  # fmt: skip
        super().__init__(args, base / "nymph.log", workdir, state_dir)

    def start(self, env: dict[str, str] | None = None) -> Nymph:
        super().start(env)
        return self


class UserNymph(Nymph):
    """``nymph start`` whose PYTHONPATH also holds tests/user_code (user modules that live apart
    from the repository, as a user's own code does)."""

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join([str(USER_CODE), env["PYTHONPATH"]])
        return env
