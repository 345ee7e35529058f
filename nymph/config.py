"""nymph's configuration: one frozen value, resolved once by the CLI.

Precedence, highest first: command-line flags, ``NYMPH_*`` environment variables, a TOML file
(``--config`` / ``NYMPH_CONFIG``), then the defaults below. Nothing reads the environment at
import time; :func:`resolve` is the only place that looks at it.

The daemon token comes from ``--token-file`` / ``token_file`` (a file holding it, e.g. a systemd
credential or a mounted Kubernetes Secret) or ``NYMPH_TOKEN``; ``--token`` still works but puts it
on the command line, where ``ps`` shows it to every local user (``nymph start`` re-executes itself
without it at once, see :mod:`nymph.cli`). A token file must not be readable by others.

TOML keys are the field names (``-`` and ``_`` both accepted); runner keyword options live in a
``[runner_options]`` table (for example ``python = "/usr/bin/python3"`` for the process runner).
Environment values: lists are comma separated (``NYMPH_QUEUE=gpu,cpu``), labels are
``k=v,k2=v2``, booleans are ``1/true/yes/on``.

Runner options merge key by key across the layers: the file's ``[runner_options]`` table, then
``NYMPH_RUNNER_OPT_<KEY>=VALUE`` variables, then repeatable ``--runner-opt KEY=VALUE`` flags. A
flag or variable VALUE is read as a TOML value when it is one (``pids=1024`` is an int,
``read_only=true`` a bool, ``allowed_images=["a", "b"]`` a list, ``users={alice="1000:1000"}`` a
table) and as a plain string otherwise (``image=python:3.11-slim``, ``memory=512m``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamlake.lakeshore.labels import label_problem
from nymph.errors import ConfigError as ConfigError  # re-exported: raised here

if TYPE_CHECKING:
    from nymph.flow import StreamLimits


DEFAULT_STATE_DIR = Path("/var/lib/nymph/state")


@dataclass(frozen=True)
class NymphConfig:
    server: str
    token: str = field(repr=False)
    task_url: str | None = None  # LAKESHORE_URL inside a task (default: server), e.g. a bridge address
    runner: str = "process"
    queues: tuple[str, ...] = ("default",)
    concurrency: int = 1
    workdir: Path = Path("/var/lib/nymph/work")
    state_dir: Path = DEFAULT_STATE_DIR
    # code archives shipped with calls (nymph.codecache), unpacked once per sha256; None: {workdir}/.code
    code_cache: Path | None = None
    code_cache_max_bytes: int = 2 * 1024**3
    code_cache_max_age_s: float = 7 * 24 * 3600.0
    # pip environments calls ask for (nymph.envcache), built once per lock; None: {workdir}/.envs
    allow_pip: bool = False  # build them at all (off: a call with pip=... is refused)
    env_cache: Path | None = None
    env_cache_max_bytes: int = 10 * 1024**3
    env_cache_max_age_s: float = 7 * 24 * 3600.0
    pip_index_url: str | None = None  # uv's --index-url (None: uv's default, PyPI)
    pip_find_links: tuple[str, ...] = ()  # uv's --find-links: directories or URLs of wheels
    # the task environment (nymph.taskenv): nymph's variables tasks get beside the documented base
    pass_env: tuple[str, ...] = ()
    # mounts users ask for by name (@dls.udf(mounts=[...])): name -> (host path or pvc:CLAIM, read_only)
    mounts: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    allow_pickled: bool = False
    allow_script: bool = False  # run_config.script (bash -c) invocations; off: refused before spawning
    allow_exec: bool = (
        False  # namespace exec jobs (bash -c); off: never claimed (the poll asks for runs only)
    )
    allow_modules: tuple[str, ...] = ()  # fnmatch patterns a ref's module must match; empty: any module
    allow_users: tuple[str, ...] = ()
    task_user: str = "nymph-task"  # who tasks without as_user run as when nymph runs as root
    # process runner, root nymph: each task runs as its own user of the pool {task_user}-0..N-1
    # (nymph.taskuser); 0: no pool, every task runs as task_user
    task_user_pool: int = 64
    shared_task_user: bool = False  # tasks may share task_user when the pool is missing or used up
    # process runner: each task cgroup's memory.max / pids.max (nymph.limits) unless the task asks
    # for less; a size ("8g") or a share of the host's memory ("90%"); 0 / "": no cap
    task_memory_max: str = "90%"
    task_pids_max: int = 4096
    allow_root_tasks: bool = False  # tasks may run as uid 0 (as nymph's own root, or as_user root)
    token_file: Path | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace: str | None = None
    grace_s: float = 30.0  # shutdown: how long running work may finish after SIGTERM
    # drain (SIGUSR1, ``nymph drain``): how long running work may finish; None: as long as it takes
    drain_timeout_s: float | None = None
    # dls.checkpoint_dir() carried to the next attempt up to this size, and up to the control
    # plane's MAX_PAYLOAD_BYTES (nymph.checkpoints.size_limit)
    checkpoint_max_mb: float = 1024.0
    stop_grace_s: float = 10.0  # cancel / timeout ladder: SIGTERM, this grace, SIGKILL
    heartbeat_s: float | None = None  # None: what the control plane says at registration
    poll_timeout_s: float = 30.0
    runtime_policy: str = "minor"
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    log_format: str = "text"
    log_level: str = "INFO"
    auto_upgrade: bool = False
    upgrade_index_url: str | None = None
    upgrade_wheelhouse: str | None = None
    runner_options: Mapping[str, Any] = field(default_factory=dict)
    # streams (docs/nymph.md "Streams and backpressure"): the task pauses at its next yield while
    # this many frames / bytes of it are undelivered; max_bytes undelivered fails the invocation
    stream_window_frames: int = 4096
    stream_window_bytes: int = 32 * 1024 * 1024
    stream_max_bytes: int = 1024 * 1024 * 1024
    stream_batch_frames: int = 1000
    stream_batch_bytes: int = 1024 * 1024
    # stdout + stderr streamed per attempt as LOG frames; past it one "truncated" line, the rest dropped
    stream_log_max_bytes: int = 16 * 1024 * 1024
    stream_inotify: bool = True
    stream_poll_s: float = 0.05
    # full disks (docs/nymph.md "Full disks"): no claim while the workdir's or the state dir's
    # filesystem has less free space than this
    min_free_mb: int = 100
    # kept failed workdirs (docs/nymph.md "Pruning"): removed once older than keep_failed_s, and the
    # oldest first while together they take more than keep_failed_mb
    keep_failed_s: float = 7 * 24 * 3600.0
    keep_failed_mb: float = 1024.0

    def __post_init__(self) -> None:
        # a config built in code (tests, embedders) gets the same absolute paths as one resolved
        for name in ("workdir", "state_dir", "token_file", "code_cache", "env_cache"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_absolute():
                object.__setattr__(self, name, absolute(value))

    @property
    def code_cache_dir(self) -> Path:
        """Where code archives are unpacked: ``code_cache``, else ``{workdir}/.code``."""
        return self.code_cache if self.code_cache is not None else self.workdir / ".code"

    @property
    def env_cache_dir(self) -> Path:
        """Where pip environments are built: ``env_cache``, else ``{workdir}/.envs``."""
        return self.env_cache if self.env_cache is not None else self.workdir / ".envs"

    @functools.cached_property
    def stream_limits(self) -> StreamLimits:
        """The ``stream_*`` settings as one value (raises ValueError when they do not fit together)."""
        from nymph.flow import StreamLimits

        return StreamLimits(
            window_frames=self.stream_window_frames,
            window_bytes=self.stream_window_bytes,
            max_bytes=self.stream_max_bytes,
            batch_frames=self.stream_batch_frames,
            batch_bytes=self.stream_batch_bytes,
            log_max_bytes=self.stream_log_max_bytes,
            inotify=self.stream_inotify,
            poll_s=self.stream_poll_s,
        )

    def redacted(self) -> dict[str, Any]:
        """The config as a dict for logs, with the token hidden."""
        out = dataclasses.asdict(self)
        out["token"] = "***" if self.token else ""
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(NymphConfig)}
_STREAM_INTS = frozenset(
    (
        "stream_window_frames",
        "stream_window_bytes",
        "stream_max_bytes",
        "stream_batch_frames",
        "stream_batch_bytes",
        "stream_log_max_bytes",
        "min_free_mb",
    )
)
# runner options that name a file or directory: made absolute at configuration, like workdir
# (a relative one would be read from the cwd of a zygote or a container runtime, not nymph's)
_PATH_OPTIONS = frozenset(("pythonpath", "code_dirs", "bundle", "kubeconfig"))
# runner options that name a program: absolute when given as a relative path (``bin/python``);
# a bare name (``python3``) is looked up on PATH and stays as it is
_PROGRAM_OPTIONS = frozenset(("python", "bash", "runuser", "sbatch", "scontrol", "scancel", "squeue"))
_ALIASES = {
    "queue": "queues",
    "allow_user": "allow_users",
    "label": "labels",
    "allow_module": "allow_modules",
    "mount": "mounts",
}


def _norm(key: str) -> str:
    key = key.replace("-", "_").lower()
    return _ALIASES.get(key, key)


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}: expected a boolean (true/false), got {value!r}")


def _parse_labels(name: str, value: Any) -> dict[str, str]:
    """``k=v`` items (split at the first ``=``, each side stripped) or a table; each label held to
    the rule a call's selector is held to (dreamlake.lakeshore.labels), so a selector can match it."""
    out: dict[str, str] = {}
    if isinstance(value, Mapping):
        out = {str(k).strip(): str(v).strip() for k, v in value.items()}
    else:
        for item in value.split(",") if isinstance(value, str) else list(value):
            item = str(item).strip()
            if not item:
                continue
            key, sep, val = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"{name}: expected k=v, got {item!r}")
            out[key.strip()] = val.strip()
    for key, val in out.items():
        refused = label_problem(key, val, name)
        if refused is not None:
            raise ConfigError(refused)
    return out


