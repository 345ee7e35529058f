"""The ``lakeshore`` console script: ``server``, ``token create``, ``namespace pin``, ``worker``, and
the operator commands of ``ops_cli`` (``queues``, ``workers``, ``ls``, ``show``, ``cancel``,
``stream``, ``logs``).

Configuration is resolved here, once: flags over ``LAKESHORE_*`` environment variables over
defaults. Heavy imports (the store, Starlette, uvicorn) happen inside the commands.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click

from dreamlake.lakeshore import __version__

DEFAULT_DATA_DIR = "~/.local/share/lakeshore"
DB_FILE = "lakeshore.db"


class _WorkersType(click.ParamType):  # type: ignore[type-arg]  # generic only from click 8.2
    """``--workers``: a number of processes (1 to 256), or ``auto`` (None: chosen once the store is
    known, ``server.serve.auto_workers``)."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None:
            return None
        text = str(value).strip().lower()
        if text == "auto":
            return None
        try:
            number = int(text)
        except ValueError:
            number = 0
        if not 1 <= number <= 256:
            self.fail(f"{value!r} is not a number of processes from 1 to 256, or 'auto'", param, ctx)
        return number


def _data_dir(value: str) -> Path:
    """The data directory, private: created 0700; an existing one of ours that others can enter is
    narrowed to 0700 (it holds the store and tokens.json)."""
    path = Path(value).expanduser()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
        if info.st_mode & 0o077 and info.st_uid == os.getuid():
            path.chmod(0o700)
            logging.getLogger(__name__).warning(
                "data directory %s was mode %o; narrowed to 700", path, info.st_mode & 0o777
            )
    except OSError as exc:
        raise click.UsageError(f"cannot create the data directory {path}: {exc}; pass --data-dir") from exc
    return path


def _open_store(db: str | None, data_dir: str) -> Any:
    from dreamlake.lakeshore.errors import PlaneError
    from dreamlake.lakeshore.store import open_store

    url = db or str(_data_dir(data_dir) / DB_FILE)
    try:
        return open_store(url)
    except PlaneError as exc:
        raise click.UsageError(str(exc)) from exc


_store_options = [
    click.option(
        "--data-dir",
        envvar="LAKESHORE_DATA_DIR",
        default=DEFAULT_DATA_DIR,
        show_default=True,
        help="Where the SQLite store and tokens.json live.",
    ),
    click.option(
        "--db",
        envvar="LAKESHORE_DB",
        default=None,
        help="Store URL: a SQLite path or postgresql://... (default: <data-dir>/lakeshore.db).",
    ),
]


def store_options(fn: Any) -> Any:
    for option in reversed(_store_options):
        fn = option(fn)
    return fn


