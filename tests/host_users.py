"""System users the tests run tasks as (``nymphtest``, nymph's default ``nymph-task``), made once a run.

The suite runs in parallel (pytest-xdist, ``scripts/test.sh``), and several files on different
workers want the same user. So the check-and-create is serialised across processes by a lock file
(two ``useradd`` of one name at once: the second fails, and its test would skip), and a user this
run created is removed once, by the controlling process when the whole run is over, never by a
worker whose neighbours may still be running tasks as that user; and while another run on this host
is still going (several runs share one machine, and one run's nymph may run tasks as a user another
made), the users are handed over to be removed by the last run to end (:data:`RUNS`, :data:`PENDING`).
Users that existed before the run are left alone. A plugin (``tests/conftest.py``'s ``pytest_plugins``) for its two hooks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

LOCK = Path(tempfile.gettempdir()) / "lakeshore-tests-users.lock"
# The file that lists the users this run created; set by the controlling process, inherited by
# the xdist workers it spawns.
MADE_ENV = "LAKESHORE_TEST_USERS_MADE"
_owned: Path | None = None  # the list this process set up, and so removes at the end
RUNS = Path(tempfile.gettempdir()) / "lakeshore-tests-users.runs"  # one file per live run: its pid
PENDING = Path(tempfile.gettempdir()) / "lakeshore-tests-users.pending"  # made by runs now ended


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def ensure_user(name: str, *useradd_args: str) -> bool:
    """True when the user ``name`` exists, made with ``useradd --system *useradd_args name`` if
    missing; False when it is missing and cannot be made here (not root, no ``useradd``)."""
    with _locked():
        if _exists(name):
            return True
        if os.geteuid() != 0 or shutil.which("useradd") is None:
            return False
        made = subprocess.run(["useradd", "--system", *useradd_args, name], capture_output=True, text=True)
        if made.returncode != 0:
            raise RuntimeError(f"useradd {name} failed ({made.returncode}): {made.stderr.strip()}")
        made_list = os.environ.get(MADE_ENV)
        if made_list:
            with open(made_list, "a") as fh:
                fh.write(name + "\n")
        return True


def pytest_configure(config: pytest.Config) -> None:
    global _owned
    if hasattr(config, "workerinput") or os.environ.get(MADE_ENV):
        return  # an xdist worker (or a pytest run inside a test): the controller's list is used
    fd, path = tempfile.mkstemp(prefix="lakeshore-tests-users-")
    os.close(fd)
    _owned = Path(path)
    os.environ[MADE_ENV] = path
    with _locked():
        RUNS.mkdir(exist_ok=True)
        (RUNS / str(os.getpid())).touch()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _owned
    if _owned is None:
        return
    with _locked():
        names = _owned.read_text().split() if _owned.exists() else []
        (RUNS / str(os.getpid())).unlink(missing_ok=True)
        if _other_runs():  # their tasks may run as these users: the last run to end removes them
            with open(PENDING, "a") as fh:
                fh.writelines(name + "\n" for name in names)
        else:
            names += PENDING.read_text().split() if PENDING.exists() else []
            for name in dict.fromkeys(names):
                subprocess.run(["userdel", name], capture_output=True)
            PENDING.unlink(missing_ok=True)
    _owned.unlink(missing_ok=True)
    os.environ.pop(MADE_ENV, None)
    _owned = None


def _other_runs() -> bool:
    """Whether another test run on this host is still alive (its pid file in :data:`RUNS`)."""
    alive = False
    for entry in RUNS.iterdir() if RUNS.is_dir() else ():
        try:
            os.kill(int(entry.name), 0)
            alive = True
        except (ValueError, ProcessLookupError):
            entry.unlink(missing_ok=True)  # a run that died without its unconfigure
        except PermissionError:
            alive = True
    return alive