def _coerce(name: str, value: Any) -> Any:
    """Convert a raw (string, TOML or flag) value to the type of field ``name``."""
    try:
        if name == "mounts":
            return _parse_mounts(value)
        if name in ("queues", "allow_users", "allow_modules", "pass_env", "pip_find_links"):
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(i).strip() for i in items if str(i).strip())
        if name == "labels":
            return _parse_labels(name, value)
        if name in (
            "allow_pickled",
            "allow_script",
            "allow_exec",
            "allow_root_tasks",
            "shared_task_user",
            "auto_upgrade",
            "stream_inotify",
            "allow_pip",
        ):
            return _parse_bool(name, value)
        if (
            name
            in (
                "concurrency",
                "metrics_port",
                "code_cache_max_bytes",
                "task_user_pool",
                "task_pids_max",
                "env_cache_max_bytes",
            )
            or name in _STREAM_INTS
        ):
            return None if value in (None, "") else int(value)
        if name in (
            "grace_s", "stop_grace_s", "heartbeat_s", "poll_timeout_s", "stream_poll_s", "keep_failed_s",
            "keep_failed_mb", "code_cache_max_age_s", "env_cache_max_age_s", "drain_timeout_s",
            "checkpoint_max_mb",
        ):  # fmt: skip
            return None if value in (None, "") else float(value)
        if name in ("workdir", "state_dir"):
            return absolute(value)
        if name in ("code_cache", "env_cache"):
            return None if value in (None, "") else absolute(value)
        if name in ("token_file", "upgrade_wheelhouse"):
            if value in (None, ""):
                return None
            return absolute(value) if name == "token_file" else str(absolute(value))
        if name == "runner_options":
            if not isinstance(value, Mapping):
                raise ConfigError("runner_options: expected a table")
            return {str(k): _absolute_option(str(k), v) for k, v in value.items()}
        return None if value is None else str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: invalid value {value!r} ({exc})") from exc


