"""What a call asks of its environment, checked the same way by the SDK, the control plane and nymph.

``@dls.udf(env={...}, secrets=[...], mounts=[...])`` ride in the Submit ``run_config`` (names and
plain values only: a secret's value never does, see docs/nymph.md "Environments");
``pip=[...]`` / ``requirements="reqs.txt"`` ride in the Envelope's ``cfg["pip"]``
(:func:`pip_record`), which nymph builds into a cached environment (``nymph.envcache``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TYPE_CHECKING = (
    False  # no typing at runtime: a decorated module imports this (tests/unit/test_entry_imports.py)
)
if TYPE_CHECKING:
    from typing import Any

RESERVED_PREFIX = "LAKESHORE_"  # a call's env may not set these: nymph's own variables for the task
# nor these: the operator's import path, which the container runners also mount (a call's own
# PYTHONPATH once bound any host directory, a sibling task's workdir among them, into its container)
RESERVED_NAMES = frozenset({"PYTHONPATH"})
# nor these: they steer how a program is loaded (the dynamic loader's LD_*, and the others glibc
# ignores for a setuid program) or how a Python interpreter starts, and nymph's own processes start
# the task with its environment, as root for a root nymph (the process runner's zygote, runuser):
# a call's LD_PRELOAD or PYTHONUSERBASE would run code of its choosing there
LOADER_PREFIX = "LD_"
STARTUP_NAMES = frozenset(
    {
        *("GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH"),
        *("MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR"),
        *("PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "PYTHONPYCACHEPREFIX", "PYTHONEXECUTABLE"),
        *("PYTHONPLATLIBDIR", "PYTHONINSPECT"),
    }
)
MAX_ENV_VARS = 256
MAX_ENV_BYTES = 64 * 1024
MAX_NAMES = 64
MAX_REQUIREMENTS = 500
MAX_LOCK_BYTES = 1024 * 1024
PIP_FORMATS = ("requirements", "pylock.toml")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# a mount's name, as an operator may declare one (`nymph start --mount NAME=/host/path`, nymph.mounts)
MOUNT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


def user_env(value: Any, what: str = "run_config.env") -> dict[str, str]:
    """A call's ``env`` checked: a map of variable names to strings, none reserved; ValueError says why."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a map of variable names to strings, got {type(value).__name__}")
    if len(value) > MAX_ENV_VARS:
        raise ValueError(f"{what} has {len(value)} variables; at most {MAX_ENV_VARS}")
    out: dict[str, str] = {}
    size = 0
    for name, val in value.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"{what}: {name!r} is not a variable name (letters, digits, _; not a digit first)"
            )
        if name.startswith(RESERVED_PREFIX):
            raise ValueError(
                f"{what}: {name!r} is reserved (nymph sets the {RESERVED_PREFIX}* variables of a task); "
                "pick another name"
            )
        if name in RESERVED_NAMES:
            raise ValueError(
                f"{what}: {name!r} is nymph's (the operator's import path for tasks); ship the code with "
                "the call (its code archive) or have the operator add it to nymph's code_dirs"
            )
        _refuse_startup(name, what)
        if not isinstance(val, str) or "\0" in val:
            raise ValueError(f"{what}: {name} must be a string without NUL bytes, got {type(val).__name__}")
        size += len(name) + len(val)
        out[name] = val
    if size > MAX_ENV_BYTES:
        raise ValueError(f"{what} holds {size} bytes; at most {MAX_ENV_BYTES}")
    return out


def names(value: Any, what: str) -> list[str]:
    """A list of names (secrets, mounts): each a string, at most a few dozen; ValueError says why."""
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f'{what} must be a list of names, e.g. ["HF_TOKEN"], got {value!r}')
    if len(value) > 64:
        raise ValueError(f"{what} names {len(value)}; at most 64")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{what} must hold non-empty strings, got {item!r}")
    return list(dict.fromkeys(value))


def secret_names(value: Any, what: str = "run_config.secrets") -> list[str]:
    """Secret names: each a variable name (it becomes one in the task), none reserved."""
    out = names(value, what)
    for name in out:
        if not _NAME.fullmatch(name) or len(name) > 128:
            raise ValueError(f"{what}: {name!r} is not a secret name (letters, digits, _; not a digit first)")
        if name.startswith(RESERVED_PREFIX):
            raise ValueError(f"{what}: {name!r} is reserved (nymph sets the {RESERVED_PREFIX}* variables)")
        if name in RESERVED_NAMES:  # a secret's value lands in the task's environment as env's does
            raise ValueError(f"{what}: {name!r} is nymph's (the operator's import path for tasks)")
        _refuse_startup(name, what)
    return out


