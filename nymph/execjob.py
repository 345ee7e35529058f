"""Namespace exec jobs (seed 003, flows 1-4): a shell command with an optional payload.

A poll answer may carry ``{"kind": "exec", "body": {exec_id, namespace, command, payload_inline,
payload_ref, timeout_s, attempt}}``. nymph runs it in a slot, through its runner like a ``script``
invocation (so the runner's isolation applies), and publishes ``{exec_id, worker_id, attempt,
exit_code, stdout, stderr}`` to ``POST /v1/namespaces/:ns/jobs/:exec_id/result`` through the
durable outbox (the control plane takes it only from the worker of the latest claim):

1. the payload: ``payload_inline`` bytes as they are, or ``payload_ref`` fetched through a presigned
   GET (``POST /v1/namespaces/:ns/payloads/presign {"op": "get", "key"}``, 60 s fetch timeout); when
   the ref carries ``sha256`` the bytes are verified, and a mismatch publishes exit code -1 with
   ``payload corrupt: sha256 mismatch (expected …, got …)`` and never spawns the command;
Exec jobs are an opt-in: only a nymph started with ``--allow-exec`` (``allow_exec``) claims them (its
poll asks for ``kinds: ["run", "exec"]``, every other nymph's for ``["run"]``), and one that reaches
a nymph without it anyway is refused (exit code -1, ``exec jobs are refused ...``) before anything
runs.

2. ``{workdir}/exec/{exec_id}/`` (0700) holds ``exec.json`` ({exec_id, namespace, attempt}),
   ``payload.msgpack`` (when there is a payload) and the runner's ``handle.json``; the
   command runs as ``bash -c COMMAND`` as nymph's user, or its task user when nymph runs as root
   (:mod:`nymph.taskuser`; the directory is handed to that user, and nymph's own files in it are
   read and written through :mod:`nymph.safeio`), with that directory as cwd and ``LAKESHORE_EXEC_ID``,
   ``LAKESHORE_NAMESPACE`` and ``LAKESHORE_PAYLOAD`` (``payload.msgpack`` or empty) set;
3. stdout and stderr (their last :data:`OUTPUT_LIMIT` bytes each, decoded as UTF-8) and the exit
   code are published, with a typed result when the command left one (seed 003's "not wired yet",
   wired): ``LAKESHORE_RESULT`` names ``result.msgpack`` in its cwd; a command that writes that file
   (msgpack, decoded with the SDK's codec to check it), or ``result.json`` beside it (JSON, packed
   to msgpack here), gets it back as ``resultInline`` (base64 msgpack, up to the control plane's
   inline threshold) or ``resultRef`` (uploaded to the payload store, checked by sha256 on the way
   back); a result that does not decode, or is over :data:`RESULT_LIMIT`, is dropped with a line on
   stderr saying why (the exit code stands); before that, each stream is uploaded whole to the exec
   output archive (``PUT .../jobs/:id/output/:stream``, server/execout.py); a command past ``timeout_s`` is stopped with the cancellation ladder and
   published with exit code 124 (the ``timeout(1)`` convention) and a note on stderr; a command
   stopped by a nymph shutdown is published with exit code -1 and a note.

:class:`ExecJob` is the exec job's side of the supervised lifecycle (:mod:`nymph.lifecycle`):
cancel, lost leases, the timeout, retrying while the runner is unavailable (the agent stops
claiming meanwhile) and the exception guard are the same as an invocation's. A job refused before
it runs (a bad id, namespace or ``timeout_s``, no command, a payload that cannot be had) publishes
exit code -1 with the reason on stderr, and so does one nymph failed to run (``nymph failed: ...``).

An exec job holds a lease like an invocation: the heartbeat reports it in ``running_exec``
(:attr:`ExecJob.running_entry`) and renews it; a job the heartbeat answers as ``lost`` (another
claim took it) is stopped and publishes nothing; a new claim of a job still running here (the
lease had lapsed) is adopted (:meth:`ExecJob.adopt`). If nymph dies while one runs and does not
come back, its lease lapses and the control plane requeues it; if it comes back, the next start
stops what is left of it and publishes exit code -1 (see :func:`recover_execs`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from dreamlake.lakeshore import ids, wire
from dreamlake.lakeshore.errors import InvalidId, LakeshoreError, PlaneError
from dreamlake.lakeshore.protocol import routes
from dreamlake.lakeshore.protocol.limits import by_reference
from nymph import refs, safeio, taskuser
from nymph.client import ControlPlaneClient
from nymph.errors import JobRefused, PayloadError
from nymph.lifecycle import JobContext, Stop, SupervisedJob
from nymph.outbox import Outbox
from nymph.runner import Handle, Runner, RunnerError, Task
from nymph.workdir import STDERR, STDOUT, hand_over, tail

__all__ = ["ExecJob", "ExecResult", "PayloadError", "fetch_payload", "recover_execs", "verify_sha256"]

log = logging.getLogger(__name__)

EXEC_DIR = "exec"
PAYLOAD = "payload.msgpack"
META = "exec.json"
OUTPUT_LIMIT = 1 << 20
RESULT = "result.msgpack"  # $LAKESHORE_RESULT: a typed result, msgpack ...
RESULT_JSON = "result.json"  # ... or JSON
RESULT_LIMIT = 100 << 20  # the payload store's MAX_PAYLOAD_BYTES
ARCHIVE_LIMIT = 100 << 20  # the end of a longer output is archived (MAX_PAYLOAD_BYTES)
EXIT_TIMEOUT = 124
EXIT_NOT_RUN = -1
FETCH_TIMEOUT_S = 60.0
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,128}")  # the control plane's name rule (docs/protocol.md)


class ExecResult(NamedTuple):
    """What an exec job publishes besides who claimed it (``result``: the typed result's msgpack)."""

    exit_code: int
    stdout: str
    stderr: str
    result: bytes | None = None


def valid_namespace(namespace: str) -> bool:
    """A name that is safe as one path segment of a route: ``[A-Za-z0-9._-]{1,128}``, not ``.``/``..``."""
    return bool(_NAMESPACE.fullmatch(namespace)) and namespace not in (".", "..")


def result_route(namespace: str, exec_id: str) -> str:
    return routes.job_result(namespace, exec_id)


def verify_sha256(data: bytes, expected: str | None) -> None:
    """Raise PayloadError with the seed's text when ``data`` does not hash to ``expected``."""
    if not expected:
        return
    got = hashlib.sha256(data).hexdigest()
    if got != expected.lower():
        raise PayloadError(f"payload corrupt: sha256 mismatch (expected {expected}, got {got})")


def fetch_payload(client: ControlPlaneClient, namespace: str, ref: dict[str, Any]) -> bytes:
    """Flow 3: presign a GET for ``ref['key']``, download it, verify ``ref['sha256']`` if present."""
    key = str(ref.get("key") or "")
    try:
        answer = client.call_json(routes.presign(namespace), {"op": "get", "key": key})
        url = str(answer.get("url") or "")
        if not url:
            raise PayloadError(f"payload {key!r}: the control plane minted no URL")
        data = client.fetch(url, timeout_s=FETCH_TIMEOUT_S)
    except PlaneError as exc:
        raise PayloadError(f"payload {key!r} could not be fetched: {exc}") from exc
    verify_sha256(data, ref.get("sha256"))
    return data


def _tail_text(path: Path) -> str:
    return tail(path, OUTPUT_LIMIT)


class ExecJob(SupervisedJob[ExecResult]):
    """One exec job in a thread of its own: the exec job's steps of the supervised lifecycle."""

    kind: ClassVar[str] = "exec"
    id_field: ClassVar[str] = "exec_id"
    timeout_field: ClassVar[str] = "timeout_s"

    def __init__(self, ctx: JobContext, body: dict[str, Any]) -> None:
        attempt = body.get("attempt")
        super().__init__(
            ctx,
            str(body.get("exec_id") or ""),
            # None: a control plane from before exec leases (no attempt, nothing to renew)
            attempt if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt > 0 else None,
            body.get("timeout_s"),
        )
        self.body = body
        self.exec_id = self.job_id
        self.namespace = str(body.get("namespace") or "")
        self.command = str(body.get("command") or "")

    def adopt(self, attempt: Any) -> bool:
        """A newer claim of this job reached this worker while it still runs here (its lease had
        lapsed and the control plane handed it out again, to us): keep running, and renew and
        publish under the newer attempt. True when adopted."""
        if not isinstance(attempt, int) or isinstance(attempt, bool) or self.lost:
            return False
        if self.attempt is None or attempt <= self.attempt:
            return False
        log.warning(
            "exec %s: claimed again (attempt %d) while attempt %d runs here; adopted",
            self.exec_id,
            attempt,
            self.attempt,
        )
        self.attempt = attempt
        return True

    # --- the steps -----------------------------------------------------------------------------

    def prepare(self) -> Task:
        try:
            ids.validate(self.exec_id, "exec_id")  # before the id becomes a path
        except InvalidId as exc:
            self.namespace = ""  # nowhere valid to publish to
            raise JobRefused("InvalidId", str(exc)) from exc
        if not valid_namespace(self.namespace):
            log.error("exec %s refused: invalid namespace %r", self.exec_id, self.namespace[:200])
            self.namespace = ""  # it would become a path segment of the result route
            raise JobRefused("InvalidNamespace", "invalid namespace")
        if self.bad_timeout:
            raise JobRefused("InvalidTimeout", self.bad_timeout)
        if not self.command:
            raise JobRefused("NoCommand", "exec job without a command")
        cfg = self.ctx.config
        if not cfg.allow_exec:  # never claimed without the flag (the poll asks for runs only)
            raise JobRefused(
                "ExecRefused",
                "exec jobs are refused: this nymph runs only invocations; start it with --allow-exec "
                "to run namespace exec jobs (that is running any shell command its producers send)",
            )
        try:  # nymph's own user, or (nymph is root) a pool user of its own, or the shared task user
            run_as = taskuser.task_users(cfg).acquire(self)
        except taskuser.TaskUserError as exc:
            raise JobRefused("TaskUserPoolExhausted", str(exc)) from None
        payload = self._payload()
        workdir = cfg.workdir / EXEC_DIR / self.exec_id
        workdir.parent.mkdir(mode=0o711, exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(mode=0o700)
        self.workdir = workdir
        # written while the directory is nymph's alone, then handed to the user the command runs as
        if payload is not None:
            safeio.write_file(workdir, PAYLOAD, payload)
        meta = {"exec_id": self.exec_id, "namespace": self.namespace, "attempt": self.attempt}
        safeio.write_file(workdir, META, json.dumps(meta).encode())
        for name in (STDOUT, STDERR):
            safeio.write_file(workdir, name, b"", 0o644)
        try:
            hand_over(workdir, run_as, (PAYLOAD, STDOUT, STDERR) if payload is not None else (STDOUT, STDERR))
        except KeyError:
            raise JobRefused(
                "TaskUserMissing",
                f"task user {run_as!r} is not a user on this host (any more); create it with "
                f"`{taskuser.useradd_command(str(run_as))}`",
            ) from None
        env = {
            "LAKESHORE_EXEC_ID": self.exec_id,
            "LAKESHORE_NAMESPACE": self.namespace,
            "LAKESHORE_PAYLOAD": PAYLOAD if payload is not None else "",
            "LAKESHORE_RESULT": RESULT,
        }
        return Task(
            invocation_id=self.exec_id,
            attempt=self.attempt or 1,
            workdir=workdir,
            env=env,
            script=self.command,
            as_user=run_as,
            namespace=self.namespace,
            labels={
                "nymph.exec": self.exec_id,
                "nymph.namespace": self.namespace,
                "nymph.invocation": self.exec_id,  # like a run's task: start-up cleanup finds it
                "nymph.worker": self.ctx.worker_id,
            },
        )

    def _payload(self) -> bytes | None:
        inline = self.body.get("payload_inline")
        if inline is not None:
            return bytes(inline)
        ref = self.body.get("payload_ref")
        if not ref:
            return None
        if self.ctx.client is None:
            raise PayloadError("payload_ref given, but this nymph has no control-plane client to fetch it")
        return fetch_payload(self.ctx.client, self.namespace, dict(ref))

    def supervise(self, handle: Handle) -> ExecResult:
        ending = self.wait_or_stop(handle)
        if isinstance(ending, Stop):
            return self.stopped(ending)
        return self._result(ending.exit_code, "")

    def _result(self, exit_code: int, note: str) -> ExecResult:
        """The exit code with the task's output tails and its typed result (and ``note`` appended
        to stderr)."""
        stdout = stderr = ""
        result = None
        if self.workdir is not None:
            stdout, stderr = _tail_text(self.workdir / STDOUT), _tail_text(self.workdir / STDERR)
            result, why = typed_result(self.workdir)
            note = "; ".join(n for n in (note, why) if n)
        if note:
            stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + f"nymph: {note}\n"
        return ExecResult(exit_code, stdout, stderr, result)

    # --- outcomes ------------------------------------------------------------------------------

    def failure(self, type_: str, message: str) -> ExecResult:
        return ExecResult(EXIT_NOT_RUN, "", message)

    def start_refused(self, exc: RunnerError) -> ExecResult:
        return self.failure(
            type(exc).__name__, f"runner {self.ctx.runner.name!r} could not start the command: {exc}"
        )

    def stopped(self, stop: Stop) -> ExecResult:
        return self._result(EXIT_TIMEOUT if stop.reason == "timeout" else EXIT_NOT_RUN, stop.message)

    def settle(self, outcome: ExecResult) -> None:
        """Archive the full output and publish the result through the outbox (unless lost), then
        remove the workdir."""
        try:
            note = self._archive()
            if note:
                outcome = outcome._replace(stderr=outcome.stderr + f"nymph: {note}\n")
            self.publish(*outcome)
        finally:
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def publish(self, exit_code: int, stdout: str, stderr: str, result: bytes | None = None) -> None:
        if self.lost:
            log.warning("exec %s: lease lost to another claim; its result is not published", self.exec_id)
            return
        if self.namespace and self.exec_id:
            body = result_body(self.exec_id, self.ctx.worker_id, self.attempt, exit_code, stdout, stderr)
            if result is not None:
                self._add_typed(body, result)
            self.ctx.outbox.put(result_route(self.namespace, self.exec_id), body)
        log.info(
            "exec %s: done namespace=%s exit_code=%d duration=%.3fs",
            self.exec_id,
            self.namespace,
            exit_code,
            time.time() - self.started_at,
        )

    def _archive(self) -> str:
        """Upload the whole stdout and stderr to the exec output archive (server/execout.py): the
        last :data:`ARCHIVE_LIMIT` bytes of each; what could not be archived, as a note ("": all)."""
        client, workdir = self.ctx.client, self.workdir
        if client is None or workdir is None or self.lost or not (self.namespace and self.exec_id):
            return ""
        notes = []
        for name, stream in ((STDOUT, "stdout"), (STDERR, "stderr")):
            fh = safeio.open_output(workdir, name)
            if fh is None:
                continue
            with fh:
                size = os.fstat(fh.fileno()).st_size
                if size > ARCHIVE_LIMIT:
                    fh.seek(size - ARCHIVE_LIMIT)
                    notes.append(
                        f"{stream} archived from byte {size - ARCHIVE_LIMIT} of {size} (its last {ARCHIVE_LIMIT})"
                    )
                    size = ARCHIVE_LIMIT
                if size == 0:
                    continue
                route = routes.job_output(self.namespace, self.exec_id, stream)
                params = {"worker_id": self.ctx.worker_id, "attempt": self.attempt or 0}
                try:
                    client.put_file(route, fh, size, params=params)
                except PlaneError as exc:
                    if exc.status == 501:  # the control plane keeps no archive (no payload store)
                        return ""
                    log.warning("exec %s: %s not archived: %s", self.exec_id, stream, exc)
                    notes.append(f"{stream} not archived: {exc}")
        return "; ".join(notes)

    def _add_typed(self, body: dict[str, Any], result: bytes) -> None:
        """``resultInline`` (base64) within the inline threshold, else ``resultRef`` (uploaded);
        an upload that fails leaves a line on stderr instead."""
        if not by_reference(len(result), self.ctx.inline_threshold):
            body["resultInline"] = base64.b64encode(result).decode("ascii")
            return
        try:
            body["resultRef"] = refs.ship(self.ctx.client, self.namespace, self.exec_id, result, "result")
        except LakeshoreError as exc:
            log.warning("exec %s: typed result upload failed: %s", self.exec_id, exc)
            body["stderr"] += f"nymph: the typed result ({len(result)} bytes) could not be uploaded: {exc}\n"


def typed_result(workdir: Path) -> tuple[bytes | None, str]:
    """The typed result the command left in ``workdir`` as msgpack (None when none), and why one
    was dropped ("" when not): ``result.msgpack`` checked to decode, or ``result.json`` packed."""
    for name in (RESULT, RESULT_JSON):
        data, size = safeio.read_output_within(workdir, name, RESULT_LIMIT)
        if data is None and size <= RESULT_LIMIT:
            continue  # not there (or not the command's own regular file)
        if data is None:
            return (
                None,
                f"{name} is {size} bytes, over the {RESULT_LIMIT}-byte limit of a typed result; dropped",
            )
        try:
            if name == RESULT_JSON:
                return wire.pack(json.loads(data)), ""
            wire.unpack(data)
            return bytes(data), ""
        except (ValueError, TypeError, LakeshoreError) as exc:
            return None, f"{name} does not decode ({exc}); dropped"
    return None, ""


def result_body(
    exec_id: str, worker_id: str, attempt: int | None, exit_code: int, stdout: str, stderr: str
) -> dict[str, Any]:
    """The body of a result publish: who claimed it (``worker_id``, ``attempt``) and the outcome."""
    body: dict[str, Any] = {"exec_id": exec_id, "exit_code": exit_code, "stdout": stdout, "stderr": stderr}
    if worker_id:
        body["worker_id"] = worker_id
    if attempt is not None:
        body["attempt"] = attempt
    return body


def recover_execs(root: Path, runner: Runner, outbox: Outbox, worker_id: str = "") -> int:
    """Stop what a previous life's exec jobs left running and publish exit code -1 for each (as
    ``worker_id``, the claimer: refused if the job was requeued and claimed again meanwhile)."""
    base = root / EXEC_DIR
    count = 0
    try:
        leftovers = sorted(p for p in base.iterdir() if p.is_dir() and ids.is_ulid(p.name))
    except FileNotFoundError:
        return 0
    for path in leftovers:
        handle = Handle.load(path)
        if handle is not None and handle.runner == runner.name:
            try:
                runner.stop(handle, 0.0)
                runner.destroy(handle)
            except RunnerError as exc:
                log.warning("exec %s: could not stop the leftover command: %s", path.name, exc)
        try:
            meta = json.loads(safeio.read_own(path, META) or b"")  # nymph's own, never the command's
            namespace = str(meta.get("namespace") or "")
            attempt = meta.get("attempt")
        except (ValueError, AttributeError):
            namespace, attempt = "", None
        if namespace:
            outbox.put(
                result_route(namespace, path.name),
                result_body(
                    path.name,
                    worker_id,
                    attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None,
                    EXIT_NOT_RUN,
                    _tail_text(path / STDOUT),
                    _tail_text(path / STDERR) + "nymph: restarted while the command ran\n",
                ),
            )
        log.warning("exec %s: left by a previous run; stopped and reported", path.name)
        shutil.rmtree(path, ignore_errors=True)
        count += 1
    return count
