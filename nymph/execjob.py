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
2. ``{workdir}/exec/{exec_id}/`` (0700) holds ``exec.json`` ({exec_id, namespace}),
   ``payload.msgpack`` (when there is a payload) and the runner's ``handle.json``; the
   command runs as ``bash -c COMMAND`` with that directory as cwd and ``LAKESHORE_EXEC_ID``,
   ``LAKESHORE_NAMESPACE`` and ``LAKESHORE_PAYLOAD`` (``payload.msgpack`` or empty) set;
3. stdout and stderr (their last :data:`OUTPUT_LIMIT` bytes each, decoded as UTF-8) and the exit
   code are published; a command past ``timeout_s`` is stopped with the cancellation ladder and
   published with exit code 124 (the ``timeout(1)`` convention) and a note on stderr; a command
   stopped by a nymph shutdown is published with exit code -1 and a note.

An exec job holds a lease like an invocation: the heartbeat reports it in ``running_exec``
(:attr:`ExecJob.running_entry`) and renews it; a job the heartbeat answers as ``lost`` (another
claim took it) is stopped and publishes nothing; a new claim of a job still running here (the
lease had lapsed) is adopted (:meth:`ExecJob.adopt`). If nymph dies while one runs and does not
come back, its lease lapses and the control plane requeues it; if it comes back, the next start
stops what is left of it and publishes exit code -1 (see :func:`recover_execs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import InvalidId
from nymph.client import ClientError, ControlPlaneClient
from nymph.job import backoff_s
from nymph.outbox import Outbox
from nymph.runner import ExitStatus, Handle, Runner, RunnerError, RunnerUnavailable, Task
from nymph.workdir import STDERR, STDOUT, tail

log = logging.getLogger(__name__)

EXEC_DIR = "exec"
PAYLOAD = "payload.msgpack"
META = "exec.json"
OUTPUT_LIMIT = 1 << 20
EXIT_TIMEOUT = 124
EXIT_NOT_RUN = -1
FETCH_TIMEOUT_S = 60.0
_WAIT_STEP_S = 0.2
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,128}")  # the control plane's name rule (docs/protocol.md)


class PayloadError(Exception):
    """The payload could not be obtained or failed verification; nothing is spawned."""


def valid_namespace(namespace: str) -> bool:
    """A name that is safe as one path segment of a route: ``[A-Za-z0-9._-]{1,128}``, not ``.``/``..``."""
    return bool(_NAMESPACE.fullmatch(namespace)) and namespace not in (".", "..")


def result_route(namespace: str, exec_id: str) -> str:
    return f"/v1/namespaces/{namespace}/jobs/{exec_id}/result"


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
        answer = client.call_json(f"/v1/namespaces/{namespace}/payloads/presign", {"op": "get", "key": key})
        url = str(answer.get("url") or "")
        if not url:
            raise PayloadError(f"payload {key!r}: the control plane minted no URL")
        data = client.fetch(url, timeout_s=FETCH_TIMEOUT_S)
    except ClientError as exc:
        raise PayloadError(f"payload {key!r} could not be fetched: {exc}") from exc
    verify_sha256(data, ref.get("sha256"))
    return data


def _tail_text(path: Path) -> str:
    return tail(path, OUTPUT_LIMIT)


class ExecJob:
    """One exec job in a thread of its own; ``on_done`` frees its slot."""

    def __init__(
        self,
        body: dict[str, Any],
        *,
        runner: Runner,
        client: ControlPlaneClient,
        outbox: Outbox,
        root: Path,
        stop_grace_s: float,
        on_done: Callable[[ExecJob], None],
        worker_id: str = "",
    ) -> None:
        self.body = body
        self.worker_id = worker_id
        self.exec_id = str(body.get("exec_id") or "")
        attempt = body.get("attempt")
        # None: a control plane from before exec leases (no attempt, nothing to renew)
        self.attempt: int | None = (
            attempt if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt > 0 else None
        )
        self._lost = False
        self.invocation_id = self.exec_id  # the agent's job bookkeeping is keyed by this
        self.namespace = str(body.get("namespace") or "")
        self.command = str(body.get("command") or "")
        timeout = body.get("timeout_s")
        try:
            self.timeout_s = float(timeout) if timeout not in (None, "", 0) else None
        except (TypeError, ValueError):
            self.timeout_s = None
            self._bad_timeout: str | None = f"bad timeout_s {timeout!r}: expected a number of seconds"
        else:
            self._bad_timeout = None
        self._runner = runner
        self._client = client
        self._outbox = outbox
        self._root = root
        self._stop_grace_s = stop_grace_s
        self._on_done = on_done
        self._stop: tuple[str, float] | None = None
        self._thread: threading.Thread | None = None
        self.started_at = time.time()

    # --- control from other threads ------------------------------------------------------------

    def cancel(self, message: str = "cancelled", grace_s: float | None = None) -> None:
        if self._stop is None:
            self._stop = (message, self._stop_grace_s if grace_s is None else grace_s)

    @property
    def running_entry(self) -> dict[str, Any] | None:
        """This job's ``running_exec`` entry of a heartbeat; None without an attempt to renew."""
        if self.attempt is None or not self.exec_id:
            return None
        return {"exec_id": self.exec_id, "attempt": self.attempt}

    def adopt(self, attempt: Any) -> bool:
        """A newer claim of this job reached this worker while it still runs here (its lease had
        lapsed and the control plane handed it out again, to us): keep running, and renew and
        publish under the newer attempt. True when adopted."""
        if not isinstance(attempt, int) or isinstance(attempt, bool) or self._lost:
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

    def lose(self) -> None:
        """Another claim owns the job now: stop the command, publish nothing (it would be refused)."""
        self._lost = True
        self.cancel("lease lost to another claim", 0.0)

    def _start_when_available(self, task: Task) -> Handle | str:
        """``runner.start``, retried with backoff while the runner is unavailable (engine down);
        a refusal, or a stop while waiting, comes back as the message to report."""
        tries = 0
        while True:
            try:
                return self._runner.start(task)
            except RunnerUnavailable as exc:
                delay = backoff_s(tries)
                tries += 1
                log.warning(
                    "exec %s: runner %s unavailable (try %d), retrying in %.1fs: %s",
                    self.exec_id, self._runner.name, tries, delay, exc,
                )  # fmt: skip
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline:
                    if self._stop is not None:
                        return f"stopped before it started ({self._stop[0]}): runner unavailable: {exc}"
                    time.sleep(0.1)
            except RunnerError as exc:
                return f"runner {self._runner.name!r} could not start the command: {exc}"

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"nymph-exec-{self.exec_id}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the job -------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            exit_code, stdout, stderr = self._run()
        except Exception as exc:  # never leave a claimed exec job without a result
            log.exception("exec %s: nymph failed while running it", self.exec_id)
            exit_code, stdout, stderr = EXIT_NOT_RUN, "", f"nymph failed: {type(exc).__name__}: {exc}"
        try:
            self.publish(exit_code, stdout, stderr)
        finally:
            self._on_done(self)

    def publish(self, exit_code: int, stdout: str, stderr: str) -> None:
        if self._lost:
            log.warning("exec %s: lease lost to another claim; its result is not published", self.exec_id)
            return
        if self.namespace and self.exec_id:
            self._outbox.put(
                result_route(self.namespace, self.exec_id),
                result_body(self.exec_id, self.worker_id, self.attempt, exit_code, stdout, stderr),
            )
        log.info(
            "exec %s: done namespace=%s exit_code=%d duration=%.3fs",
            self.exec_id,
            self.namespace,
            exit_code,
            time.time() - self.started_at,
        )

    def _run(self) -> tuple[int, str, str]:
        try:
            ids.validate(self.exec_id, "exec_id")  # before the id becomes a path
        except InvalidId as exc:
            log.error("exec command refused: %s", exc)
            self.namespace = ""  # nowhere valid to publish to
            return EXIT_NOT_RUN, "", str(exc)
        if not valid_namespace(self.namespace):
            log.error("exec %s refused: invalid namespace %r", self.exec_id, self.namespace[:200])
            self.namespace = ""  # it would become a path segment of the result route
            return EXIT_NOT_RUN, "", "invalid namespace"
        if self._bad_timeout:
            return EXIT_NOT_RUN, "", self._bad_timeout
        if not self.command:
            return EXIT_NOT_RUN, "", "exec job without a command"
        try:
            payload = self._payload()
        except PayloadError as exc:
            log.warning("exec %s: %s; not run", self.exec_id, exc)
            return EXIT_NOT_RUN, "", str(exc)
        workdir = self._root / EXEC_DIR / self.exec_id
        workdir.parent.mkdir(mode=0o700, exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(mode=0o700)
        try:
            return self._spawn(workdir, payload)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _payload(self) -> bytes | None:
        inline = self.body.get("payload_inline")
        if inline is not None:
            return bytes(inline)
        ref = self.body.get("payload_ref")
        if ref:
            return fetch_payload(self._client, self.namespace, dict(ref))
        return None

    def _spawn(self, workdir: Path, payload: bytes | None) -> tuple[int, str, str]:
        if payload is not None:
            (workdir / PAYLOAD).write_bytes(payload)
        meta = {"exec_id": self.exec_id, "namespace": self.namespace, "attempt": self.attempt}
        (workdir / META).write_text(json.dumps(meta))
        env = {
            "LAKESHORE_EXEC_ID": self.exec_id,
            "LAKESHORE_NAMESPACE": self.namespace,
            "LAKESHORE_PAYLOAD": PAYLOAD if payload is not None else "",
        }
        task = Task(
            invocation_id=self.exec_id,
            attempt=self.attempt or 1,
            workdir=workdir,
            env=env,
            script=self.command,
            labels={
                "nymph.exec": self.exec_id,
                "nymph.namespace": self.namespace,
                "nymph.invocation": self.exec_id,  # like a run's task: start-up cleanup finds it
                "nymph.worker": self.worker_id,
            },
        )
        handle = self._start_when_available(task)
        if isinstance(handle, str):
            return EXIT_NOT_RUN, "", handle
        try:
            handle.save(workdir)
            log.info("exec %s: started in namespace %s", self.exec_id, self.namespace)
            code = self._wait(handle)
        finally:  # also when the wait failed: no container, pod or process outlives the exec job
            try:
                self._runner.destroy(handle)
            except RunnerError as exc:
                log.warning("exec %s: destroy failed: %s", self.exec_id, exc)
        note = ""
        if isinstance(code, str):
            note, code_value = code, (EXIT_TIMEOUT if code.startswith("timed out") else EXIT_NOT_RUN)
        else:
            code_value = code
        stderr = _tail_text(workdir / STDERR)
        if note:
            stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + f"nymph: {note}\n"
        return code_value, _tail_text(workdir / STDOUT), stderr

    def _wait(self, handle: Handle) -> int | str:
        """The exit code, or a note saying why the command was stopped."""
        deadline = self.started_at + self.timeout_s if self.timeout_s else None
        while True:
            stop: tuple[str, float] | None = self._stop
            if stop is None and deadline is not None and time.time() >= deadline:
                stop = (f"timed out after {self.timeout_s:g}s", self._stop_grace_s)
            if stop is not None:
                self._runner.stop(handle, stop[1])
                self._runner.wait(handle, 5.0)
                return stop[0]
            status: ExitStatus | None = self._runner.wait(handle, _WAIT_STEP_S)
            if status is not None:
                return status.exit_code


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
            meta = json.loads((path / META).read_text())
            namespace = str(meta.get("namespace") or "")
            attempt = meta.get("attempt")
        except (OSError, ValueError, AttributeError):
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
