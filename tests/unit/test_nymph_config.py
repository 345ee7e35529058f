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
