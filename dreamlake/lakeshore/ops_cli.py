"""The operator commands of ``lakeshore``: ``queues``, ``workers``, ``ls``, ``show``, ``cancel``,
``stream`` and ``logs``, over the control plane's HTTP routes.

Each finds the control plane as the SDK does (``dreamlake.lakeshore.settings``): ``--url`` /
``--token``, else ``LAKESHORE_URL`` / ``LAKESHORE_TOKEN``, else the config file. Output is a table
(or, for ``show``, a report) by default and JSON with ``--json`` (``stream --json``: one JSON object
per line). Errors are one line on stderr and exit status 1; an unknown id exits 2 for ``show``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from dreamlake.lakeshore.errors import LakeshoreError, NotFound
from dreamlake.lakeshore.humanize import age, duration, when
from dreamlake.lakeshore.states import STATES
from dreamlake.lakeshore.termsafe import for_terminal

if TYPE_CHECKING:
    from dreamlake.lakeshore.dispatch.http import HttpDispatch
    from dreamlake.lakeshore.ops_client import OpsClient
    from dreamlake.lakeshore.wire import Frame

_SINCE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# -- formatting ------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart; the last column is not padded."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)] + [row[-1]]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def parse_since(value: str | None, now: float | None = None) -> float | None:
    """``10m`` / ``2h`` / ``1d`` / ``30s`` ago, an ISO date-time, or epoch seconds."""
    if not value:
        return None
    now = time.time() if now is None else now
    m = _SINCE_RE.match(value.strip())
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: use an age like 10m, 2h or 1d, an ISO date-time, or epoch seconds"
        ) from None


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def _echo(text: str, *, raw: bool = False, err: bool = False) -> None:
    """``click.echo`` of text that holds what tenants wrote: control sequences escaped on a
    terminal unless ``raw`` (``termsafe``)."""
    click.echo(for_terminal(text, sys.stderr if err else sys.stdout, raw=raw), err=err)


_raw_option = click.option(
    "--raw",
    is_flag=True,
    help="Write the bytes as they are, control sequences included (escaped on a terminal).",
)


# -- connection ------------------------------------------------------------------------------------

_connection_options = [
    click.option(
        "--url", default=None, help="Control plane URL (default: $LAKESHORE_URL, then the config file)."
    ),
    click.option(
        "--token", default=None, help="Bearer token (default: $LAKESHORE_TOKEN, then the config file)."
    ),
]


def connection_options(fn: Any) -> Any:
    from dreamlake.lakeshore import tls

    for option in reversed([*_connection_options, *tls.cli_options()]):
        fn = option(fn)
    return fn


def _settings(url: str | None, token: str | None) -> tuple[str, str]:
    from dreamlake.lakeshore.settings import load

    try:
        return load(url, token).require()
    except LakeshoreError as exc:
        raise click.UsageError(str(exc)) from exc


def _client(url: str | None, token: str | None) -> OpsClient:
    from dreamlake.lakeshore.ops_client import OpsClient

    u, t = _settings(url, token)
    try:
        return OpsClient(u, t)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _plane(url: str | None, token: str | None) -> HttpDispatch:
    from dreamlake.lakeshore.dispatch.http import HttpDispatch

    u, t = _settings(url, token)
    try:
        return HttpDispatch(u, t)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _fail(exc: Exception, code: int = 1) -> None:
    click.echo(f"lakeshore: {exc}", err=True)
    sys.exit(code)


def guarded(fn: Callable[..., None]) -> Callable[..., None]:
    """Report a LakeshoreError as one line on stderr (exit 1; 2 for an unknown invocation)."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except NotFound as exc:
            _fail(exc, 2)
        except (LakeshoreError, ValueError) as exc:
            _fail(exc)

    return wrapped


# -- commands --------------------------------------------------------------------------------------


_TERMINAL = ("succeeded", "failed", "killed", "timeout", "cancelled")


def attempt_label(inv: dict[str, Any], long: bool = False) -> str:
    """The attempt as an operator should read it: ``1/3`` while more may come; once the call is
    over, no ``/3`` that reads as retries still coming (``1 final``, or ``1 of up to 3, final``)."""
    n, most = inv["attempt"], inv["max_attempts"]
    preempted = int(inv.get("preemptions") or 0)  # attempts that spent none of max_attempts
    handed = int(inv.get("handbacks") or 0)  # nor those handed back before they started
    parts = [f"+{preempted} preempted"] if preempted else []
    parts += [f"+{handed} handed back"] if handed else []
    note = f" ({', '.join(parts)}, not counted)" if long and parts else ""
    preempted += handed
    if inv["state"] not in _TERMINAL:
        return (f"{n} of {most + preempted}{note}") if long else f"{n}/{most + preempted}"
    if long:
        spent = n - preempted
        return (f"{n} of up to {most}, final" if spent < most else f"{n} of {most + preempted}, final") + note
    return f"{n} final"


