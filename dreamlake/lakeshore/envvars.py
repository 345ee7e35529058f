"""Every environment setting of the SDK, the control plane and the task entry: one table, one reader.

:data:`SETTINGS` has a row per name: its type, its default, who reads it and what it means
(``docs/settings.md`` is this table, printed by ``python -m dreamlake.lakeshore.envvars``). The SDK,
the server and the entry read the environment only through the accessors here: :func:`raw`,
:func:`string`, :func:`choice`, :func:`integer`, :func:`number`, :func:`flag`, :func:`is_set` and
:func:`source`, each taking an optional ``env`` mapping (``os.environ`` when omitted). An empty
value counts as unset. A value that does not parse is a ``ValueError`` that names the variable and
what to set.

One name per setting: a renamed setting keeps its old name in :data:`DEPRECATED`, read when the new
one is unset, with one ``FutureWarning`` per process naming the new one. The inline threshold
(seed 003) is ``INLINE_THRESHOLD_BYTES`` on the control plane and in the SDK (HTTP submits and code
archives alike). ``click`` reads the ``envvar=`` of ``lakeshore``'s options (rows read by ``cli``);
nymph resolves its own configuration (``nymph/config.py``, docs/nymph.md) and sets the ``task`` rows
in a task's environment.

Part of the entry bundle (the entry and a task's ``.submit()`` read settings), so it runs on
Python 3.9 and imports nothing at start-up beyond ``os``.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # no typing at runtime: the entry imports this module on every task start
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Union

    Default = Union[str, int, float, bool, None]

MiB = 1024 * 1024
DEFAULT_INLINE_THRESHOLD_BYTES = 256 * 1024  # seed 003
DEFAULT_MAX_PAYLOAD_BYTES = 100 * MiB  # the largest upload the payload store presigns
INLINE_THRESHOLD_ENV = "INLINE_THRESHOLD_BYTES"
INLINE_THRESHOLD_ALIASES = ("LAKESHORE_INLINE_THRESHOLD_BYTES",)  # deprecated

READERS = ("sdk", "cli", "server", "entry", "nymph", "task", "tests")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class Setting:
    """One environment variable: ``kind`` (its type, as the table shows it), ``default`` (None: unset
    means nothing is configured), ``readers`` (a subset of :data:`READERS`), a one-line ``doc``;
    ``choices`` for a ``choice``, ``fallbacks``: other names read when it is unset (no warning)."""

    __slots__ = ("choices", "default", "doc", "fallbacks", "kind", "name", "readers")

    def __init__(
        self,
        name: str,
        kind: str,
        default: Default,
        readers: str,
        doc: str,
        choices: tuple[str, ...] = (),
        fallbacks: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.kind = kind
        self.default = default
        self.readers = tuple(readers.split())
        self.doc = doc
        self.choices = choices
        self.fallbacks = fallbacks

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.kind!r}, {self.default!r})"


S = Setting
#: The table (docs/settings.md). Kinds: str, secret, url, path, paths (os.pathsep-separated), list
#: (comma-separated), int, float (seconds unless the name says otherwise), flag, choice, json.
# fmt: off
SETTINGS: tuple[Setting, ...] = (
    # -- where the SDK, the CLI and nymph find the control plane (settings.py, tls.py)
    S("LAKESHORE_URL", "url", None, "sdk cli nymph",
      "The control plane's URL (`lakeshore server` prints it); inside a task nymph sets it."),
    S("LAKESHORE_TOKEN", "secret", None, "sdk cli nymph",
      "A producer token (`lakeshore token create`); nymph's daemon token on nymph's side."),
    S("LAKESHORE_TOKEN_FILE", "path", None, "sdk entry",
      "Inside a task: the file holding its attempt-scoped credential (nymph sets it; the entry makes it absolute)."),
    S("LAKESHORE_CONFIG", "path", "$XDG_CONFIG_HOME/lakeshore/config.toml", "sdk cli",
      "The TOML file with `url` and `token`, read when the variables are unset."),
    S("LAKESHORE_CA_FILE", "path", None, "sdk cli nymph task",
      "A CA (or self-signed certificate) to trust besides the system's (`--ca-file`)."),
    S("LAKESHORE_CLIENT_CERT", "path", None, "sdk cli nymph task",
      "A client certificate (PEM) presented to a proxy that asks for one (`--client-cert`)."),
    S("LAKESHORE_CLIENT_KEY", "path", None, "sdk cli nymph task",
      "The private key of `LAKESHORE_CLIENT_CERT` (`--client-key`)."),
    S("LAKESHORE_RETRY_WINDOW", "float", 60.0, "sdk",
      "Seconds the SDK keeps retrying a submit while the control plane is unreachable (0: no retry)."),
    # -- what the SDK sends (codeship.py, dispatch/http.py)
    S("LAKESHORE_CODE", "choice", "auto", "sdk",
      "The process default for shipping code: `auto` (the caller's package) or `none` (also `off`, `0`, `false`).",
      choices=("auto", "none")),
    S("LAKESHORE_CODE_MAX_BYTES", "int", 32 * MiB, "sdk",
      "The largest code archive the SDK builds; past it the submit fails naming the roots."),
    S(INLINE_THRESHOLD_ENV, "int", DEFAULT_INLINE_THRESHOLD_BYTES, "sdk server",
      "Payloads and code archives above this many bytes go by reference (S3 or the blob store), not inline."),
    S("LAKESHORE_HOST", "str", "127.0.0.1", "cli",
      "The address `lakeshore server` listens on (`--host`)."),
    S("LAKESHORE_PORT", "int", 8765, "cli",
      "The port `lakeshore server` listens on (`--port`)."),
    S("LAKESHORE_DATA_DIR", "path", "~/.local/share/lakeshore", "cli",
      "Where the SQLite store, its key file and the blob directory live (`--data-dir`)."),
    S("LAKESHORE_DB", "url", None, "cli",
      "The store: a SQLite path or `postgresql://...` (`--db`; default `<data-dir>/lakeshore.db`)."),
    S("LAKESHORE_REDIS_URL", "url", None, "cli",
      "Redis for live frame fan-out across replicas (`--redis`; default in process)."),
    S("LAKESHORE_WORKERS", "str", "auto", "cli",
      "Server processes on the one port (`--workers`): a number, or `auto`: one per core, up to 4, "
      "over PostgreSQL with Redis; one otherwise."),
    S("LAKESHORE_MAX_POLLS", "int", 5000, "cli",
      "Concurrent daemon long polls; past it a poll is answered 503 with Retry-After (`--max-polls`)."),
    S("LAKESHORE_RETENTION", "str", "7d", "cli",
      "How long finished work is kept: `7d`, `12h`, `3600`, or `off` (`--retention`)."),
    S("LAKESHORE_LOG_LEVEL", "choice", "info", "cli",
      "`lakeshore`'s log level (`--log-level`).",
      choices=("debug", "info", "warning", "error")),
    S("LAKESHORE_TLS_CERT", "path", None, "cli",
      "Serve HTTPS with this certificate (PEM; `--tls-cert`)."),
    S("LAKESHORE_TLS_KEY", "path", None, "cli",
      "The private key of `LAKESHORE_TLS_CERT` (`--tls-key`)."),
    # -- the control plane's limits (server/config.py ServerConfig.from_env)
    S("LAKESHORE_LEASE_S", "float", 30.0, "cli server",
      "An invocation's lease: a worker that stops heartbeating loses its call after this (`--lease-s`)."),
    S("LAKESHORE_EXPIRE_EVERY_S", "float", 1.0, "server",
      "The period of the lease sweep."),
    S("LAKESHORE_MAX_BODY_BYTES", "int", 110 * MiB, "server",
      "The largest request body accepted (413 past it)."),
    S("LAKESHORE_SUBMIT_BATCH_MAX", "int", 1000, "server",
      "Submits per `POST /v1/producer/submit-batch`; past it: 413."),
    S("LAKESHORE_HEADER_TIMEOUT_S", "float", 10.0, "server",
      "A request's headers must arrive within this."),
    S("LAKESHORE_BODY_TIMEOUT_S", "float", 30.0, "server",
      "The longest a request body may pause."),
    S("LAKESHORE_KEEP_ALIVE_S", "float", 30.0, "server",
      "How long an idle keep-alive connection is kept."),
    S("LAKESHORE_MAX_CONNECTIONS", "int", 10240, "server",
      "Connections past this are closed on accept."),
    S("LAKESHORE_MAX_HEADER_BYTES", "int", 64 * 1024, "server",
      "The largest request head accepted."),
    S("LAKESHORE_HTTP_PARSER", "choice", None, "server",
      "`httptools` or `h11`; unset: httptools when installed, else h11.",
      choices=("httptools", "h11")),
    S("LAKESHORE_SERVE_SPEC", "json", None, "server",
      "Internal: what `lakeshore server --workers N` hands its worker processes (set by the server)."),
    # -- the control plane's keys and payload stores (store/keys.py, server/payloads.py, server/blobdir.py)
    S("LAKESHORE_SERVER_KEY", "secret", None, "server",
      "The server master key (at least 32 characters, the same on every replica); PostgreSQL needs it or the file."),
    S("LAKESHORE_SERVER_KEY_FILE", "path", None, "server",
      "A file holding the server master key (made 0600 on first use); default next to a SQLite store."),
    S("LAKESHORE_BLOBS_BUCKET", "str", None, "server",
      "The S3 bucket of large payloads; unset: no S3 tier (the blob directory, or inline only)."),
    S("LAKESHORE_S3_ENDPOINT", "url", None, "server",
      "An S3-compatible endpoint URL (path-style); unset: AWS."),
    S("LAKESHORE_S3_REGION", "str", "us-east-1", "server",
      "The S3 signing region.",
      fallbacks=("AWS_REGION", "AWS_DEFAULT_REGION")),
    S("LAKESHORE_S3_ACCESS_KEY", "secret", None, "server",
      "The S3 access key (with `LAKESHORE_S3_SECRET_KEY`); unset: boto3's credential chain.",
      fallbacks=("AWS_ACCESS_KEY_ID",)),
    S("LAKESHORE_S3_SECRET_KEY", "secret", None, "server",
      "The S3 secret key.",
      fallbacks=("AWS_SECRET_ACCESS_KEY",)),
    S("AWS_SESSION_TOKEN", "secret", None, "server",
      "An S3 session token, used with the `AWS_*` keys (not with `LAKESHORE_S3_ACCESS_KEY`)."),
    S("MAX_PAYLOAD_BYTES", "int", DEFAULT_MAX_PAYLOAD_BYTES, "server",
      "Presigning a larger upload answers 413."),
    S("PAYLOAD_PRESIGN_TTL_S", "int", 900, "server",
      "The lifetime of a presigned payload URL, seconds."),
    S("LAKESHORE_BLOBS_DIR", "path", None, "server",
      "The blob directory (large payloads without S3); default `blobs/` next to a SQLite store."),
    S("LAKESHORE_BLOBS_RETENTION_S", "float", 7 * 86400.0, "server",
      "How long an unreferenced blob in the blob directory is kept."),
    S("LAKESHORE_INVOCATION_ID", "str", None, "sdk entry task",
      "Inside a task: the invocation it runs."),
    S("LAKESHORE_ATTEMPT", "int", 1, "sdk task",
      "Inside a task: which attempt this is (`dls.attempt()`)."),
    S("LAKESHORE_CHECKPOINT_DIR", "path", "./checkpoint", "sdk entry task",
      "Inside a task: the directory the next attempt finds again (`dls.checkpoint_dir()`)."),
    S("LAKESHORE_CODE_PATH", "paths", None, "entry task",
      "Inside a task: the shipped code's directories, put first on the import path."),
    S("LAKESHORE_STREAM_WINDOW", "frames:bytes", None, "entry nymph",
      "Inside a task: the frames and bytes a generator may run ahead of delivery before it pauses."),
    S("LAKESHORE_CAPTURE_OUTPUT", "flag", False, "entry",
      "Inside a task: the entry sends stdout and stderr to the workdir's logs itself."),
    S("LAKESHORE_SENDS", "float", None, "entry",
      "Inside a two-way task: the seconds a yield waits for a send."),
    S("LAKESHORE_ALLOW_PICKLED", "flag", False, "entry nymph",
      "Inside a task: pickled functions may run (nymph's `--allow-pickled`)."),
    S("LAKESHORE_RUNTIME_POLICY", "choice", "minor", "entry nymph",
      "Inside a task: how far the caller's Python may differ from the worker's.",
      choices=("strict", "minor", "off")),
    S("LAKESHORE_ALLOW_MODULES", "list", None, "entry nymph",
      "Inside a task: the module patterns of nymph's `--allow-module` (unset: every module)."),
    S("LAKESHORE_RESULT_MAX_BYTES", "int", None, "entry",
      "Inside a task: the largest result serialised (the process runner sets half the memory limit)."),
    S("LAKESHORE_TASK", "str", None, "task",
      "Inside a task: its marker, `nymph-<id>-a<attempt>` (stray cleanup)."),
    S("LAKESHORE_MOUNT_<NAME>", "path", None, "task",
      "Inside a task: the path of the mount it asked for."),
    S("LAKESHORE_EXEC_ID", "str", None, "task",
      "Inside an exec job: its id."),
    S("LAKESHORE_NAMESPACE", "str", None, "task",
      "Inside an exec job: its namespace."),
    S("LAKESHORE_PAYLOAD", "path", None, "task",
      "Inside an exec job: its payload file (empty: none)."),
    S("LAKESHORE_RESULT", "path", None, "task",
      "Inside an exec job: where a typed (msgpack) result goes."),
    # -- the test suite and CI (tests/, scripts/)
    S("LAKESHORE_REQUIRE_SERVICES", "flag", False, "tests",
      "`1`: a test that would skip for a missing service fails."),
    S("LAKESHORE_TEST_PG_URL", "url", None, "tests",
      "PostgreSQL for the store's contract tests."),
    S("LAKESHORE_TEST_REDIS_URL", "url", None, "tests",
      "Redis for the tests (else a redis-server is started)."),
    S("LAKESHORE_TEST_S3_ENDPOINT", "url", None, "tests",
      "S3 for the tests (with `_ACCESS_KEY`, `_SECRET_KEY`)."),
    S("LAKESHORE_TEST_S3_ACCESS_KEY", "secret", None, "tests",
      "The test S3's access key."),
    S("LAKESHORE_TEST_S3_SECRET_KEY", "secret", None, "tests",
      "The test S3's secret key."),
    S("LAKESHORE_TEST_IMAGE", "str", None, "tests",
      "The container image of the runner conformance tests."),
    S("LAKESHORE_TEST_KUBE_NODE", "str", None, "tests",
      "A Kubernetes node that sees `LAKESHORE_TEST_KUBE_WORKDIR`."),
    S("LAKESHORE_TEST_KUBE_WORKDIR", "path", None, "tests",
      "A hostPath directory the Kubernetes tests share."),
    S("LAKESHORE_TEST_KUBE_NAMESPACE", "str", "default", "tests",
      "The Kubernetes tests' namespace."),
    S("LAKESHORE_TEST_SLURM", "flag", False, "tests",
      "`1`: Slurm is up (scripts/services/slurm.sh prints it)."),
    S("LAKESHORE_TEST_USERS_MADE", "flag", False, "tests",
      "The tests' host users exist already."),
    S("LAKESHORE_TEST_WORKERS", "int", 4, "tests",
      "pytest-xdist processes of scripts/test.sh."),
    S("LAKESHORE_SUITE_RUN", "str", None, "tests",
      "One suite run's id (scripts/test.sh sets it)."),
    S("LAKESHORE_ARTIFACTS", "path", "tests/artifacts", "tests",
      "Where the browser tests put screenshots."),
    S("LAKESHORE_IMAGE_CACHE", "path", "/var/cache/lakeshore", "tests",
      "scripts/services/docker.sh's image cache."),
    S("LAKESHORE_SERVICES_DIR", "path", None, "tests",
      "Where scripts/services/ keep the services' state."),
)
# fmt: on
del S

#: Deprecated names: old -> the one name now. Read when the new name is unset, with a warning.
DEPRECATED = {
    "LAKESHORE_SERVER": "LAKESHORE_URL",  # lakeshore worker's earlier variable
    "LAKESHORE_INLINE_THRESHOLD_BYTES": INLINE_THRESHOLD_ENV,  # what code archives read before
}

BY_NAME = {s.name: s for s in SETTINGS}
_ALIASES: dict[str, list[str]] = {}
for _old, _new in DEPRECATED.items():
    _ALIASES.setdefault(_new, []).append(_old)
_WARNED: set[str] = set()  # deprecated names already warned about in this process
_UNSET = object()


def setting(name: str) -> Setting:
    """The row of ``name``; KeyError saying where to add one when the table has none."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"{name} is not in dreamlake/lakeshore/envvars.py SETTINGS: add a row for it"
        ) from None


