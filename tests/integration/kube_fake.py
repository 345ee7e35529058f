"""A small fake Kubernetes API over real HTTP, with a fake kubelet that runs pods as local processes.

The official ``kubernetes`` client talks to it through a kubeconfig (:meth:`KubeFake.kubeconfig`), so
the seam is the API itself, never our code. What it serves (core/v1 pods in known namespaces):

    GET    /version
    GET    /api/v1/namespaces/{ns}/pods            labelSelector (k=v, k!=v, k, !k), limit
    POST   /api/v1/namespaces/{ns}/pods            201; 409 on a duplicate name; 422 on a bad name
    GET    /api/v1/namespaces/{ns}/pods/{name}
    DELETE /api/v1/namespaces/{ns}/pods/{name}     gracePeriodSeconds (query or body)
    GET    /api/v1/namespaces/{ns}/pods/{name}/log container, limitBytes

Objects get a uid, a resourceVersion and a creationTimestamp; errors are ``Status`` objects.

The kubelet: a created pod's one container runs as a local process group, its command with every
hostPath ``mountPath`` prefix translated to the volume's host path (the container's view of its
files), cwd the translated ``workingDir``, the spec's env plus ``PATH``, ``python3`` being the given
interpreter (the "image"). So the workdir contract runs end to end through the hostPath volume. The
status goes Pending -> Running -> Succeeded/Failed with the container's ``terminated`` state
(exitCode, reason Completed/Error/OOMKilled; a signal N as exit code 128+N, as container runtimes
report it). A hostPath whose ``type`` does not match stays Pending (``ContainerCreating``), as a
failed mount does. DELETE with a grace: SIGTERM to the group, SIGKILL after the grace, then the object
goes. Not modelled: scheduling, securityContext (no setuid here), resource limits (use
:meth:`KubeFake.oom_kill`, which SIGKILLs and reports ``OOMKilled`` as the kernel and kubelet would),
watches, other kinds.

Test hooks: ``requests`` (every call: method, path, query, body), ``forbid`` (answer 403),
``lost_answers`` (that many next POSTs are served but their answer is lost: the connection is cut
before it is sent), :meth:`stop` (the API goes away).
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?(/log)?$")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass
class _Run:
    """One pod's container as the fake kubelet runs it."""

    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    oom: bool = False
    deleted: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class KubeFake:
    """The fake API server plus kubelet; ``url`` once started. Use as a context manager."""

    def __init__(self, *, namespaces: set[str], python: str, scratch: Path) -> None:
        self.namespaces = set(namespaces)
        self.python = python
        self.scratch = scratch
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.runs: dict[tuple[str, str], _Run] = {}
        self.requests: list[Call] = []
        self.forbid = False
        self.lost_answers = 0
        self.connections: set[socket.socket] = set()
        self.lock = threading.RLock()
        self._version = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with fake.lock:
                    fake.connections.add(self.connection)

            def finish(self) -> None:
                with fake.lock:
                    fake.connections.discard(self.connection)
                super().finish()

            def _serve(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                query = parse_qs(parts.query)
                with fake.lock:
                    fake.requests.append(Call(self.command, parts.path, query, body))
                code, payload, ctype = fake.handle(self.command, parts.path, query, body)
                with fake.lock:
                    lose = self.command == "POST" and fake.lost_answers > 0
                    fake.lost_answers -= lose
                if lose:  # done, but the client never hears of it
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> KubeFake:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        with self.lock:
            runs = list(self.runs.values())
        for run in runs:
            if run.proc is not None and run.proc.poll() is None:
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait()

    def stop(self) -> None:
        """The API goes away: open connections are cut, new ones refused; running processes stay."""
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            for conn in list(self.connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig (JSON is YAML) pointing at this server with a bearer token."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "nymph", "user": {"token": "fake-token"}}],
            "contexts": [
                {"name": "fake", "context": {"cluster": "fake", "user": "nymph", "namespace": namespace}}
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(doc))
        return path

    # --- test hooks -----------------------------------------------------------------------------

    def calls(self, method: str, suffix: str = "") -> list[Call]:
        with self.lock:
            return [c for c in self.requests if c.method == method and c.path.endswith(suffix)]

    def oom_kill(self, namespace: str, name: str) -> None:
        """What the kernel's OOM killer and the kubelet do: SIGKILL, then reason ``OOMKilled``."""
        with self.lock:
            run = self.runs[(namespace, name)]
            run.oom = True
        assert run.proc is not None
        os.killpg(run.proc.pid, signal.SIGKILL)

    # --- the API --------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any, str]:
        if self.forbid:
            return _status(403, "Forbidden", 'pods is forbidden: User "nymph" cannot do that')
        if path == "/version" and method == "GET":
            return 200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0-fake"}, "application/json"
        match = _POD.match(path)
        if not match:
            return _status(404, "NotFound", f"the server could not find the requested resource ({path})")
        ns, name, is_log = match.group(1), match.group(2), bool(match.group(3))
        if ns not in self.namespaces:
            return _status(404, "NotFound", f'namespaces "{ns}" not found')
        with self.lock:
            if name is None and method == "GET":
                return 200, self._list(ns, query), "application/json"
            if name is None and method == "POST":
                return self._create(ns, body)
            pod = self.pods.get((ns, str(name)))
            if pod is None:
                return _status(404, "NotFound", f'pods "{name}" not found')
            if is_log and method == "GET":
                return self._log(ns, str(name), query)
            if method == "GET":
                return 200, pod, "application/json"
            if method == "DELETE":
                grace = _grace(query, body)
                pod["metadata"]["deletionTimestamp"] = _now()
                pod["metadata"]["deletionGracePeriodSeconds"] = grace
                threading.Thread(target=self._delete, args=(ns, str(name), grace), daemon=True).start()
                return 200, pod, "application/json"
        return _status(405, "MethodNotAllowed", f"{method} {path}")

    def _list(self, ns: str, query: dict[str, list[str]]) -> dict[str, Any]:
        selector = (query.get("labelSelector") or [""])[0]
        items = [p for (n, _), p in sorted(self.pods.items()) if n == ns and _selects(selector, p)]
        limit = int((query.get("limit") or ["0"])[0])
        if limit:
            items = items[:limit]
        return {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self._version)},
            "items": items,
        }

    def _create(self, ns: str, pod: Any) -> tuple[int, Any, str]:
        if not isinstance(pod, dict) or pod.get("kind") != "Pod":
            return _status(400, "BadRequest", "expected a Pod")
        name = str((pod.get("metadata") or {}).get("name", ""))
        if not name or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
            return _status(422, "Invalid", f'Pod "{name}" is invalid: metadata.name: Invalid value')
        if (ns, name) in self.pods:
            return _status(409, "AlreadyExists", f'pods "{name}" already exists')
        self._version += 1
        pod["metadata"].update(
            {
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "resourceVersion": str(self._version),
                "creationTimestamp": _now(),
            }
        )
        pod["status"] = {"phase": "Pending", "conditions": []}
        self.pods[(ns, name)] = pod
        run = _Run()
        self.runs[(ns, name)] = run
        threading.Thread(target=self._kubelet, args=(ns, name, run), daemon=True).start()
        return 201, pod, "application/json"

    def _log(self, ns: str, name: str, query: dict[str, list[str]]) -> tuple[int, Any, str]:
        run = self.runs[(ns, name)]
        if run.log is None:
            return _status(400, "BadRequest", f'container "task" in pod "{name}" is waiting to start')
        data = run.log.read_bytes() if run.log.exists() else b""
        limit = int((query.get("limitBytes") or ["0"])[0])
        if limit:
            data = data[:limit]
        return 200, data, "text/plain"

    # --- the kubelet ----------------------------------------------------------------------------

    def _kubelet(self, ns: str, name: str, run: _Run) -> None:
        with self.lock:
            pod = self.pods.get((ns, name))
            if pod is None:  # deleted before its kubelet ran, as a pod can be
                return
            spec = pod["spec"]
            container = spec["containers"][0]
            mounts = _mount_map(spec, container)
        if mounts is None:  # a hostPath of the wrong type: stays ContainerCreating, as a failed mount does
            self._set(ns, name, "Pending", {"waiting": {"reason": "ContainerCreating"}})
            return
        argv = [_translate(a, mounts) for a in container.get("command") or []] + [
            _translate(a, mounts) for a in container.get("args") or []
        ]
        if argv and argv[0] == "python3":
            argv[0] = self.python
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env.update(
            {e["name"]: _translate(str(e.get("value", "")), mounts) for e in container.get("env") or []}
        )
        cwd = _translate(container.get("workingDir") or "/", mounts)
        run.log = self.scratch / f"{ns}-{name}.log"
        with open(run.log, "wb") as out, self.lock:
            if run.deleted:
                return
            run.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            started = _now()
        self._set(ns, name, "Running", {"running": {"startedAt": started}})
        code = run.proc.wait()
        with self.lock:
            exit_code = 128 - code if code < 0 else code
            reason = "OOMKilled" if run.oom else ("Completed" if exit_code == 0 else "Error")
            terminated = {"exitCode": exit_code, "reason": reason, "startedAt": started, "finishedAt": _now()}
            self._set(ns, name, "Succeeded" if exit_code == 0 else "Failed", {"terminated": terminated})
            run.done.set()

    def _set(self, ns: str, name: str, phase: str, state: dict[str, Any]) -> None:
        with self.lock:
            pod = self.pods.get((ns, name))
            if pod is None:
                return
            self._version += 1
            pod["metadata"]["resourceVersion"] = str(self._version)
            pod["status"] = {
                "phase": phase,
                "containerStatuses": [
                    {
                        "name": pod["spec"]["containers"][0]["name"],
                        "image": pod["spec"]["containers"][0]["image"],
                        "imageID": "",
                        "ready": phase == "Running",
                        "restartCount": 0,
                        "state": state,
                    }
                ],
            }

    def _delete(self, ns: str, name: str, grace: int) -> None:
        with self.lock:
            run = self.runs[(ns, name)]
            run.deleted = True
            proc = run.proc
        if proc is not None and proc.poll() is None:
            # the group can be gone between the poll and a signal (SIGTERM ended it at once): as a
            # kubelet, the delete goes on, else the pod would never leave the listing
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            if not run.done.wait(grace):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            run.done.wait()
        with self.lock:
            self.pods.pop((ns, name), None)