def _sweep_of(d: dict[str, Any]) -> str | None:
    rc = d.get("run_config")
    sweep = rc.get("sweep") if isinstance(rc, dict) else None
    return sweep if isinstance(sweep, str) else None


def function_line(fn: dict[str, Any]) -> str:
    """``show``'s function: its name, how it travelled, and the hash that identifies its code:
    ``mod.topk  (by reference, source sha256:1a2b...)``, ``topk  (pickled, sha256:...)``."""
    if not fn.get("qualname"):
        return "-"
    kind = fn.get("kind")
    name = f"{fn['module']}.{fn['qualname']}" if kind == "ref" and fn.get("module") else fn["qualname"]
    digest = fn.get("hash")
    if kind == "ref":
        how = "by reference, " + (f"source {digest}" if digest else "no source hash (source unavailable)")
    elif kind == "pickle":
        how = "pickled" + (f", {_short(digest)}" if digest else "")
    else:
        return name
    if fn.get("code"):
        how += f"; code archive sha256:{fn['code'][:16]}"
    return f"{name}  ({how})"


def _short(digest: str) -> str:
    """``sha256:`` and 16 hex digits (a source hash's own length), for a full blob hash."""
    head, _, hexits = digest.partition(":")
    return f"{head}:{hexits[:16]}" if hexits else digest[:23]


@click.command()
@connection_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@guarded
def queues(url: str | None, token: str | None, as_json: bool) -> None:
    """Queues: depth by state, fleet-wide limit, oldest queued age, live workers serving each; then
    the concurrency keys' limits (max_concurrency) with their calls running now."""
    with _client(url, token) as client:
        listing = client.queue_listing()
    rows, keys = listing["queues"], listing.get("key_limits") or []
    if as_json:
        _echo_json(rows)
        return
    click.echo(
        table(
            [
                "QUEUE",
                "QUEUED",
                "RUNNING",
                "LIMIT",
                "OLDEST QUEUED",
                "WORKERS",
                "SUCCEEDED",
                "FAILED",
                "KILLED",
                "TIMEOUT",
                "CANCELLED",
            ],
            [
                [
                    q["name"],
                    q["queued"],
                    q["running"],
                    "-" if q.get("max_running") is None else q["max_running"],  # lakeshore queue limit
                    age(q["oldest_queued_age_s"]),
                    q["workers_live"],
                    q["counts"].get("succeeded", 0),
                    q["counts"].get("failed", 0),
                    q["counts"].get("killed", 0),  # a cancelled running call ends killed
                    q["counts"].get("timeout", 0),
                    q["counts"].get("cancelled", 0),
                ]
                for q in rows
            ],
        )
    )
    if keys:
        click.echo()
        click.echo(
            table(
                ["CONCURRENCY KEY", "LIMIT", "RUNNING"],
                [[k["key"], k["max_concurrency"], k["running"]] for k in keys],
            )
        )