@click.group()
@click.version_option(__version__, "--version", "-V", prog_name="lakeshore", message="%(prog)s %(version)s")
@click.option(
    "--log-level",
    envvar="LAKESHORE_LOG_LEVEL",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def main(log_level: str) -> None:
    """lakeshore: run Python functions remotely (control plane and tools)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":
        # Alembic narrates every migration step at INFO, httpx every request: the operator
        # commands' output (``lakeshore logs`` prints the invocation's stderr on stderr) is theirs
        for noisy in ("alembic", "httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


@main.command()
@click.option("--host", envvar="LAKESHORE_HOST", default="127.0.0.1", show_default=True)
@click.option("--port", envvar="LAKESHORE_PORT", default=8765, show_default=True, type=int)
@store_options
@click.option(
    "--redis",
    "redis_url",
    envvar="LAKESHORE_REDIS_URL",
    default=None,
    help="Redis URL for live frame fan-out across replicas (default: in process).",
)
@click.option(
    "--lease-s",
    envvar="LAKESHORE_LEASE_S",
    default=None,
    type=float,
    help="Invocation lease in seconds (default 30).",
)
@click.option(
    "--workers",
    envvar="LAKESHORE_WORKERS",
    default="auto",
    show_default=True,
    type=_WorkersType(),
    help="Server processes on the one port: the way past one core, over PostgreSQL (with --redis "
    "for live frames). 'auto': one per core, up to 4, over PostgreSQL with --redis; one otherwise. "
    "See docs/performance.md.",
)
@click.option(
    "--max-polls",
    envvar="LAKESHORE_MAX_POLLS",
    default=None,
    type=click.IntRange(min=1),
    help="Concurrent daemon long polls served; past it a poll is answered 503 with Retry-After "
    "(default 5000). Each needs a file descriptor: the soft limit is raised to the hard one.",
)
@click.option(
    "--retention",
    envvar="LAKESHORE_RETENTION",
    default=None,
    help="How long finished invocations (their frames, attempts, results) and exec jobs (and the "
    "S3 payloads they reference) are kept: 7d, 12h, 3600, or off (default 7d). A background "
    "sweep deletes what expired; `lakeshore gc` runs one now.",
)
@click.option(
    "--retention-queue",
    "retention_queue",
    multiple=True,
    metavar="QUEUE=DURATION",
    help="A queue's own retention, e.g. gpu=30d or scratch=1h or audit=off (repeatable).",
)
@click.option(
    "--tls-cert",
    envvar="LAKESHORE_TLS_CERT",
    default=None,
    type=click.Path(dir_okay=False),
    help="Serve HTTPS with this certificate (PEM; with --tls-key). Plain HTTP is for loopback only.",
)
@click.option(
    "--tls-key",
    envvar="LAKESHORE_TLS_KEY",
    default=None,
    type=click.Path(dir_okay=False),
    help="The private key of --tls-cert (PEM).",
)
def server(
    host: str,
    port: int,
    data_dir: str,
    db: str | None,
    redis_url: str | None,
    lease_s: float | None,
    workers: int | None,
    max_polls: int | None,
    retention: str | None,
    retention_queue: tuple[str, ...],
    tls_cert: str | None,
    tls_key: str | None,
) -> None:
    """Run the control plane (HTTP, or HTTPS with --tls-cert/--tls-key) over the store."""
    import importlib

    try:  # the server extra, before anything is printed or opened
        for module in ("starlette.applications", "uvicorn", "jinja2"):
            importlib.import_module(module)
        from dreamlake.lakeshore.server.bootstrap import bootstrap_tokens, start_line
        from dreamlake.lakeshore.server.config import ServerConfig
        from dreamlake.lakeshore.server.payloads import PayloadStore
        from dreamlake.lakeshore.server.serve import ServeSpec, serve
    except ModuleNotFoundError as exc:
        from dreamlake.lakeshore.extras import install_hint

        name = (exc.name or "").split(".")[0] or None
        raise click.ClickException(
            f"lakeshore server needs {name!r}, which is not installed: {install_hint(name)}"
        ) from exc
    from dreamlake.lakeshore import tls

    try:
        tls_options = tls.server_options(tls_cert, tls_key)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    if lease_s is not None and lease_s <= 0:
        raise click.UsageError("--lease-s must be a positive number of seconds")
    data = _data_dir(data_dir)
    store = _open_store(db, data_dir)
    if workers is None:  # --workers auto
        from dreamlake.lakeshore.server.serve import auto_workers

        workers = auto_workers(store.kind, redis_url)
    if workers > 1 and store.db.memory:
        raise click.UsageError("--workers needs a store the processes share: a SQLite file or PostgreSQL")
    if workers > 1 and store.kind == "sqlite":
        click.echo(
            "lakeshore: --workers over SQLite serialises on the file's write lock; "
            "PostgreSQL (and --redis) is the way past one core",
            err=True,
        )
    from dreamlake.lakeshore.store.keys import KeyConfigError

    try:  # the keys live outside the store (store/keys.py): refuse to start without them
        store.server_key("task-token")
    except KeyConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"{'https' if tls_options else 'http'}://{shown_host}:{port}"
    if not tls_options and not tls.loopback(host):
        click.echo(
            f"lakeshore: WARNING: listening on {host} without TLS: tokens cross the network in plain "
            "text. Serve HTTPS (--tls-cert/--tls-key) or put a TLS proxy in front (docs/security.md); "
            "plain HTTP is for loopback only",
            err=True,
        )
    for line in [*(bootstrap_tokens(store, data, url) or ()), start_line(url, data)]:
        click.echo(line)
    overrides: dict[str, Any] = {"lease_s": lease_s, "max_polls": max_polls}
    try:
        overrides.update(_retention_overrides(retention, retention_queue))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        PayloadStore.from_env()  # fail here, once, on a bad payload configuration
        config = ServerConfig.from_env(**overrides)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    _raise_open_files(config.max_polls)
    spec = ServeSpec(db=db or str(data / DB_FILE), redis_url=redis_url, config=overrides)
    serve(spec, host=host, port=port, workers=workers, store=store, tls=tls_options)


def _retention_overrides(retention: str | None, queues: tuple[str, ...]) -> dict[str, Any]:
    """``ServerConfig`` fields of ``--retention`` / ``--retention-queue`` (ValueError when bad)."""
    from dreamlake.lakeshore.server.config import parse_duration, parse_queue_retention

    out: dict[str, Any] = {}
    if retention is not None:
        out["retention_s"] = parse_duration(retention, "--retention")
    if queues:
        out["retention_queues"] = parse_queue_retention(queues)
    return out


@main.command()
@store_options
@click.option("--retention", default=None, help="As `lakeshore server --retention` (default 7d).")
@click.option(
    "--retention-queue", "retention_queue", multiple=True, metavar="QUEUE=DURATION",
    help="As `lakeshore server --retention-queue` (repeatable).",
)  # fmt: skip
@click.option(
    "--batch", default=200, show_default=True, type=click.IntRange(1, 10_000), help="Rows per transaction."
)
def gc(
    data_dir: str, db: str | None, retention: str | None, retention_queue: tuple[str, ...], batch: int
) -> None:
    """Delete expired work now (what the server's background sweep does): finished invocations with
    their frames and attempts, done exec jobs, and the S3 payloads those referenced."""
    import time

    from dreamlake.lakeshore.server.config import DEFAULT_RETENTION_S
    from dreamlake.lakeshore.server.payloads import PayloadStore

    try:
        rules = _retention_overrides(retention, retention_queue)
        payloads = PayloadStore.from_env()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    store = _open_store(db, data_dir)
    try:
        default_s = rules.get("retention_s", DEFAULT_RETENTION_S)
        total = store.gc(time.time(), default_s, dict(rules.get("retention_queues", ())), limit=batch)
    finally:
        store.close()
    deleted = payloads.delete(total.payload_keys) if payloads is not None and total.payload_keys else 0
    click.echo(
        f"deleted {total.invocations} invocations ({total.frames} frames, {total.attempts} attempts), "
        f"{total.exec_jobs} exec jobs, {deleted} payloads"
        + (
            f" ({len(total.payload_keys)} referenced; no S3 configured)"
            if total.payload_keys and payloads is None
            else ""
        )
    )


FDS_PER_SERVER = 256  # descriptors besides the long polls: store, other routes, logs


def _raise_open_files(max_polls: int) -> None:
    """Raise the soft limit on open files to the hard one (a fleet's polls each hold a socket);
    warn when even that is short of ``max_polls``."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft != resource.RLIM_INFINITY and soft < max_polls + FDS_PER_SERVER:
        logging.getLogger(__name__).warning(
            "open-file limit %d is below --max-polls %d plus %d: raise `ulimit -n` (LimitNOFILE= under "
            "systemd) or lower --max-polls, or polls past the limit fail to connect",
            soft,
            max_polls,
            FDS_PER_SERVER,
        )


@main.group()
def token() -> None:
    """Manage bearer tokens."""


@token.command("create")
@click.option(
    "--kind", required=True, type=click.Choice(["admin", "producer", "daemon", "namespace", "metrics"])
)
@click.option("--name", required=True, help="A label for the token (who or what holds it).")
@click.option(
    "--namespace",
    default=None,
    help="Bind the token to a namespace: a producer submits and sees only its invocations there, a "
    "daemon claims only its work, a namespace token calls only /v1/namespaces/NS/*. Unbound "
    "producers act in 'default'; unbound daemons serve every namespace.",
)
@click.option(
    "--may-script",
    is_flag=True,
    help="Let this producer token submit run_config.script invocations (shell on the nymph host).",
)
@store_options
def token_create(
    kind: str, name: str, namespace: str | None, may_script: bool, data_dir: str, db: str | None
) -> None:
    """Mint a token and print its secret (shown once; only its sha256 is stored)."""
    from dreamlake.lakeshore.server.http import NAME_RE

    if kind == "namespace" and not namespace:
        raise click.UsageError("--kind namespace needs --namespace NS")
    if kind == "admin" and namespace:
        raise click.UsageError("an admin token acts in every namespace: drop --namespace")
    if namespace is not None and not NAME_RE.match(namespace):
        raise click.UsageError(f"--namespace {namespace!r}: expected 1-128 characters of [A-Za-z0-9._-]")
    if may_script and kind != "producer":
        raise click.UsageError("--may-script is for producer tokens (admins may always submit scripts)")
    store = _open_store(db, data_dir)
    try:
        click.echo(store.create_token(kind, name, namespace, may_script=may_script))
    finally:
        store.close()


@main.group()
def namespace() -> None:
    """Manage namespaces."""


@namespace.command("pin")
@click.argument("ns")
@click.argument("version", required=False)
@click.option("--clear", is_flag=True, help="Remove the pin.")
@store_options
def namespace_pin(ns: str, version: str | None, clear: bool, data_dir: str, db: str | None) -> None:
    """Pin the nymph VERSION daemons of namespace NS run (or --clear the pin)."""
    if clear == (version is not None):
        raise click.UsageError("give either a VERSION or --clear")
    store = _open_store(db, data_dir)
    try:
        store.pin_version(ns, None if clear else version)
    finally:
        store.close()
    click.echo(f"namespace {ns}: " + ("pin cleared" if clear else f"pinned to nymph {version}"))


_QUOTA_NAMES = {"queued": "max_queued", "topics": "max_topics", "payload-bytes": "max_payload_bytes"}


def _size_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from dreamlake.lakeshore.humanize import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _quota_text(quota: Any) -> str:
    from dreamlake.lakeshore.humanize import size

    parts = []
    if quota is not None and quota.max_queued is not None:
        parts.append(f"max_queued {quota.max_queued}")
    if quota is not None and quota.max_topics is not None:
        parts.append(f"max_topics {quota.max_topics}")
    if quota is not None and quota.max_payload_bytes is not None:
        parts.append(f"max_payload_bytes {quota.max_payload_bytes} ({size(quota.max_payload_bytes)})")
    return ", ".join(parts) or "no quota"


@namespace.command("quota")
@click.argument("ns", required=False)
@click.option(
    "--queued",
    "--max-queued",
    "queued",
    type=click.IntRange(min=0),
    default=None,
    help="Queued invocations NS may hold; a submit past it answers 429 with Retry-After.",
)
@click.option(
    "--topics",
    type=click.IntRange(min=0),
    default=None,
    help="Topics NS's producers may make; a post that would make one more answers 429.",
)
@click.option(
    "--payload-bytes",
    callback=_size_option,
    default=None,
    metavar="SIZE",
    help="Bytes NS may presign for upload within the payload window (the blob directory's "
    "LAKESHORE_BLOBS_RETENTION_S; 7 days with a bucket), e.g. 10g; a presign past it answers 429.",
)
@click.option(
    "--lift",
    type=click.Choice(sorted(_QUOTA_NAMES)),
    multiple=True,
    help="Lift one of NS's quotas, keeping the others (repeatable).",
)
@click.option("--clear", is_flag=True, help="Lift all of NS's quotas.")
@store_options
def namespace_quota(
    ns: str | None,
    queued: int | None,
    topics: int | None,
    payload_bytes: int | None,
    lift: tuple[str, ...],
    clear: bool,
    data_dir: str,
    db: str | None,
) -> None:
    """Set, lift or show the quotas of namespace NS; without NS, list every namespace's quotas.

    Each of --queued, --topics and --payload-bytes sets one quota and keeps the others; --lift
    NAME removes one, --clear all. Past a quota the control plane answers 429 with Retry-After and
    a message naming it (the SDK raises QuotaExceeded). Replicas apply a change within 5 s."""
    import dataclasses

    from dreamlake.lakeshore.server.http import NAME_RE
    from dreamlake.lakeshore.store.api import Quota

    setting = {"max_queued": queued, "max_topics": topics, "max_payload_bytes": payload_bytes}
    setting = {k: v for k, v in setting.items() if v is not None}
    changes = bool(setting or lift or clear)
    if ns is not None and not NAME_RE.match(ns):
        raise click.UsageError(f"namespace {ns!r}: expected 1-128 characters of [A-Za-z0-9._-]")
    if changes and ns is None:
        raise click.UsageError("name the namespace: lakeshore namespace quota NS --queued N")
    if clear and (setting or lift):
        raise click.UsageError("--clear lifts every quota: give it alone")
    for name in lift:
        if _QUOTA_NAMES[name] in setting:
            raise click.UsageError(f"--{name} and --lift {name}: give one")
    store = _open_store(db, data_dir)
    try:
        quotas = store.quotas()
        if changes:
            assert ns is not None
            current = quotas.get(ns, Quota())
            lifted = {_QUOTA_NAMES[name]: None for name in lift}
            store.set_quota(ns, None if clear else dataclasses.replace(current, **setting, **lifted))
            quotas = store.quotas()
    finally:
        store.close()
    for name in [ns] if ns is not None else sorted(quotas):
        click.echo(f"namespace {name}: {_quota_text(quotas.get(name))}")


# -- `lakeshore worker ...` ---------------------------------------------------------------------
# The SDK's worker commands live in dreamlake/lakeshore/worker_cli.py (a click group named
# `worker`); they are attached here when that module exists.
try:
    from dreamlake.lakeshore.worker_cli import worker as _worker_group
except ImportError:  # pragma: no cover - until the SDK adds it
    pass
else:
    main.add_command(_worker_group)


# -- `lakeshore queues|workers|ls|show|cancel|stream|logs` (dreamlake/lakeshore/ops_cli.py) ------
from dreamlake.lakeshore.ops_cli import COMMANDS as _OPS_COMMANDS  # noqa: E402

for _command in _OPS_COMMANDS:
    main.add_command(_command)

# -- `lakeshore exec` (dreamlake/lakeshore/exec_cli.py) ---------------------------------------------
from dreamlake.lakeshore.exec_cli import exec_command as _exec_command  # noqa: E402

main.add_command(_exec_command)

from dreamlake.lakeshore.secret_cli import secret as _secret_group  # noqa: E402

main.add_command(_secret_group)

# -- `lakeshore queue limit` (dreamlake/lakeshore/limits_cli.py) -------------------------------
from dreamlake.lakeshore.limits_cli import queue as _queue_group  # noqa: E402

main.add_command(_queue_group)


if __name__ == "__main__":  # pragma: no cover
    main()
