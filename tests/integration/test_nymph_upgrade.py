"""Version pinning: the pip command nymph builds, and a real upgrade from a local wheelhouse.

The slow test builds a wheel of this repository with the version bumped to 0.1.99, makes a fresh
virtual environment whose dependencies come from the test's own venv (a ``.pth`` line), runs a
program there that calls :func:`nymph.upgrade.upgrade_and_reexec`, and checks that the same
process (same PID, same arguments) comes back running 0.1.99.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nymph.upgrade import (
    DISTRIBUTION,
    EXIT_VERSION_MISMATCH,
    UpgradeError,
    install,
    install_command,
    reexec_argv,
    validate_version,
)

ROOT = Path(__file__).resolve().parents[2]
TARGET = "0.1.99"


def test_exit_code_is_ex_tempfail() -> None:
    assert EXIT_VERSION_MISMATCH == 75


def test_install_from_a_wheelhouse_never_touches_an_index(tmp_path: Path) -> None:
    cmd = install_command("0.1.4", wheelhouse=tmp_path, python="/opt/py/bin/python")
    assert cmd[:4] == ["/opt/py/bin/python", "-m", "pip", "install"]
    assert cmd[cmd.index("--find-links") + 1] == str(tmp_path)
    assert "--no-index" in cmd
    assert cmd[-1] == "dreamlake-lakeshore==0.1.4"
    assert "--no-deps" not in cmd  # a new version may need a new dependency


def test_install_from_an_index() -> None:
    cmd = install_command("1.2.0rc1", index_url="https://pypi.internal/simple")
    assert cmd[0] == sys.executable
    assert cmd[cmd.index("--index-url") + 1] == "https://pypi.internal/simple"
    assert "--no-index" not in cmd
    assert cmd[-1] == "dreamlake-lakeshore==1.2.0rc1"


@pytest.mark.parametrize(
    ("pin", "normalised"),
    [
        ("0.1.4", "0.1.4"),
        ("1.0rc1", "1.0rc1"),
        ("1.0RC1", "1.0rc1"),
        ("2!1.0", "2!1.0"),
        ("1.0.post1.dev3", "1.0.post1.dev3"),
        ("1.0a1.post2", "1.0a1.post2"),
        ("1.0-1", "1.0.post1"),
    ],
)
def test_any_pep440_public_version_may_be_pinned(pin: str, normalised: str) -> None:
    # packaging.version's rule (pip's own): the old hand-written subset refused epochs, "-1" posts, "a1.post2"
    assert validate_version(pin) == normalised
    assert install_command(pin)[-1] == f"dreamlake-lakeshore=={normalised}"


@pytest.mark.parametrize(
    "bad",
    ["", "latest", "1.0; rm -rf /", "--pre", "1.0 --index-url=http://x", ">=1.0", " 1.0", "1.0+local.7"],
)
def test_a_pin_that_is_not_a_version_is_refused(bad: str) -> None:
    with pytest.raises(UpgradeError, match="not a PEP 440 version"):
        validate_version(bad)
    with pytest.raises(UpgradeError):
        install_command(bad)


def test_reexec_keeps_interpreter_options_script_and_arguments() -> None:
    argv = reexec_argv(
        "/new/python", ["/old/python", "-X", "dev", "/usr/local/bin/nymph", "start", "-c", "x.toml"]
    )
    assert argv == ["/new/python", "-X", "dev", "/usr/local/bin/nymph", "start", "-c", "x.toml"]


def test_a_failed_install_raises_with_pips_reason(tmp_path: Path) -> None:
    # An empty wheelhouse: pip fails while resolving, before it changes anything.
    with pytest.raises(UpgradeError) as err:
        install("9.9.9", wheelhouse=tmp_path)
    assert "dreamlake-lakeshore==9.9.9 failed" in str(err.value)
    assert "No matching distribution" in str(err.value)


# --- a real upgrade --------------------------------------------------------------------------------

CHILD = """
import importlib.metadata, os, sys
target, repo, wheelhouse = sys.argv[1:4]
version = importlib.metadata.version("dreamlake-lakeshore")
print("PID", os.getpid(), "VERSION", version, "ARGS", sys.argv[1:], flush=True)
if version == target:
    import dreamlake.lakeshore as d
    print("MODULE", d.__version__, d.__file__, flush=True)
    sys.exit(0)
sys.path.insert(0, repo)
from nymph.upgrade import upgrade_and_reexec
upgrade_and_reexec(target, wheelhouse=wheelhouse)
"""


def _bumped_copy(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv", ".git", "tests", "build", "dist")
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    for name in ("dreamlake", "nymph", "runners"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    pyproject = dst / "pyproject.toml"
    pyproject.write_text(
        re.sub(r'(?m)^version = ".*"$', f'version = "{TARGET}"', pyproject.read_text(), count=1)
    )
    version = dst / "dreamlake" / "lakeshore" / "version.py"  # the package's one __version__
    text = version.read_text()
    bumped = re.sub(r'(?m)^__version__ = ".*"$', f'__version__ = "{TARGET}"', text, count=1)
    assert bumped != text, "no __version__ line in dreamlake/lakeshore/version.py"
    version.write_text(bumped)
    return dst


def _installed_here() -> str:
    code = f"import importlib.metadata as m; print(m.version({DISTRIBUTION!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.slow
def test_upgrade_installs_the_pinned_version_and_reexecs(tmp_path: Path) -> None:
    before = _installed_here()
    assert before != TARGET

    wheelhouse = tmp_path / "wheelhouse"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "--disable-pip-version-check", "-w", str(wheelhouse), str(_bumped_copy(tmp_path / "src"))],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert [p.name for p in wheelhouse.glob("*.whl")] == [f"dreamlake_lakeshore-{TARGET}-py3-none-any.whl"]

    # A fresh environment; its dependencies (and pip) come from ours through a .pth line.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    child = tmp_path / "child.py"
    child.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        [python, str(child), TARGET, str(ROOT), str(wheelhouse)],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = re.findall(r"^PID (\d+) VERSION (\S+) ARGS (.*)$", proc.stdout, re.M)
    assert len(runs) == 2, proc.stdout
    (pid1, v1, args1), (pid2, v2, args2) = runs
    assert (v1, v2) == (before, TARGET)
    assert pid1 == pid2  # execv: the supervisor sees the same process
    assert args1 == args2
    module = re.search(r"^MODULE (\S+) (\S+)$", proc.stdout, re.M)
    assert module is not None
    assert module.group(1) == TARGET
    assert module.group(2).startswith(str(venv))

    # Our own environment was not touched by the upgrade of the other one.
    assert _installed_here() == before
