"""nymph's config: flags over NYMPH_* environment over the TOML file, resolved once."""

from __future__ import annotations

from pathlib import Path

import pytest

from nymph.config import ConfigError, resolve


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nymph.toml"
    path.write_text(text)
    return path


def test_flags_win_over_env_over_file(tmp_path: Path) -> None:
    cfg_file = _write(
        tmp_path,
        'server = "http://file"\ntoken = "file-token"\nconcurrency = 2\nqueue = ["a"]\n'
        'grace-s = 7\n[runner_options]\npython = "/usr/bin/python3"\n',
    )
    env = {"NYMPH_TOKEN": "env-token", "NYMPH_CONCURRENCY": "3", "NYMPH_QUEUE": "b,c"}
    cfg = resolve({"concurrency": 4, "queues": ()}, env, cfg_file)
    assert cfg.server == "http://file"
    assert cfg.token == "env-token"
    assert cfg.concurrency == 4
    assert cfg.queues == ("b", "c")
    assert cfg.grace_s == 7.0
    assert cfg.runner_options == {"python": "/usr/bin/python3"}


def test_env_parsing_of_bools_labels_and_paths(tmp_path: Path) -> None:
    env = {
        "NYMPH_SERVER": "http://cp:8080/",
        "NYMPH_TOKEN": "t",
        "NYMPH_ALLOW_PICKLED": "yes",
        "NYMPH_LABEL": "zone=a, gpu=h200",
        "NYMPH_WORKDIR": str(tmp_path / "w"),
        "NYMPH_ALLOW_USER": "alice,bob",
    }
    cfg = resolve({}, env)
    assert cfg.server == "http://cp:8080"
    assert cfg.allow_pickled is True
    assert cfg.labels == {"zone": "a", "gpu": "h200"}
    assert cfg.workdir == tmp_path / "w"
    assert cfg.allow_users == ("alice", "bob")