def _refuse_startup(name: str, what: str) -> None:
    """ValueError when ``name`` steers how a program is loaded or an interpreter starts."""
    if name.startswith(LOADER_PREFIX) or name in STARTUP_NAMES:
        raise ValueError(
            f"{what}: {name!r} changes how the processes that start a task load (nymph's, root's on a "
            "root nymph), so a call may not set it; set it inside the task (os.environ, before the "
            "subprocess that needs it), or have the operator pass nymph's own with --pass-env"
        )


def mount_names(value: Any, what: str = "run_config.mounts") -> list[str]:
    """Mount names: each one an operator could declare (``--mount NAME=/host/path``), so a name
    no worker can ever offer (a path, ``..``) is refused at once rather than failing the call later."""
    out = names(value, what)
    for name in out:
        if not MOUNT_NAME.fullmatch(name):
            raise ValueError(
                f"{what}: {name[:80]!r} is not a mount name (1 to 63 letters, digits, _ and -, a letter "
                "or digit first): ask for a mount by the name the operator declared it under "
                "(nymph's --mount NAME=/host/path), never by its path"
            )
    return out


def pip_record(pip: Any = None, requirements: Any = None) -> dict[str, Any] | None:
    """``cfg["pip"]`` for ``pip=[...]`` (requirement strings) or ``requirements=`` (the path of a
    requirements file, a ``pylock.toml`` or a ``uv.lock``): ``{"format": ..., "text": ...}``; None
    when neither is given. ValueError says what is wrong."""
    if pip is None and requirements is None:
        return None
    if pip is not None and requirements is not None:
        raise ValueError("give pip=[...] or requirements='file', not both")
    if pip is not None:
        if isinstance(pip, str):
            pip = [pip]
        if not isinstance(pip, (list, tuple)) or not pip:
            raise ValueError(
                f"pip must be a non-empty list of requirements like ['numpy==2.1.*'], got {pip!r}"
            )
        return check_pip({"format": "requirements", "text": "\n".join(str(r) for r in pip) + "\n"})
    import os

    path = os.fspath(requirements)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_LOCK_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"requirements={path!r}: cannot read it ({exc})") from exc
    base = os.path.basename(path)
    if base == "uv.lock":
        return check_pip({"format": "requirements", "text": _uv_lock_pins(text, path)})
    if base == "pylock.toml" or (base.startswith("pylock.") and base.endswith(".toml")):
        return check_pip({"format": "pylock.toml", "text": text})
    return check_pip({"format": "requirements", "text": text})


def check_pip(record: Any) -> dict[str, Any]:
    """A ``cfg["pip"]`` record as nymph accepts it; ValueError says what is wrong."""
    if not isinstance(record, Mapping):
        raise ValueError(f"cfg.pip must be a map, got {type(record).__name__}")
    fmt, text = record.get("format"), record.get("text")
    if fmt not in PIP_FORMATS:
        raise ValueError(f"cfg.pip.format must be one of {', '.join(PIP_FORMATS)}, got {fmt!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("cfg.pip.text must be the non-empty text of the requirements")
    if len(text.encode()) > MAX_LOCK_BYTES:
        raise ValueError(f"cfg.pip.text is over {MAX_LOCK_BYTES} bytes")
    if "\0" in text:
        raise ValueError("cfg.pip.text holds a NUL byte")
    if fmt == "requirements":
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if len(lines) > MAX_REQUIREMENTS:
            raise ValueError(f"cfg.pip names {len(lines)} requirements; at most {MAX_REQUIREMENTS}")
        for line in lines:
            # options would change where uv looks (an index, a local path, another file): the
            # operator sets those per nymph (--pip-index-url, --pip-find-links)
            if line.startswith("-"):
                raise ValueError(
                    f"cfg.pip: {line.split()[0]!r} lines are not taken (the index and find-links are the "
                    "worker's settings); list plain requirements like 'pyfiglet==1.0.2'"
                )
    return {"format": fmt, "text": text}


def _uv_lock_pins(text: str, path: str) -> str:
    """The packages of a ``uv.lock`` as ``name==version`` lines (its root project left out)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        raise ValueError(
            f"requirements={path!r}: reading a uv.lock needs Python 3.11; run "
            "`uv export --format requirements-txt > requirements.txt` and pass that"
        ) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"requirements={path!r} is not valid TOML: {exc}") from exc
    pins = []
    for pkg in doc.get("package") or []:
        source = pkg.get("source") or {}
        if not isinstance(source, dict) or "registry" not in source:
            continue  # the project itself (editable, virtual) or a local path: not installable here
        pins.append(f"{pkg['name']}=={pkg['version']}")
    if not pins:
        raise ValueError(f"requirements={path!r}: the lock names no package from an index")
    return "\n".join(sorted(pins)) + "\n"