@click.command()
@connection_options
@click.option("--live", is_flag=True, help="Only workers seen in the last 5 minutes.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@guarded
def workers(url: str | None, token: str | None, live: bool, as_json: bool) -> None:
    """Workers: id, host, runner, queues, slots busy/total, GPUs free/total (model), CPUs and
    memory, last heartbeat, version, labels."""
    with _client(url, token) as client:
        rows = list(client.all_workers(live=live))
    if as_json:
        _echo_json(rows)
        return
    click.echo(
        table(
            [
                "WORKER",
                "HOST",
                "RUNNER",
                "QUEUES",
                "SLOTS",
                "GPUS FREE",
                "CPUS/MEMORY",
                "LAST SEEN",
                "VERSION",
                "LABELS",
            ],
            [
                [
                    w["worker_id"],
                    w["hostname"],
                    w["runner"],
                    ",".join(w["queues"]),
                    f"{w['busy']}/{w['slots'] if w['slots'] is not None else '?'}",
                    *capacity_cells(w),
                    age(w["last_seen_age_s"])
                    + ("" if w["live"] else " (stopped)" if w.get("stopped_at") else " (gone)"),
                    w["version"],
                    ",".join(f"{k}={v}" for k, v in sorted(w["labels"].items())) or "-",
                ]
                for w in rows
            ],
        )
    )


def capacity_cells(w: dict[str, Any]) -> list[str]:
    """``GPUS FREE`` (free/total and model, free from the worker's latest poll) and
    ``CPUS/MEMORY`` (as it registered them) of a worker row; ``-`` for what it did not say."""
    cap = w.get("capacity") or {}
    free = (w.get("free") or {}).get("gpus")
    total = cap.get("gpus") or 0
    models = "+".join(cap.get("gpu_models") or [])
    gpus = f"{'?' if free is None else free}/{total}" + (f" {models}" if models else "") if total else "-"
    cpus, mem = cap.get("cpus"), cap.get("memory_mb")
    size = f"{cpus}/{mem / 1024:.0f}G" if isinstance(cpus, int) and isinstance(mem, (int, float)) else "-"
    return [gpus, size]


@click.command("ls")
@connection_options
@click.option("--queue", default=None, help="Only this queue.")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(STATES),
    help="Only these states (repeatable).",
)
@click.option("--since", default=None, help="Submitted since: 10m, 2h, 1d, an ISO date-time or epoch s.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 500))
@click.option("--cursor", default=None, help="Continue a listing: the id printed after the last page.")
@click.option("--sweep", default=None, help="Only the calls of one map (the sweep id `show` prints).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON ({invocations, next_cursor}).")
@_raw_option
@guarded
def ls(
    url: str | None,
    token: str | None,
    queue: str | None,
    states: tuple[str, ...],
    since: str | None,
    limit: int,
    cursor: str | None,
    sweep: str | None,
    as_json: bool,
    raw: bool,
) -> None:
    """Invocations, newest first."""
    with _client(url, token) as client:
        page = client.invocations(
            queue=queue,
            states=list(states) or None,
            since=parse_since(since),
            limit=limit,
            cursor=cursor,
            sweep=sweep,
        )
    if as_json:
        _echo_json(page)
        return
    rows = [
        [
            i["invocation_id"],
            i["queue"],
            i["state"],
            attempt_label(i),
            when(i["submitted_at"]),
            duration(i["started_at"], i["finished_at"]),
            (f"{i['error']['type']}: {i['error']['message']}"[:80] if i["error"] else ""),
        ]
        for i in page["invocations"]
    ]
    _echo(table(["INVOCATION", "QUEUE", "STATE", "ATTEMPT", "SUBMITTED", "RAN", "ERROR"], rows), raw=raw)
    if page.get("next_cursor"):
        click.echo(f"more: lakeshore ls --cursor {page['next_cursor']}", err=True)


@click.command()
@connection_options
@click.argument("invocation_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_raw_option
@guarded
def show(url: str | None, token: str | None, invocation_id: str, as_json: bool, raw: bool) -> None:
    """One invocation: status, attempts and their outcomes, timings, children, error with traceback."""
    with _client(url, token) as client:
        d = client.invocation(invocation_id)
    if as_json:
        _echo_json(d)
        return
    fn = d.get("function") or {}
    t = d["timings"]
    frames = d["frames"]
    lines = [
        f"invocation  {d['invocation_id']}",
        f"state       {d['state']}" + ("  (cancel requested)" if d["cancel_requested"] and not d["terminal"] else ""),
        f"queue       {d['queue']}   namespace {d['namespace']}   priority {d['priority']}",
        f"function    {function_line(fn)}",
        f"submitted   {when(d['submitted_at'])}",
        f"started     {when(d['started_at'])}   (waited {age(t['wait_s']) if t['wait_s'] is not None else '-'})",
        f"finished    {when(d['finished_at'])}   (ran {duration(d['started_at'], d['finished_at'])})",
        f"worker      {d['worker_id'] or '-'}",
        f"frames      {frames['count']}" + (f" (last seq {frames['last_seq']})" if frames["count"] else ""),
        f"attempts    {attempt_label(d, long=True)}",
        *([f"waits       {d['waiting']['message']}"] if d.get("waiting") else []),  # a queued call: why
        *([f"sweep       {sweep}  (lakeshore ls --sweep {sweep})"] if (sweep := _sweep_of(d)) else []),
    ]  # fmt: skip
    for a in d["attempts"]:
        where = f" on {a['worker_id']}" if a["worker_id"] else ""
        span = f", {when(a['started_at'])} .. {when(a['finished_at'])}" if a["started_at"] else ""
        why = f" ({a['error']['type']}: {a['error']['message']})" if a.get("error") else ""
        retried = f", retried at {when(a['retry_at'])}" if a.get("retry_at") else ""
        lines.append(f"  #{a['attempt']}: {a['outcome']}{why}{where}{span}{retried}")
    if d.get("parent_invocation_id"):
        lines.append(f"parent      {d['parent_invocation_id']} (root {d['root_invocation_id']})")
    children = d.get("children") or []
    if children:
        counts: dict[str, int] = {}
        for child in children:
            counts[child["state"]] = counts.get(child["state"], 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        lines.append(f"children    {len(children)} ({summary})")
        lines += [f"  {c['invocation_id']}  {c['state']}" for c in children]
    error = d.get("error")
    if error:
        lines.append(f"error       {error.get('type')}: {error.get('message')}")
        if error.get("traceback"):
            lines.append("traceback:")
            lines += ["  " + line for line in str(error["traceback"]).rstrip().splitlines()]
    _echo("\n".join(lines), raw=raw)


@click.command()
@connection_options
@click.argument("invocation_ids", nargs=-1, required=True)
@guarded
def cancel(url: str | None, token: str | None, invocation_ids: tuple[str, ...]) -> None:
    """Cancel invocations: a queued one at once, a running one at its worker's next heartbeat."""
    failed = 0
    with _client(url, token) as client:
        for inv in invocation_ids:
            try:
                click.echo(f"{inv}  {client.cancel(inv)}")
            except (LakeshoreError, ValueError) as exc:
                failed += 1
                click.echo(f"{inv}  error: {exc}", err=True)
    if failed:
        sys.exit(1)


def _frame_json(frame: Frame) -> dict[str, Any]:
    from dreamlake.lakeshore import wire

    kinds = {
        wire.FRAME_VALUE: "value",
        wire.FRAME_END: "end",
        wire.FRAME_ERROR: "error",
        wire.FRAME_LOG: "log",
    }
    out: dict[str, Any] = {"seq": frame.seq, "kind": kinds.get(frame.kind, str(frame.kind))}
    if frame.kind == wire.FRAME_LOG:
        out["text"] = bytes(frame.body).decode("utf-8", "replace") if isinstance(frame.body, bytes) else None
    elif isinstance(frame.body, bytes) and frame.body:
        out["value"] = _jsonable(wire.unpack(frame.body))
    elif isinstance(frame.body, dict):
        out["value"] = _jsonable(frame.body)
    if frame.meta:
        out["meta"] = _jsonable(frame.meta)
    return out


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


@click.command()
@connection_options
@click.argument("invocation_id")
@click.option(
    "--since", default=-1, show_default=True, type=click.IntRange(min=-1), help="Frames after this seq."
)
@click.option("--timeout", default=30.0, show_default=True, type=float, help="Seconds of silence to wait.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per frame.")
@_raw_option
@guarded
def stream(
    url: str | None,
    token: str | None,
    invocation_id: str,
    since: int,
    timeout: float,
    as_json: bool,
    raw: bool,
) -> None:
    """Follow an invocation's frames (the values it yields), from --since, until it ends."""
    with _plane(url, token) as plane:
        try:
            for frame in plane.frames(invocation_id, since, timeout=timeout):
                f = _frame_json(frame)
                if as_json:
                    click.echo(json.dumps(f, sort_keys=True))
                    continue
                shown = f.get("text", f.get("value", ""))
                _echo(
                    f"{f['seq']:>6}  {f['kind']:<5}  {shown!r}"
                    if shown != ""
                    else f"{f['seq']:>6}  {f['kind']}",
                    raw=raw,
                )
        except TimeoutError as exc:
            _fail(exc)


@click.command()
@connection_options
@click.argument("invocation_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output until the invocation ends.")
@_raw_option
@guarded
def logs(url: str | None, token: str | None, invocation_id: str, follow: bool, raw: bool) -> None:
    """An invocation's stdout and stderr (stderr lines go to stderr), while it runs and after it
    ended; with -f, follow it until it ends. On a terminal, control sequences the task printed are
    shown escaped (\\x1b...); --raw writes them as they are."""
    from dreamlake.lakeshore.queue import log_chunks

    with _plane(url, token) as plane:
        for chunk in log_chunks(plane, invocation_id, follow=follow):
            out = sys.stderr if chunk.stream == "stderr" else sys.stdout
            out.write(for_terminal(chunk.text, out, raw=raw))
            out.flush()


COMMANDS = (queues, workers, ls, show, cancel, stream, logs)