def _status(code: int, reason: str, message: str) -> tuple[int, Any, str]:
    doc = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return code, doc, "application/json"


def _grace(query: dict[str, list[str]], body: Any) -> int:
    if "gracePeriodSeconds" in query:
        return int(query["gracePeriodSeconds"][0])
    if isinstance(body, dict) and body.get("gracePeriodSeconds") is not None:
        return int(body["gracePeriodSeconds"])
    return 30


def _selects(selector: str, pod: dict[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _mount_map(spec: dict[str, Any], container: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(mountPath, host path) for each hostPath mount, longest first; None when a hostPath type fails."""
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    out = []
    for mount in container.get("volumeMounts") or []:
        host = volumes[mount["name"]].get("hostPath")
        if host is None:
            continue
        source = Path(host["path"], mount.get("subPath", ""))
        kind = host.get("type", "")
        if (kind == "Directory" and not source.is_dir()) or (kind == "File" and not source.is_file()):
            return None
        out.append((mount["mountPath"], str(source)))
    return sorted(out, key=lambda m: -len(m[0]))


def _translate(value: str, mounts: list[tuple[str, str]]) -> str:
    """Rewrite container paths inside ``value`` (also ``a:b`` path lists) to their host paths."""
    parts = []
    for piece in value.split(":"):
        for target, source in mounts:
            if piece == target or piece.startswith(target.rstrip("/") + "/"):
                piece = source + piece[len(target) :]
                break
        parts.append(piece)
    return ":".join(parts)