def _parse_mounts(value: Any) -> dict[str, tuple[str, bool]]:
    """``["data=/srv/data:ro", ...]`` (or a TOML table ``{data = "/srv/data:ro"}``, or one
    comma-separated string) -> ``{name: (path, read_only)}`` (see :func:`nymph.mounts.parse_mount`)."""
    from nymph.mounts import parse_mount

    if isinstance(value, Mapping):
        if all(isinstance(v, (tuple, list)) and len(v) == 2 for v in value.values()):
            return {str(k): (str(v[0]), bool(v[1])) for k, v in value.items()}
        items = [f"{k}={v}" for k, v in value.items()]
    else:
        items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    out: dict[str, tuple[str, bool]] = {}
    for item in items:
        if item.strip():
            name, path, read_only = parse_mount(item.strip())
            out[name] = (path, read_only)
    return out


def absolute(value: Any) -> Path:
    """``value`` as an absolute, normalised path (``~`` expanded, relative to the cwd now).

    Every path nymph takes from flags, the environment or the config file goes through here once,
    at configuration: nymph's cwd is not the cwd of what uses the path later (the prefork zygote
    runs in ``/``, a container runtime in its own), so a relative path would point elsewhere there.
    """
    return Path(os.path.abspath(os.path.expanduser(str(value))))


def _absolute_option(key: str, value: Any) -> Any:
    """A runner option's value with its paths made absolute (see :data:`_PATH_OPTIONS`)."""
    name = key.replace("-", "_").lower()
    if name in _PROGRAM_OPTIONS and isinstance(value, str) and os.sep in value:
        return str(absolute(value))
    if name not in _PATH_OPTIONS or value in (None, ""):
        return value
    if isinstance(value, str):
        if name in ("pythonpath", "code_dirs"):  # a list given as one string: os.pathsep or comma separated
            sep = os.pathsep if os.pathsep in value else ","
            return sep.join(str(absolute(v)) for v in value.split(sep) if v.strip())
        return str(absolute(value))
    if isinstance(value, (list, tuple)):
        return [str(absolute(v)) for v in value]
    return value


