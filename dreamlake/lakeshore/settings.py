"""Where the SDK and the ``lakeshore`` CLI find the control plane.

Resolved on first use, never at import: explicit values (CLI flags) over the ``LAKESHORE_URL`` /
``LAKESHORE_TOKEN`` environment variables over a TOML file, ``$LAKESHORE_CONFIG`` or else
``$XDG_CONFIG_HOME/lakeshore/config.toml`` (``~/.config/lakeshore/config.toml``)::

    url = "http://127.0.0.1:8765"
    token = "lsk_..."

``lakeshore server`` prints the two ``export`` lines on its first start. With them set,
``topk.submit(...)`` and ``dls.SyncQueue("q")`` use an ``HttpDispatch(url, token)`` without
``set_default_dispatch`` (see ``default_dispatch.get_default_dispatch``). Inside a task, nymph sets
``LAKESHORE_URL`` and ``LAKESHORE_TOKEN_FILE``: the control plane's URL and the path of a file only
the task's user can read, holding a credential scoped to that invocation's attempt (not the token
itself, which every child process would inherit and ``/proc/PID/environ`` would show). A relative
path is read from the task's workdir (the entry makes it absolute before the user's code runs).

Part of the entry bundle (a task's ``.submit()`` comes through here), so it runs on Python 3.9:
the config file is parsed with ``tomllib`` (3.11+) or ``tomli``, imported only when the file exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.errors import PlaneError

if TYPE_CHECKING:
    from dreamlake.lakeshore.dispatch.http import HttpDispatch

URL_ENV = "LAKESHORE_URL"
TOKEN_ENV = "LAKESHORE_TOKEN"
TOKEN_FILE_ENV = "LAKESHORE_TOKEN_FILE"  # inside a task: the file holding its credential
CONFIG_ENV = "LAKESHORE_CONFIG"


@dataclass(frozen=True)
class ClientSettings:
    url: str | None
    token: str | None
    config_file: Path  # the file consulted (it may not exist)

    def require(self) -> tuple[str, str]:
        """``(url, token)``; PlaneError naming what is missing and where to set it."""
        missing = [name for name, value in ((URL_ENV, self.url), (TOKEN_ENV, self.token)) if not value]
        if missing:
            raise PlaneError(
                f"no control plane configured: set {' and '.join(missing)} (`lakeshore server` prints "
                f"both), pass --url/--token, or write url and token to {self.config_file}"
            )
        assert self.url and self.token
        return self.url, self.token


def config_path(env: Mapping[str, str] | None = None) -> Path:
    named = envvars.string(CONFIG_ENV, env, None)
    if named:
        return Path(named).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME") if env is None else env.get("XDG_CONFIG_HOME")
    base = xdg or str(Path("~/.config").expanduser())
    return Path(base) / "lakeshore" / "config.toml"


def _toml() -> Any:
    """``tomllib`` (Python >= 3.11), else ``tomli``, else None."""
    import importlib

    for name in ("tomllib", "tomli"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    return None


def _read_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise PlaneError(f"cannot read the lakeshore config {path}: {exc}") from exc
    toml = _toml()
    if toml is None:
        raise PlaneError(
            f"reading the lakeshore config {path} needs Python >= 3.11 or the tomli package; "
            f"set {URL_ENV} and {TOKEN_ENV} instead"
        )
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise PlaneError(f"cannot read the lakeshore config {path}: {exc}") from exc
    out = {}
    for key in ("url", "token"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise PlaneError(f"{path}: {key} must be a string, got {type(value).__name__}")
        if value:
            out[key] = value
    return out


def token_from_file(env: Mapping[str, str] | None = None) -> str | None:
    """The token in the file ``LAKESHORE_TOKEN_FILE`` names (a task's credential); None without one.

    Raises PlaneError when the variable names a file that cannot be read (said, not ignored)."""
    path = envvars.string(TOKEN_FILE_ENV, env)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(64 * 1024).strip() or None
    except OSError as exc:
        raise PlaneError(f"{TOKEN_FILE_ENV}={path}: cannot read the task's credential: {exc}") from exc


def load(
    url: str | None = None, token: str | None = None, env: Mapping[str, str] | None = None
) -> ClientSettings:
    """Resolve url and token: the arguments, else the environment, else the config file."""
    path = config_path(env)
    url = url or envvars.string(URL_ENV, env)  # LAKESHORE_SERVER: its deprecated alias
    token = token or envvars.string(TOKEN_ENV, env) or token_from_file(env)
    if not (url and token):
        found = _read_file(path)
        url = url or found.get("url")
        token = token or found.get("token")
    return ClientSettings(url=url, token=token, config_file=path)


def default_plane(env: Mapping[str, str] | None = None) -> HttpDispatch | None:
    """An HttpDispatch from the environment or config file; None when neither names a control plane."""
    settings = load(env=env)
    if not settings.url and not settings.token:
        return None
    url, token = settings.require()
    from dreamlake.lakeshore.dispatch import HttpDispatch as Http  # its missing-module error

    try:
        plane: HttpDispatch = Http(url, token)
    except ValueError as exc:
        raise PlaneError(f"{URL_ENV}/{TOKEN_ENV} (or {settings.config_file}): {exc}") from exc
    return plane