def _warn_deprecated(old: str, new: str) -> None:
    if old in _WARNED:
        return
    _WARNED.add(old)
    import warnings

    warnings.warn(f"{old} is deprecated: set {new} instead", FutureWarning, stacklevel=4)


def _lookup(name: str, env: Mapping[str, str] | None) -> tuple[str, str | None]:
    """``(the name the value came from, the value)``; value None when unset or empty."""
    row = setting(name)
    env = os.environ if env is None else env
    value = env.get(name)
    if value is not None and value.strip():
        return name, value
    for old in _ALIASES.get(name, ()):
        value = env.get(old)
        if value is not None and value.strip():
            _warn_deprecated(old, name)
            return old, value
    for other in row.fallbacks:
        value = env.get(other)
        if value is not None and value.strip():
            return other, value
    return name, None


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """``$name`` as set (a deprecated alias or a fallback when it is unset); None when unset or empty."""
    return _lookup(name, env)[1]


def source(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The name ``$name``'s value comes from: itself, a deprecated alias or a fallback; None when unset."""
    used, value = _lookup(name, env)
    return None if value is None else used


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``$name`` (or its alias or fallback) has a non-empty value."""
    return _lookup(name, env)[1] is not None


def string(name: str, env: Mapping[str, str] | None = None, default: object = _UNSET) -> str | None:
    """``$name`` stripped, else ``default`` (else the table's default when it is a string, else None)."""
    value = _lookup(name, env)[1]
    if value is not None:
        return value.strip()
    if default is not _UNSET:
        return default  # type: ignore[return-value]
    fallback = setting(name).default
    return fallback if isinstance(fallback, str) else None


def choice(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """``$name`` lower-cased, one of the row's choices (else the table's default); ValueError listing them."""
    used, value = _lookup(name, env)
    row = setting(name)
    if value is None:
        return row.default  # type: ignore[return-value]
    wanted = value.strip().lower()
    if wanted not in row.choices:
        raise ValueError(f"{used}={wanted!r} is not one of {', '.join(row.choices)}: set one, or unset it")
    return wanted


def _default(name: str, default: object) -> object:
    return setting(name).default if default is _UNSET else default


def integer(
    name: str, env: Mapping[str, str] | None = None, *, default: object = _UNSET, minimum: int = 0
) -> int:
    """``$name`` as a whole number (``default``, else the table's, when unset or empty); ValueError
    naming the variable and the fix when it is not one or is below ``minimum``."""
    used, value = _lookup(name, env)
    if value is None:
        return _default(name, default)  # type: ignore[return-value]
    text = value.strip()
    try:
        parsed = int(text)
    except ValueError:
        raise ValueError(f"{used}={text!r} is not a whole number: set it to one, or unset it") from None
    if parsed < minimum:
        raise ValueError(f"{used}={parsed} is below {minimum}: set it to at least {minimum}, or unset it")
    return parsed


def number(
    name: str,
    env: Mapping[str, str] | None = None,
    *,
    default: object = _UNSET,
    minimum: float = 0.0,
    positive: bool = False,
) -> float:
    """``$name`` as a finite number (``default``, else the table's, when unset or empty); ValueError
    naming the variable and the fix when it is not one, is below ``minimum``, or (``positive``) is 0."""
    used, value = _lookup(name, env)
    if value is None:
        return _default(name, default)  # type: ignore[return-value]
    text = value.strip()
    try:
        parsed = float(text)
    except ValueError:
        parsed = float("nan")
    if parsed != parsed or parsed in (float("inf"), float("-inf")):
        raise ValueError(f"{used}={text!r} is not a number: set it to one (e.g. 30), or unset it")
    if positive and not parsed > 0:
        raise ValueError(f"{used}={text!r} must be a positive number: set one above 0, or unset it")
    if parsed < minimum:
        raise ValueError(f"{used}={text!r} is below {minimum:g}: set it to at least {minimum:g}, or unset it")
    return parsed


def flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """``$name`` as a yes/no: 1/true/yes/on or 0/false/no/off (the table's default when unset);
    ValueError naming the variable for anything else."""
    used, value = _lookup(name, env)
    if value is None:
        return bool(setting(name).default)
    word = value.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"{used}={word!r} is not a yes/no: set it to 1 or 0, or unset it")


def env_int(
    name: str,
    default: int,
    *,
    minimum: int = 0,
    env: Mapping[str, str] | None = None,
    aliases: object = (),
) -> int:
    """:func:`integer` with the default first (the older spelling); ``aliases`` come from :data:`DEPRECATED`."""
    return integer(name, env, default=default, minimum=minimum)


def inline_threshold(env: Mapping[str, str] | None = None) -> int:
    """``INLINE_THRESHOLD_BYTES`` (bytes; its deprecated alias too), else 256 KiB."""
    return integer(INLINE_THRESHOLD_ENV, env)


# -- docs/settings.md ------------------------------------------------------------------------------

_HEAD = """# Settings

Every environment variable the SDK, the `lakeshore` CLI and control plane, and the task entry read,
in one table. Generated from `SETTINGS` in `dreamlake/lakeshore/envvars.py` by
`python -m dreamlake.lakeshore.envvars > docs/settings.md` (a test checks that this file matches).

An empty value counts as unset; a value that does not parse stops the reader with an error naming
the variable. *Read by*: `sdk` (the client library, in a user's process or a task), `cli` (an option
of `lakeshore`, read by click; the flag wins), `server` (the control plane), `entry` (the task entry
nymph runs), `nymph` (nymph passes or reads it; nymph's own settings: [nymph.md](nymph.md)), `task`
(nymph sets it for the task's code), `tests` (the test suite and CI scripts).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _show(row: Setting) -> str:
    value = row.default
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        size = f"{value // MiB} MiB" if value % MiB == 0 else f"{value // 1024} KiB"
        return f"`{value}` ({size})"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    return f"`{value}`"


def render() -> str:
    """docs/settings.md."""
    lines = [_HEAD, "| Name | Type | Default | Read by | Meaning |", "|---|---|---|---|---|"]
    for row in sorted(SETTINGS, key=lambda r: r.name):
        kind = row.kind + (f" ({' / '.join(row.choices)})" if row.choices else "")
        doc = row.doc + (f" Also read: {', '.join(row.fallbacks)}." if row.fallbacks else "")
        cells = (f"`{row.name}`", kind, _show(row), ", ".join(row.readers), doc)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "## Deprecated names", "", "Read when the new name is unset, with a warning.", ""]
    lines += ["| Old name | Set instead |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in sorted(DEPRECATED.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
