"""One settings reader (dreamlake/lakeshore/envvars.py): one table, one name per setting, one parser.

What a user relies on: every variable the SDK, the control plane and the entry read is a row of
the table that docs/settings.md prints; nothing in dreamlake/ reads the environment past it; a bad
value stops the reader with an error naming the variable; an old name still works, with a warning.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from dreamlake.lakeshore import codeship, envvars, settings
from dreamlake.lakeshore.dispatch.http import inline_threshold_from_env
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.server.payloads import PayloadConfig

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("dreamlake", "nymph", "runners", "docs", "scripts", "systemd", "packaging", "README.md")
NAME = re.compile(r"\bLAKESHORE_[A-Z0-9_]+")

#: Reads of os.environ outside envvars.py that are not settings: (file, the name read) -> why.
#: "os.environ" stands for a use of the whole mapping.
ALLOWED = {
    ("dreamlake/lakeshore/daemon/entry.py", "PYTHONPATH"): "the import path the task's children inherit",
    ("dreamlake/lakeshore/daemon/bundle.py", "XDG_CACHE_HOME"): "the XDG cache directory",
    ("dreamlake/lakeshore/settings.py", "XDG_CONFIG_HOME"): "the XDG config directory",
    ("dreamlake/lakeshore/devstack.py", "os.environ"): "a copy of the environment for its child processes",
}


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    envvars._WARNED.clear()  # each test sees the first use of a deprecated name
    yield
    envvars._WARNED.clear()


def _tracked(*roots: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--", *roots], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


# -- the table ------------------------------------------------------------------------------------


def test_every_name_in_the_code_and_the_docs_is_in_the_table() -> None:
    known = set(envvars.BY_NAME) | set(envvars.DEPRECATED)
    missing: dict[str, str] = {}
    for path in _tracked(*SCANNED):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for name in NAME.findall(text):
            family = name.endswith("_") and any(k.startswith(name) for k in known)  # LAKESHORE_MOUNT_<NAME>
            if name not in known and not family:
                missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"add a row to envvars.SETTINGS for: {missing}"


def test_the_table_is_well_formed() -> None:
    names = [s.name for s in envvars.SETTINGS]
    assert len(names) == len(set(names)), "a name has two rows"
    assert len(names) >= 60
    for row in envvars.SETTINGS:
        assert row.readers and set(row.readers) <= set(envvars.READERS), row
        assert row.doc.strip() and "\n" not in row.doc, row
        assert (row.kind == "choice") == bool(row.choices), row
    for old, new in envvars.DEPRECATED.items():
        assert new in envvars.BY_NAME and old not in envvars.BY_NAME, (old, new)


def test_the_table_defaults_are_the_code_defaults() -> None:
    from dreamlake.lakeshore import cli, client
    from dreamlake.lakeshore.server import blobdir, config, payloads

    defaults = ServerConfig()
    for name, (field, _kind) in config.ENV.items():
        assert envvars.BY_NAME[name].default == getattr(defaults, field), name
    expected = {
        "LAKESHORE_RETRY_WINDOW": client.DEFAULT_RETRY_WINDOW_S,
        "LAKESHORE_CODE_MAX_BYTES": codeship.CODE_MAX_BYTES,
        "LAKESHORE_DATA_DIR": cli.DEFAULT_DATA_DIR,
        "LAKESHORE_BLOBS_RETENTION_S": blobdir.DEFAULT_RETENTION_S,
        "LAKESHORE_S3_REGION": payloads.DEFAULT_REGION,
        "MAX_PAYLOAD_BYTES": payloads.DEFAULT_MAX_PAYLOAD_BYTES,
        "PAYLOAD_PRESIGN_TTL_S": payloads.DEFAULT_PRESIGN_TTL_S,
        "INLINE_THRESHOLD_BYTES": 256 * 1024,
        "LAKESHORE_MAX_POLLS": defaults.max_polls,
    }
    for name, value in expected.items():
        assert envvars.BY_NAME[name].default == value, name


def test_docs_settings_md_is_the_generator_output() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "dreamlake.lakeshore.envvars"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == envvars.render()
    assert (ROOT / "docs" / "settings.md").read_text(encoding="utf-8") == printed, (
        "docs/settings.md is stale: python -m dreamlake.lakeshore.envvars > docs/settings.md"
    )
    for row in envvars.SETTINGS:
        assert f"| `{row.name}` |" in printed


def test_the_readme_and_the_docs_point_at_the_table() -> None:
    assert "docs/settings.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "settings.md" in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


# -- nothing reads the environment past envvars.py -------------------------------------------------


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ("environ", "environb")
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def env_reads(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each read of the process environment in ``source`` (writes excluded);
    name ``os.environ`` for a use of the whole mapping, ``?`` for a key the scan cannot name; and
    each ``.get(NAME)`` / ``[NAME]`` of a table name on any mapping (an ad hoc reader of a setting)."""
    tree = ast.parse(source)
    consts = _constants(tree)
    settings_names = set(envvars.BY_NAME) | set(envvars.DEPRECATED)
    for row in envvars.SETTINGS:
        settings_names.update(row.fallbacks)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def key(node: ast.AST | None) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in consts:
            return consts[node.id]
        return "?"

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "environb", "getenv", "getenvb"):
                    found.append((node.lineno, f"os.{alias.name}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if (
                isinstance(func.value, ast.Name)
                and func.value.id == "os"
                and func.attr in ("getenv", "getenvb")
            ):
                found.append((node.lineno, key(node.args[0] if node.args else None)))
            elif (
                func.attr == "get"
                and not _is_environ(func.value)
                and node.args
                and key(node.args[0]) in settings_names  # env.get("LAKESHORE_...") on a mapping
            ):
                found.append((node.lineno, key(node.args[0])))
        elif (
            isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and not _is_environ(node.value)
        ):
            if key(node.slice) in settings_names:
                found.append((node.lineno, key(node.slice)))
        elif _is_environ(node):
            parent = parents.get(node)
            if isinstance(parent, ast.Subscript):
                if isinstance(parent.ctx, ast.Load):
                    found.append((node.lineno, key(parent.slice)))
            elif isinstance(parent, ast.Attribute) and parent.attr in ("get", "setdefault", "pop"):
                call = parents.get(parent)
                args = call.args if isinstance(call, ast.Call) else []
                found.append((node.lineno, key(args[0] if args else None)))
            elif isinstance(parent, ast.Compare) and node is not parent.left:
                found.append((node.lineno, key(parent.left)))
            else:
                found.append((node.lineno, "os.environ"))
    return sorted(found)


def test_the_scan_finds_each_kind_of_read() -> None:
    source = (
        "import os\nfrom os import getenv\nURL = 'LAKESHORE_URL'\n"
        "a = os.environ.get(URL)\nb = os.environ['HOME']\nc = 'X' in os.environ\nd = os.getenv('Y')\n"
        "e = dict(os.environ)\nf = env.get('LAKESHORE_TOKEN')\ng = env['INLINE_THRESHOLD_BYTES']\n"
        "os.environ['LAKESHORE_URL'] = 'w'\nh = {'LAKESHORE_URL': 'not a read'}\n"
    )
    assert env_reads(source) == [
        (2, "os.getenv"),
        (4, "LAKESHORE_URL"),
        (5, "HOME"),
        (6, "X"),
        (7, "Y"),
        (8, "os.environ"),
        (9, "LAKESHORE_TOKEN"),
        (10, "INLINE_THRESHOLD_BYTES"),
    ]


def test_nothing_in_dreamlake_reads_the_environment_past_envvars() -> None:
    ad_hoc = []
    for path in _tracked("dreamlake"):
        rel = str(path.relative_to(ROOT))
        if path.suffix != ".py" or rel == "dreamlake/lakeshore/envvars.py":
            continue
        for line, name in env_reads(path.read_text(encoding="utf-8")):
            if (rel, name) not in ALLOWED:
                ad_hoc.append(f"{rel}:{line}: {name}")
    assert not ad_hoc, (
        "read these through dreamlake.lakeshore.envvars (or allow-list a non-setting):\n" + "\n".join(ad_hoc)
    )


# -- the accessors ----------------------------------------------------------------------------------


def test_unset_or_empty_is_the_default_and_a_whole_number_is_read() -> None:
    assert envvars.integer("LAKESHORE_CODE_MAX_BYTES", {}) == 32 * 1024 * 1024  # the table's
    assert envvars.integer("LAKESHORE_CODE_MAX_BYTES", {"LAKESHORE_CODE_MAX_BYTES": "  "}, default=7) == 7
    assert envvars.integer("LAKESHORE_CODE_MAX_BYTES", {"LAKESHORE_CODE_MAX_BYTES": " 12 "}) == 12


@pytest.mark.parametrize(("raw", "says"), [("12k", "is not a whole number"), ("-1", "is below 0")])
def test_a_bad_integer_names_the_variable_and_the_fix(raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"LAKESHORE_CODE_MAX_BYTES.*{says}.*unset it"):
        envvars.integer("LAKESHORE_CODE_MAX_BYTES", {"LAKESHORE_CODE_MAX_BYTES": raw})


def test_a_bad_server_limit_stops_the_server_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAKESHORE_MAX_CONNECTIONS", "lots")
    with pytest.raises(ValueError, match="LAKESHORE_MAX_CONNECTIONS='lots' is not a whole number"):
        ServerConfig.from_env()
    monkeypatch.setenv("LAKESHORE_MAX_CONNECTIONS", "0")
    with pytest.raises(ValueError, match="LAKESHORE_MAX_CONNECTIONS=0 is below 1"):
        ServerConfig.from_env()
    monkeypatch.setenv("LAKESHORE_MAX_CONNECTIONS", "12")
    monkeypatch.setenv("LAKESHORE_KEEP_ALIVE_S", "0")
    with pytest.raises(ValueError, match="LAKESHORE_KEEP_ALIVE_S='0' must be a positive number"):
        ServerConfig.from_env()
    monkeypatch.setenv("LAKESHORE_KEEP_ALIVE_S", "2.5")
    config = ServerConfig.from_env()
    assert (config.max_connections, config.keep_alive_s) == (12, 2.5)


def test_numbers_flags_and_choices_refuse_what_they_cannot_read() -> None:
    env = {
        "LAKESHORE_RETRY_WINDOW": "nan",
        "LAKESHORE_CAPTURE_OUTPUT": "maybe",
        "LAKESHORE_HTTP_PARSER": "fast",
    }
    with pytest.raises(ValueError, match="LAKESHORE_RETRY_WINDOW='nan' is not a number"):
        envvars.number("LAKESHORE_RETRY_WINDOW", env)
    with pytest.raises(ValueError, match="LAKESHORE_CAPTURE_OUTPUT='maybe' is not a yes/no"):
        envvars.flag("LAKESHORE_CAPTURE_OUTPUT", env)
    with pytest.raises(ValueError, match="LAKESHORE_HTTP_PARSER='fast' is not one of httptools, h11"):
        envvars.choice("LAKESHORE_HTTP_PARSER", env)
    assert envvars.flag("LAKESHORE_CAPTURE_OUTPUT", {"LAKESHORE_CAPTURE_OUTPUT": "Yes"}) is True
    assert envvars.flag("LAKESHORE_CAPTURE_OUTPUT", {"LAKESHORE_CAPTURE_OUTPUT": "0"}) is False
    assert envvars.flag("LAKESHORE_CAPTURE_OUTPUT", {}) is False
    assert envvars.choice("LAKESHORE_HTTP_PARSER", {"LAKESHORE_HTTP_PARSER": " H11 "}) == "h11"
    assert envvars.number("LAKESHORE_RETRY_WINDOW", {}) == 60.0


def test_a_name_outside_the_table_is_refused() -> None:
    with pytest.raises(KeyError, match=r"LAKESHORE_NOT_A_SETTING is not in .*SETTINGS: add a row"):
        envvars.raw("LAKESHORE_NOT_A_SETTING", {})


def test_a_fallback_name_is_read_when_the_name_is_unset() -> None:
    env = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"}
    config = PayloadConfig.from_env(env)
    assert (config.access_key, config.secret_key, config.session_token) == ("a", "s", "t")
    config = PayloadConfig.from_env({**env, "LAKESHORE_S3_ACCESS_KEY": "la", "LAKESHORE_S3_SECRET_KEY": "ls"})
    assert (config.access_key, config.secret_key, config.session_token) == ("la", "ls", None)


# -- one name per setting ---------------------------------------------------------------------------


def test_the_inline_threshold_has_one_name_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAKESHORE_INLINE_THRESHOLD_BYTES", raising=False)
    monkeypatch.setenv("INLINE_THRESHOLD_BYTES", "1234")
    assert inline_threshold_from_env() == 1234  # HTTP submits
    assert codeship._threshold() == 1234  # code archives
    assert PayloadConfig.from_env({"INLINE_THRESHOLD_BYTES": "1234"}).inline_threshold_bytes == 1234


def test_an_old_name_works_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INLINE_THRESHOLD_BYTES", raising=False)
    monkeypatch.setenv("LAKESHORE_INLINE_THRESHOLD_BYTES", "99")
    with pytest.warns(
        FutureWarning, match="LAKESHORE_INLINE_THRESHOLD_BYTES is deprecated: set INLINE_THRESHOLD_BYTES"
    ):
        assert codeship._threshold() == 99
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second read says nothing
        assert inline_threshold_from_env() == 99
    monkeypatch.setenv("INLINE_THRESHOLD_BYTES", "5")  # the name wins over the alias
    assert envvars.inline_threshold() == 5


def test_lakeshore_server_is_the_old_name_of_lakeshore_url(tmp_path: Path) -> None:
    env = {
        "LAKESHORE_SERVER": "http://old:1",
        "LAKESHORE_TOKEN": "t",
        "LAKESHORE_CONFIG": str(tmp_path / "none"),
    }
    with pytest.warns(FutureWarning, match="LAKESHORE_SERVER is deprecated: set LAKESHORE_URL instead"):
        assert settings.load(env=env).require() == ("http://old:1", "t")
    assert settings.load(env={**env, "LAKESHORE_URL": "http://new:2"}).url == "http://new:2"
