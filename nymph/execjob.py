"""Namespace exec jobs (seed 003, flows 1-4): a shell command with an optional payload.

A poll answer may carry ``{"kind": "exec", "body": {exec_id, namespace, command, payload_inline,
payload_ref, timeout_s}}``. nymph runs it in a slot, through its runner like a ``script``
invocation (so the runner's isolation applies), and publishes ``{exit_code, stdout, stderr}`` to
``POST /v1/namespaces/:ns/jobs/:exec_id/result`` through the durable outbox:

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

An exec job has no lease and no attempt: if nymph dies while one runs, the next start stops what
is left of it and publishes exit code -1 (see :func:`recover_execs`).
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
    ) -> None:
        self.body = body
        self.exec_id = str(body.get("exec_id") or "")
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
        if self.namespace and self.exec_id:
            self._outbox.put(
                result_route(self.namespace, self.exec_id),
                {"exec_id": self.exec_id, "exit_code": exit_code, "stdout": stdout, "stderr": stderr},
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
        (workdir / META).write_text(json.dumps({"exec_id": self.exec_id, "namespace": self.namespace}))
        env = {
            "LAKESHORE_EXEC_ID": self.exec_id,
            "LAKESHORE_NAMESPACE": self.namespace,
            "LAKESHORE_PAYLOAD": PAYLOAD if payload is not None else "",
        }
        task = Task(
            invocation_id=self.exec_id,
            attempt=1,
            workdir=workdir,
            env=env,
            script=self.command,
            labels={"nymph.exec": self.exec_id, "nymph.namespace": self.namespace},
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


def recover_execs(root: Path, runner: Runner, outbox: Outbox) -> int:
    """Stop what a previous life's exec jobs left running and publish exit code -1 for each."""
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
            namespace = str(json.loads((path / META).read_text()).get("namespace") or "")
        except (OSError, ValueError, AttributeError):
            namespace = ""
        if namespace:
            outbox.put(
                result_route(namespace, path.name),
                {
                    "exec_id": path.name,
                    "exit_code": EXIT_NOT_RUN,
                    "stdout": _tail_text(path / STDOUT),
                    "stderr": _tail_text(path / STDERR) + "nymph: restarted while the command ran\n",
                },
            )
        log.warning("exec %s: left by a previous run; stopped and reported", path.name)
        shutil.rmtree(path, ignore_errors=True)
        count += 1
    return count
