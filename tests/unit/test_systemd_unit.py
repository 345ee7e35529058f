"""The systemd unit and its example config: valid for systemd, and consistent with nymph itself.

``systemd-analyze verify`` checks the unit when it is installed (it works without systemd as PID
1); the settings nymph relies on are asserted from a parse of the file either way, and the example
TOML and env file must resolve through nymph's own config loader.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nymph.config import NymphConfig, from_env, resolve
from nymph.taskuser import pool_names
from nymph.upgrade import EXIT_VERSION_MISMATCH
from tests.unit.deploy_kit import parse_unit, seconds

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "nymph.service"
TOML = ROOT / "systemd" / "nymph.toml.example"
ENV = ROOT / "systemd" / "nymph.env.example"
EXIT_AUTH = 77  # nymph.agent.EXIT_AUTH: a rejected token; restarting cannot help


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def one(service: dict[str, list[str]], key: str) -> str:
    values = service.get(key)
    assert values, f"{key}= is not set in {UNIT.name}"
    return values[-1]


def test_notify_with_watchdog(service: dict[str, list[str]]) -> None:
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"
    assert seconds(one(service, "WatchdogSec")) > 0


def test_start_command_reads_the_config_file(service: dict[str, list[str]]) -> None:
    argv = one(service, "ExecStart").split()
    assert argv[:2] == ["/usr/local/bin/nymph", "start"]
    assert argv[argv.index("--config") + 1] == "/etc/nymph/nymph.toml"
    assert "-/etc/nymph/nymph.env" in service["EnvironmentFile"]  # optional: "-" prefix


def test_stop_leaves_time_for_the_shutdown_grace(service: dict[str, list[str]]) -> None:
    assert one(service, "KillSignal") == "SIGTERM"
    assert one(service, "KillMode") == "mixed"
    defaults = NymphConfig(server="x", token="x")
    example = resolve({}, {"NYMPH_TOKEN": "x"}, TOML)
    needed = max(defaults.grace_s + defaults.stop_grace_s, example.grace_s + example.stop_grace_s)
    assert seconds(one(service, "TimeoutStopSec")) > needed


def test_restart_policy_matches_nymphs_exit_codes(service: dict[str, list[str]]) -> None:
    assert one(service, "Restart") == "always"
    assert str(EXIT_VERSION_MISMATCH) in " ".join(service["RestartForceExitStatus"]).split()
    assert str(EXIT_AUTH) in " ".join(service["RestartPreventExitStatus"]).split()
    from nymph.agent import EXIT_AUTH as agent_exit_auth

    assert agent_exit_auth == EXIT_AUTH


def test_hardening_keeps_runuser_and_gpus_working(service: dict[str, list[str]]) -> None:
    # runuser (as_user) and setuid helpers in tasks need privileges NoNewPrivileges removes.
    assert service.get("NoNewPrivileges", ["no"])[-1] in ("no", "false", "0")
    assert "User" not in service  # root: CAP_SETUID/CAP_SETGID/CAP_CHOWN for as_user
    assert "CapabilityBoundingSet" not in service
    # Device filtering would take /dev/nvidia* away from tasks.
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock"):
        assert key not in service, key
    assert one(service, "ProtectSystem") in ("full", "true", "yes")
    assert one(service, "StateDirectory") == "nymph"


def test_tasks_run_as_the_sysusers_task_users_in_delegated_cgroups(service: dict[str, list[str]]) -> None:
    assert one(service, "Delegate") == "yes"  # nymph-tasks/<task> below the unit's cgroup is nymph's
    sysusers = (ROOT / "systemd" / "nymph-sysusers.conf").read_text()
    entries = [line.split() for line in sysusers.splitlines() if line.strip() and not line.startswith("#")]
    cfg = NymphConfig(server="x", token="x")
    # the shared task user, then the pool: one user per running task (nymph.taskuser)
    assert [e[:3] for e in entries] == [["u", name, "-"] for name in [cfg.task_user, *pool_names(cfg)]]
    assert len(pool_names(cfg)) == 64
    example = resolve({}, {"NYMPH_TOKEN": "x"}, TOML)
    assert example.task_user == "nymph-task" and not example.allow_root_tasks and not example.allow_script
    assert not example.allow_exec and not example.shared_task_user


def test_example_config_resolves_with_nymphs_loader(service: dict[str, list[str]], tmp_path: Path) -> None:
    env = {}
    for line in ENV.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and key == key.strip() and key.isupper(), f"bad env line {line!r}"
            env[key] = value
    assert "NYMPH_TOKEN" not in env  # the token is a credential file, never in the env file
    # the unit: LoadCredential=token:/etc/nymph/token, Environment=NYMPH_TOKEN_FILE=%d/token
    assert "token:/etc/nymph/token" in service["LoadCredential"]
    assert "NYMPH_TOKEN_FILE=%d/token" in service["Environment"]
    credential = tmp_path / "token"
    credential.write_text("lsk_daemon_example\n")
    credential.chmod(0o400)  # as systemd hands credentials over
    cfg = resolve({}, {**env, "NYMPH_TOKEN_FILE": str(credential)}, TOML)
    assert cfg.token == "lsk_daemon_example"
    assert cfg.server.startswith("https://")
    assert cfg.runner == "process"
    assert cfg.workdir.is_relative_to("/var/lib/nymph") and cfg.state_dir.is_relative_to("/var/lib/nymph")
    assert not cfg.allow_pickled and not cfg.auto_upgrade


def test_env_example_names_only_settings_nymph_reads() -> None:
    names = re.findall(r"^#?\s*(NYMPH_[A-Z_]+)=", ENV.read_text(), re.M)
    assert names
    for name in names:
        if name in ("NYMPH_GPUS", "NYMPH_CONFIG"):  # read by the CLI, not settings of the file
            continue
        assert from_env({name: "1"}), f"{name} is not a nymph setting"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart= exists: point it at a stand-in executable.
    fake = tmp_path / "nymph"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    unit = tmp_path / "nymph.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/nymph", str(fake)))
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if "nymph.service" in line]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr
