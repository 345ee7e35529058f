"""Pure decisions of the kube runner: the pod manifest, resources, the user, labels, the exit status.

Nothing here talks to the API, so every rule is testable without one:

- :func:`pod_manifest`: the whole Pod as a plain dict (what ``kubectl apply`` would take).
- :func:`resources`: parsed :class:`~nymph.resources.Resources` (``cpus``, ``memory``, ``gpus``,
  ``shm``; read by :mod:`nymph.resources`) as requests == limits (Guaranteed QoS for cpu/memory)
  and the size of ``/dev/shm``; ``pids`` is refused (:data:`UNSUPPORTED_RESOURCES`).
- :func:`run_as`: ``as_user`` mapped to ``uid:gid`` (the ``users`` table, then nymph's passwd); without
  one, the owner of the workdir. uid 0 is refused: the pod always runs with ``runAsNonRoot``.
- :func:`exit_status`: a pod's phase and container state as an :class:`~nymph.runner.ExitStatus`.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nymph.resources import Resources
from nymph.runner import ExitStatus, RunnerError
from nymph.runnerkit import BUNDLE_TARGET, ENTRY_MODULE, MOUNT_TARGET, SCRIPT_SHIM, WORKDIR_TARGET

__all__ = [
    "BUNDLE_TARGET",
    "CONTAINER",
    "SCRIPT_SHIM",
    "UNSUPPORTED_RESOURCES",
    "PodOptions",
    "exit_status",
    "is_running",
    "labels",
    "pod_manifest",
    "resources",
    "run_as",
    "valid_label",
    "valid_name",
]

CONTAINER = "task"
GPU_RESOURCE = "nvidia.com/gpu"
#: run_config.resources fields a pod cannot enforce, with why (see nymph.resources).
UNSUPPORTED_RESOURCES = {"pids": "a pod cannot set its own pids limit: the kubelet's podPidsLimit does"}

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: Container waiting reasons that never resolve by themselves: the pod is reported as failed.
FATAL_WAITING = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"})


@dataclass(frozen=True)
class PodOptions:
    """The runner's options that shape every pod (see the README for each)."""

    namespace: str
    image: str
    image_pull_policy: str
    service_account: str | None
    node_name: str | None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    python: str = "python3"
    tmp_size: str | None = "1Gi"
    automount_token: bool = False
    runtime_class: str | None = None
    priority_class: str | None = None


def resources(wanted: Resources, gpus: int = 0) -> tuple[dict[str, Any], int | None]:
    """The container's ``resources`` (requests == limits) and the /dev/shm size in bytes (or None).

    ``gpus`` (the number nymph assigned) is the GPU count when ``wanted`` names none: on
    Kubernetes the device plugin picks the devices, nymph only says how many.
    """
    limits: dict[str, str] = {}
    if wanted.millicpus is not None:
        limits["cpu"] = f"{wanted.millicpus}m"
    if wanted.memory is not None:
        limits["memory"] = str(wanted.memory)
    count = wanted.gpus if wanted.gpus is not None else gpus
    if count:
        limits[GPU_RESOURCE] = str(count)
    if not limits:
        return {}, wanted.shm
    return {"requests": dict(limits), "limits": limits}, wanted.shm


def run_as(as_user: str | None, users: Mapping[str, str], workdir: Path) -> tuple[int, int]:
    """(uid, gid) the pod runs as: ``as_user`` mapped, or the owner of the workdir. Never 0."""
    if as_user:
        if as_user in users:
            uid_s, _, gid_s = users[as_user].partition(":")
            try:
                uid, gid = int(uid_s), int(gid_s or uid_s)
            except ValueError as exc:
                raise RunnerError(f"users[{as_user!r}]: expected 'uid:gid', got {users[as_user]!r}") from exc
        else:
            try:
                pw = pwd.getpwnam(as_user)
            except KeyError as exc:
                raise RunnerError(
                    f"as_user {as_user!r} is not a user known to nymph; map it in the kube runner's "
                    f"users option (name -> 'uid:gid')"
                ) from exc
            uid, gid = pw.pw_uid, pw.pw_gid
        who = f"as_user {as_user!r}"
    else:
        st = os.stat(workdir)
        uid, gid = st.st_uid, st.st_gid
        who = f"the owner of {workdir} (nymph's user)"
    if uid == 0:
        raise RunnerError(
            f"kube runner: {who} is root; pods run with runAsNonRoot: run nymph as a non-root user "
            f"(the Helm chart uses uid 10001) or give the task an as_user mapped to a non-root uid"
        )
    return uid, gid


def labels(task_labels: Mapping[str, str], invocation_id: str, attempt: int, worker: str) -> dict[str, str]:
    """Pod labels: the task's valid ones, then nymph's (``nymph.invocation``, ``nymph.worker``, ...).

    A task label that is not a valid Kubernetes label is left out (the API would refuse the pod).
    """
    out = {str(k): str(v) for k, v in task_labels.items() if valid_label(str(k), str(v))}
    out.update(
        {
            "nymph.invocation": invocation_id,
            "nymph.attempt": str(attempt),
            "nymph.worker": worker if valid_label("nymph.worker", worker) else "",
            "nymph.runner": "kube",
            "app.kubernetes.io/managed-by": "nymph",
        }
    )
    return out


def valid_label(key: str, value: str) -> bool:
    """Whether ``key: value`` is a valid Kubernetes label (prefix a DNS subdomain, name and value <= 63)."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    if len(name) > 63 or not _LABEL_NAME.match(name):
        return False
    return len(value) <= 63 and bool(_LABEL_VALUE.match(value))


def valid_name(name: str) -> bool:
    """A DNS-1123 subdomain of at most 253 characters (pod and namespace names)."""
    return len(name) <= 253 and bool(_DNS_SUBDOMAIN.match(name))


def command(script: str | None, python: str) -> list[str]:
    if script is not None:
        return ["sh", "-c", SCRIPT_SHIM, "sh", script]
    return [python, "-m", ENTRY_MODULE]


def pod_manifest(
    opts: PodOptions,
    *,
    name: str,
    image: str,
    script: str | None,
    env: Mapping[str, str],
    host_workdir: str,
    host_bundle: str,
    uid: int,
    gid: int,
    pod_labels: Mapping[str, str],
    annotations: Mapping[str, str],
    container_resources: Mapping[str, Any],
    shm_bytes: int | None,
    code_dirs: Sequence[tuple[str, str]] = (),
    user_mounts: Mapping[str, tuple[str, bool]] | None = None,
) -> dict[str, Any]:
    """The Pod: one container, the workdir and the bundle as hostPath volumes, locked down.

    ``code_dirs``: ``(node path, mount path)`` of each code archive the call shipped (nymph's code
    cache), mounted read-only as volume ``code-<n>``. ``user_mounts``: the operator's mounts the
    call asked for, ``{name: (node path or "pvc:CLAIM", read_only)}``, as volume ``mount-<n>`` (a
    hostPath, or the PersistentVolumeClaim) at ``MOUNT_TARGET/<name>``."""
    volumes: list[dict[str, Any]] = [
        {"name": "workdir", "hostPath": {"path": host_workdir, "type": "Directory"}},
        {"name": "entry-bundle", "hostPath": {"path": host_bundle, "type": "File"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": opts.tmp_size} if opts.tmp_size else {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "workdir", "mountPath": WORKDIR_TARGET},
        {"name": "entry-bundle", "mountPath": BUNDLE_TARGET, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    for n, (host, target) in enumerate(code_dirs):
        volumes.append({"name": f"code-{n}", "hostPath": {"path": host, "type": "Directory"}})
        mounts.append({"name": f"code-{n}", "mountPath": target, "readOnly": True})
    for n, (mount, (source, read_only)) in enumerate(sorted((user_mounts or {}).items())):
        if source.startswith("pvc:"):
            volume: dict[str, Any] = {
                "persistentVolumeClaim": {"claimName": source[4:], "readOnly": read_only}
            }
        else:
            volume = {"hostPath": {"path": source, "type": "Directory"}}
        volumes.append({"name": f"mount-{n}", **volume})
        mounts.append({"name": f"mount-{n}", "mountPath": f"{MOUNT_TARGET}/{mount}", "readOnly": read_only})
    if shm_bytes is not None:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(shm_bytes)}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": opts.image_pull_policy,
        "command": command(script, opts.python),
        "workingDir": WORKDIR_TARGET,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "stdin": False,
        "tty": False,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if container_resources:
        container["resources"] = dict(container_resources)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": opts.automount_token,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid},
        "containers": [container],
        "volumes": volumes,
    }
    if opts.node_name:
        spec["nodeName"] = opts.node_name
    if opts.node_selector:
        spec["nodeSelector"] = dict(opts.node_selector)
    if opts.tolerations:
        spec["tolerations"] = [dict(t) for t in opts.tolerations]
    if opts.service_account:
        spec["serviceAccountName"] = opts.service_account
    if opts.runtime_class:
        spec["runtimeClassName"] = opts.runtime_class
    if opts.priority_class:
        spec["priorityClassName"] = opts.priority_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": opts.namespace,
            "labels": dict(pod_labels),
            "annotations": dict(annotations),
        },
        "spec": spec,
    }


def is_running(pod: Mapping[str, Any]) -> bool:
    """Not finished yet: Pending or Running (or Unknown), and not stuck on a fatal waiting reason."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return False
    if _container_state(pod).get("terminated"):
        return False
    waiting = _container_state(pod).get("waiting") or {}
    return waiting.get("reason") not in FATAL_WAITING


def _container_state(pod: Mapping[str, Any]) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            state: dict[str, Any] = cs.get("state") or {}
            return state
    return {}


def exit_status(pod: Mapping[str, Any], *, script: bool, logs: str | None) -> ExitStatus:
    """The ExitStatus of a finished pod: the container's exit code and reason (``OOMKilled``, ...)."""
    status = pod.get("status") or {}
    state = _container_state(pod)
    terminated = state.get("terminated")
    if terminated:
        code = int(terminated.get("exitCode", -1))
        reason = terminated.get("reason")
        if reason in ("Completed", "Error"):
            reason = None  # the kubelet's words for exit 0 / non-zero: the code says it already
        if reason is None and terminated.get("signal"):
            reason = f"signal {terminated['signal']}"
        elif reason is None and code > 128 and not script:
            reason = f"signal {code - 128}"  # the entry itself only exits 0, 1 or 2
        if code != 0 and terminated.get("message") and reason != "OOMKilled":
            reason = f"{reason}: {terminated['message']}" if reason else str(terminated["message"])
        return ExitStatus(exit_code=code, reason=reason, logs=logs)
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in FATAL_WAITING:
        return ExitStatus(
            exit_code=-1, reason=f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": "), logs=logs
        )
    # Failed without a container status: evicted, node lost, deadline exceeded.
    reason = status.get("reason") or status.get("phase") or "unknown"
    message = status.get("message")
    return ExitStatus(exit_code=-1, reason=f"{reason}: {message}" if message else str(reason), logs=logs)