def test_config_is_frozen_and_token_is_redacted() -> None:
    cfg = resolve({"server": "http://x", "token": "secret"}, {})
    with pytest.raises(AttributeError):
        cfg.token = "other"  # type: ignore[misc]
    assert "secret" not in repr(cfg.redacted())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"token": "t"}, "missing server"),
        ({"server": "http://x", "token": "t", "concurrency": 0}, "concurrency"),
        ({"server": "http://x", "token": "t", "labels": ("nokey",)}, "k=v"),
        ({"server": "http://x", "token": "t", "allow_pickled": "maybe"}, "boolean"),
    ],
)
def test_bad_config_names_the_setting(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(flags, {})


def test_unknown_key_in_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        resolve({"server": "http://x", "token": "t"}, {}, _write(tmp_path, 'colour = "red"\n'))


def test_runner_opts_from_flags_env_and_file_merge_key_by_key_with_types(tmp_path: Path) -> None:
    cfg_file = _write(
        tmp_path,
        'server = "http://s"\ntoken = "t"\nrunner = "docker"\n'
        '[runner_options]\nimage = "from-file"\nnetwork = "none"\npids = 64\n',
    )
    env = {"NYMPH_RUNNER_OPT_PIDS": "2048", "NYMPH_RUNNER_OPT_MEMORY": "512m"}
    flags = {
        "runner_opts": (
            "image=python:3.11-slim",
            "read-only=true",
            "cpus=1.5",
            'allowed_images=["python:3.11-slim", "registry.example/"]',
            'users={alice = "1000:1000"}',
            "code_dirs=/srv/a,/srv/b",
        )
    }
    cfg = resolve(flags, env, cfg_file)
    assert cfg.runner_options == {
        "image": "python:3.11-slim",  # flag over file; not TOML, so a string
        "network": "none",  # file only
        "pids": 2048,  # env over file, an int
        "memory": "512m",
        "read_only": True,
        "cpus": 1.5,
        "allowed_images": ["python:3.11-slim", "registry.example/"],
        "users": {"alice": "1000:1000"},
        "code_dirs": "/srv/a,/srv/b",  # the docker runner splits a string on commas
    }


def test_runner_opt_without_equals_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        resolve({"server": "http://s", "token": "t", "runner_opts": ("image",)}, {})


def test_runner_opt_flag_reaches_the_cli(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nymph.cli import main

    # doctor resolves the same options as start; an unknown runner shows the options were parsed
    result = CliRunner().invoke(
        main,
        ["doctor", "--server", "http://127.0.0.1:9", "--token", "t", "--runner", "nope",
         "--runner-opt", "image=x", "--workdir", str(tmp_path / "w"), "--state-dir", str(tmp_path / "s")],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "[FAIL] runner" in result.output


def test_the_example_files_docker_options_are_real_runner_options(tmp_path: Path) -> None:
    from nymph.plugins import load_runner

    example = (Path(__file__).resolve().parents[2] / "systemd" / "nymph.toml.example").read_text()
    head, _, docker_part = example.partition("# docker / gvisor runner")
    lines = [ln[2:] for ln in docker_part.splitlines()[1:] if ln.startswith("# ") and " = " in ln]
    assert len(lines) >= 10
    cfg_file = _write(tmp_path, head + "\n".join(lines) + "\n")
    cfg = resolve({"runner": "docker"}, {"NYMPH_TOKEN": "t"}, cfg_file)
    assert cfg.runner_options["users"] == {"alice": "1000:1000"}
    runner = load_runner("docker")(**dict(cfg.runner_options))  # every key is a constructor option
    assert runner.name == "docker"


def test_token_from_a_private_file_and_the_higher_layer_wins(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("lsk_from_file\n")
    token_file.chmod(0o600)
    cfg = resolve({"server": "http://x", "token_file": str(token_file)}, {})
    assert cfg.token == "lsk_from_file" and "lsk_from_file" not in repr(cfg)
    # a flag's token beats the environment's file, and the environment's file beats the TOML token
    assert (
        resolve({"server": "http://x", "token": "flag"}, {"NYMPH_TOKEN_FILE": str(token_file)}).token
        == "flag"
    )
    toml = _write(tmp_path, 'server = "http://x"\ntoken = "from-toml"\n')
    assert resolve({}, {"NYMPH_TOKEN_FILE": str(token_file)}, toml).token == "lsk_from_file"
    with pytest.raises(ConfigError, match="either token or token_file"):
        resolve({}, {"NYMPH_SERVER": "http://x", "NYMPH_TOKEN": "a", "NYMPH_TOKEN_FILE": str(token_file)})


@pytest.mark.parametrize(("mode", "content", "message"), [(0o644, "t", "chmod 600"), (0o600, " \n", "empty")])
def test_a_token_file_others_can_read_or_an_empty_one_is_refused(
    tmp_path: Path, mode: int, content: str, message: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    token_file.chmod(mode)
    with pytest.raises(ConfigError, match=message):
        resolve({"server": "http://x", "token_file": str(token_file)}, {})


def test_the_trust_settings_from_flags_env_and_file(tmp_path: Path) -> None:
    cfg = resolve({"server": "http://x", "token": "t"}, {})
    assert (cfg.allow_script, cfg.allow_modules, cfg.task_user, cfg.allow_root_tasks) == (
        False, (), "nymph-task", False,
    )  # fmt: skip
    env = {"NYMPH_ALLOW_MODULE": "mypkg.*,other", "NYMPH_ALLOW_SCRIPT": "yes", "NYMPH_TASK_USER": "runner"}
    cfg = resolve({"server": "http://x", "token": "t"}, env)
    assert cfg.allow_modules == ("mypkg.*", "other") and cfg.allow_script and cfg.task_user == "runner"
    toml = _write(
        tmp_path, 'server = "http://x"\ntoken = "t"\nallow_module = ["a.*"]\nallow-root-tasks = true\n'
    )
    cfg = resolve({"allow_modules": ("b",)}, {}, toml)
    assert cfg.allow_modules == ("b",) and cfg.allow_root_tasks


def test_every_path_is_made_absolute_once_at_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nymph start --workdir work`` from some directory: the prefork zygote runs in ``/``, so a
    relative path left as it is would point elsewhere there (issue 12, item 2)."""
    monkeypatch.chdir(tmp_path)
    token = tmp_path / "tok"
    token.write_text("t\n")
    token.chmod(0o600)
    cfg = resolve(
        {
            "server": "http://cp",
            "workdir": "work",
            "state_dir": "./state/../state2",
            "token_file": "tok",
            "upgrade_wheelhouse": "wheels",
            "runner_opts": ['pythonpath=["src", "/abs"]', "bundle=entry.zip", "python=venv/bin/python"],
        },
        {"NYMPH_RUNNER_OPT_CODE_DIRS": "code,/opt/code"},
    )
    assert cfg.workdir == tmp_path / "work"
    assert cfg.state_dir == tmp_path / "state2"
    assert cfg.token_file == tmp_path / "tok" and cfg.token == "t"
    assert cfg.upgrade_wheelhouse == str(tmp_path / "wheels")
    opts = cfg.runner_options
    assert opts["pythonpath"] == [str(tmp_path / "src"), "/abs"]
    assert opts["bundle"] == str(tmp_path / "entry.zip")
    assert opts["python"] == str(tmp_path / "venv/bin/python")
    assert opts["code_dirs"] == f"{tmp_path / 'code'},/opt/code"
    bare = resolve({"server": "http://cp", "token": "t", "runner_opts": ["python=python3"]}, {})
    assert bare.runner_options == {"python": "python3"}  # a bare program name is looked up on PATH


def test_disk_floor_and_pruning_settings_come_from_every_layer(tmp_path: Path) -> None:
    cfg_file = _write(tmp_path, 'server = "http://f"\ntoken = "t"\nmin-free-mb = 50\nkeep_failed_s = 3600\n')
    cfg = resolve({"keep_failed_mb": 0.5}, {"NYMPH_MIN_FREE_MB": "20"}, cfg_file)
    assert (cfg.min_free_mb, cfg.keep_failed_s, cfg.keep_failed_mb) == (20, 3600.0, 0.5)
    default = resolve({"server": "http://x", "token": "t"}, {})
    assert (default.min_free_mb, default.keep_failed_s, default.keep_failed_mb) == (100, 7 * 86400.0, 1024.0)