def load_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    table = raw.get("nymph", raw) if isinstance(raw.get("nymph"), dict) else raw
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = _norm(key)
        if name not in _FIELDS:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        out[name] = value
    return out


RUNNER_OPT_ENV = "NYMPH_RUNNER_OPT_"


def option_value(raw: str) -> Any:
    """A runner option's value from a flag or variable: a TOML value when it is one, else the string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_runner_opts(items: Any) -> dict[str, Any]:
    """``["image=python:3.11", "pids=1024"]`` -> ``{"image": "python:3.11", "pids": 1024}``."""
    out: dict[str, Any] = {}
    for item in [items] if isinstance(items, str) else list(items or ()):
        key, sep, raw = str(item).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--runner-opt: expected KEY=VALUE, got {item!r}")
        out[key] = option_value(raw.strip())
    return out


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        if name == "runner_options":
            continue
        for key in (f"NYMPH_{name.upper()}", f"NYMPH_{_singular(name).upper()}"):
            if key in environ:
                out[name] = environ[key]
                break
    opts = {
        key[len(RUNNER_OPT_ENV) :].lower(): option_value(value.strip())
        for key, value in environ.items()
        if key.startswith(RUNNER_OPT_ENV) and len(key) > len(RUNNER_OPT_ENV)
    }
    if opts:
        out["runner_options"] = opts
    return out


def _singular(name: str) -> str:
    return {v: k for k, v in _ALIASES.items()}.get(name, name)


def resolve(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> NymphConfig:
    """Build the config: ``flags`` (None / empty means unset) over env over the TOML file."""
    environ = os.environ if environ is None else environ
    if config_file is None and environ.get("NYMPH_CONFIG"):
        config_file = Path(environ["NYMPH_CONFIG"])
    layers: list[dict[str, Any]] = []
    if config_file is not None:
        layers.append(load_file(config_file))
    layers.append(from_env(environ))
    flag_layer = {_norm(k): v for k, v in flags.items() if v is not None and v != () and v != []}
    runner_opts = flag_layer.pop("runner_opts", None)
    if runner_opts:
        flag_layer["runner_options"] = parse_runner_opts(runner_opts)
    layers.append(flag_layer)
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer.get("token") and layer.get("token_file"):
            raise ConfigError("set either token or token_file, not both")
        for name, value in layer.items():
            if name not in _FIELDS:
                raise ConfigError(f"unknown setting {name!r}")
            value = _coerce(name, value)
            if name == "runner_options":  # merged key by key: a flag overrides one option, not all
                value = {**merged.get("runner_options", {}), **value}
            if value and name in ("token", "token_file"):  # the higher layer's way of giving it wins
                merged.pop("token_file" if name == "token" else "token", None)
            merged[name] = value
    merged = {k: v for k, v in merged.items() if v is not None or k in ("heartbeat_s", "metrics_port")}
    if merged.get("token_file") is not None:
        merged["token"] = read_token_file(merged["token_file"])
    for required in ("server", "token"):
        if not merged.get(required):
            env = f"NYMPH_{required.upper()}"
            if required == "token":
                raise ConfigError(
                    "missing token: pass --token-file FILE (a file holding the daemon token), set "
                    "NYMPH_TOKEN, or put token_file in the config file"
                )
            raise ConfigError(
                f"missing {required}: pass --{required}, set {env}, or put it in the config file"
            )
    if merged.get("concurrency", 1) < 1:
        raise ConfigError("concurrency must be >= 1")
    if merged.get("runtime_policy", "minor") not in ("strict", "minor", "off"):
        raise ConfigError("runtime_policy must be strict, minor or off")
    if merged.get("log_format", "text") not in ("text", "json"):
        raise ConfigError("log_format must be text or json")
    if merged.get("task_user_pool", 0) < 0:
        raise ConfigError("task_user_pool must be 0 (no pool) or more (--task-user-pool N)")
    if not merged.get("task_user", "nymph-task"):
        raise ConfigError("task_user must name a local user (--task-user NAME)")
    if not merged.get("queues", ("default",)):
        raise ConfigError("at least one queue is needed (--queue)")
    merged["server"] = str(merged["server"]).rstrip("/")
    config = NymphConfig(**merged)
    try:
        config.stream_limits  # noqa: B018 - validates the stream settings together
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return config


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace stripped); the file must not be readable by others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"token_file {path}: cannot read it ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"token_file {path}: not a regular file")
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            raise ConfigError(
                f"token_file {path} is readable or writable by every local user (mode "
                f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`"
            )
        with os.fdopen(fd, "rb", closefd=False) as fh:
            token = fh.read(64 * 1024).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if not token:
        raise ConfigError(f"token_file {path} is empty")
    return token
