"""nymph's ``kube`` runner: each invocation is one Pod on a Kubernetes cluster.

Registered through the ``nymph.runners`` entry point like any third-party runner. nymph runs as a
DaemonSet (``packaging/helm/nymph``, ``packaging/k8s``); every invocation becomes a pod on nymph's
own node, created through the API with nymph's service account:

    command      python3 -m dreamlake.lakeshore.daemon.entry    (or sh -c SHIM SCRIPT: bash when present)
    /work/inv    the invocation's workdir, read-write, the working directory. How the pod sees it is
                 ``workdir_volume``: ``hostPath`` (default: nymph's workdir root is a hostPath of the
                 node, the pod is pinned to that node with ``nodeName`` and mounts its own directory)
                 or ``persistentVolumeClaim`` (a ReadWriteMany claim mounted by nymph at its workdir
                 root; the pod mounts ``subPath: <invocation id>``, may land on any node)
    /opt/lakeshore/entry.zip   the entry bundle, read-only, on PYTHONPATH. nymph builds it into
                 ``{workdir root}/.lakeshore-bundle/`` (on the same hostPath / claim), so the pod
                 mounts it like the workdir: no init container, no registry, any image with python3
    /tmp         an emptyDir (the root filesystem is read-only)
    security     runAsNonRoot with runAsUser/runAsGroup = as_user mapped to uid:gid (``users``, then
                 nymph's passwd) or the workdir's owner (nymph's user); allowPrivilegeEscalation
                 false, capabilities drop ALL, readOnlyRootFilesystem, seccomp RuntimeDefault, no
                 service account token, no service links
    resources    run_config.resources (read by nymph.resources) cpus/memory/gpus/shm over the
                 defaults, requests == limits; pids is refused (the kubelet's podPidsLimit);
                 task.gpus counts as ``nvidia.com/gpu`` (the device plugin picks the devices)
    labels       nymph.invocation, nymph.attempt, nymph.worker, nymph.runner=kube + valid task labels;
                 annotations nymph.workdir, nymph.script
    name         nymph-<invocation id>-a<attempt>: a start tried again after a lost create answer
                 gets 409 AlreadyExists, finds the pod the first one made and adopts it (a pod of
                 that name that is not this task's is refused), never a second pod
    restartPolicy Never

``wait`` polls the pod (with jitter) until its phase is Succeeded/Failed or its container has
terminated, reads the exit code and reason (``OOMKilled``, ``signal N``, an eviction), and appends
the container log (what came before the entry took over fd 1/2) to ``stderr.log``. ``stop``
deletes the pod with ``gracePeriodSeconds`` = the grace: the kubelet sends SIGTERM, waits, then
SIGKILL. ``destroy`` deletes it (a missing pod is fine).

Errors: an unreachable API (or 5xx / 429) is :class:`~nymph.runner.RunnerUnavailable`; a refusal
(403, a bad spec, an image not allowed) is :class:`~nymph.runner.RunnerError`, bad resources its
:class:`~nymph.resources.ResourceError`. ``close`` closes the API client.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from nymph import safeio
from nymph.resources import parse_defaults, parse_resources
from nymph.runner import Capabilities, ExitStatus, Handle, RunnerError, RunnerUnavailable, Task
from nymph.runnerkit import (
    MOUNT_TARGET,
    code_mounts,
    code_path_env,
    handle_workdir,
    image_allowed,
    log_tail,
    option_list,
    option_mapping,
    task_name,
)
from nymph.taskenv import mount_env_name
from nymph_kube import api, podspec

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_IMAGE", "KubeRunner"]

DEFAULT_IMAGE = "python:3.11-slim"
BUNDLE_DIR = ".lakeshore-bundle"
WorkdirVolume = Literal["hostPath", "persistentVolumeClaim"]
WORKDIR_VOLUMES = ("hostPath", "persistentVolumeClaim")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
LOG_LIMIT_BYTES = 8 * 1024 * 1024
COLLECTED = ".container-output"  # nymph's marker: the pod's log was appended to the workdir's
_POLL_MIN_S, _POLL_MAX_S = 0.2, 2.0
_GONE_WAIT_S = 30.0


class KubeRunner:
    """Runs each invocation in its own pod (see the module docstring for what it looks like)."""

    name: ClassVar[str] = "kube"
    capabilities: ClassVar[Capabilities] = Capabilities(
        as_user=True, gpus=True, resources=True, image=True, network=False, recover=True, list_labelled=True
    )

    def __init__(
        self,
        *,
        namespace: str = "default",
        image: str = DEFAULT_IMAGE,
        allowed_images: Iterable[str] | str = (),
        image_pull_policy: str = "IfNotPresent",
        service_account: str | None = None,
        node_selector: Mapping[str, str] | str | None = None,
        tolerations: Iterable[Mapping[str, Any]] = (),
        node_name: str | None = None,
        workdir_volume: WorkdirVolume = "hostPath",
        host_workdir_root: str | None = None,
        workdir_claim: str | None = None,
        users: Mapping[str, str] | str | None = None,
        cpus: float | str | None = None,
        memory: int | str | None = None,
        shm: int | str | None = None,
        tmp_size: str | None = "1Gi",
        runtime_class: str | None = None,
        priority_class: str | None = None,
        python: str = "python3",
        kubeconfig: str | None = None,
        context: str | None = None,
    ) -> None:
        who = f"{self.name} runner"
        if not podspec.valid_name(namespace) or len(namespace) > 63:
            raise RunnerError(f"{who}: namespace {namespace!r} is not a valid DNS-1123 label")
        if image_pull_policy not in PULL_POLICIES:
            raise RunnerError(
                f"{who}: image_pull_policy must be one of {PULL_POLICIES}, got {image_pull_policy!r}"
            )
        if workdir_volume not in WORKDIR_VOLUMES:
            raise RunnerError(
                f"{who}: workdir_volume must be one of {WORKDIR_VOLUMES}, got {workdir_volume!r} "
                f"(see runners/nymph_kube/README.md for the alternatives)"
            )
        if workdir_volume == "persistentVolumeClaim" and not workdir_claim:
            raise RunnerError(
                f"{who}: workdir_volume='persistentVolumeClaim' needs workdir_claim (the claim's name)"
            )
        tolerations = tuple(dict(t) for t in tolerations)
        self.options = podspec.PodOptions(
            namespace=namespace,
            image=image,
            image_pull_policy=image_pull_policy,
            service_account=service_account,
            node_name=node_name or None,
            node_selector=option_mapping(node_selector, "node_selector"),
            tolerations=tolerations,
            python=python,
            tmp_size=tmp_size,
            runtime_class=runtime_class,
            priority_class=priority_class,
        )
        self.namespace = namespace
        self.image = image
        self.allowed_images = option_list(allowed_images)
        self.workdir_volume = workdir_volume
        self.host_workdir_root = host_workdir_root
        self.workdir_claim = workdir_claim
        self.users = option_mapping(users, "users")
        self.default_resources = parse_defaults(self.name, cpus=cpus, memory=memory, shm=shm)
        self.kubeconfig = kubeconfig
        self.context = context
        self._pods: api.Pods | None = None
        self._bundles: dict[Path, Path] = {}
        self._stopped: set[str] = set()
        self._lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------

    def check(self) -> None:
        """The API reachable with the configured credentials, and pods listable in the namespace."""
        if self.workdir_volume == "hostPath" and not self.options.node_name:
            raise RunnerUnavailable(
                f"{self.name} runner: workdir_volume='hostPath' needs node_name (the node nymph runs on, "
                f"so the pod sees the same hostPath); the DaemonSet sets NYMPH_RUNNER_OPT_NODE_NAME from "
                f"spec.nodeName"
            )
        self._client().list("nymph.runner=kube", limit=1)

    def start(self, task: Task) -> Handle:
        pods = self._client()
        image = str(task.run_config.get("image") or self.image)
        if not image_allowed(image, self.image, self.allowed_images):
            raise RunnerError(
                f"{self.name} runner: image {image!r} is not allowed on this node "
                f"(default {self.image!r}; allowed_images {list(self.allowed_images)})"
            )
        network = task.run_config.get("network")
        if network not in (None, "", "default"):
            raise RunnerError(
                f"{self.name} runner: run_config.network {network!r}: pods get the cluster's network; "
                f"use a NetworkPolicy on the namespace instead"
            )
        workdir = Path(task.workdir).resolve()
        manifest = self.manifest(task, workdir, image)
        name = manifest["metadata"]["name"]
        for _tries in range(2):
            if pods.create(manifest) is not None:
                log.debug(
                    "invocation %s: created pod %s/%s (%s)", task.invocation_id, self.namespace, name, image
                )
                break
            if self._adopt(name, task, workdir):  # 409: an earlier start of this attempt created it
                break
        else:
            raise RunnerUnavailable(
                f"{self.name} runner: pod {self.namespace}/{name} keeps appearing and vanishing; start again"
            )
        return Handle(
            runner=self.name,
            invocation_id=task.invocation_id,
            attempt=task.attempt,
            data={
                "pod": name,
                "namespace": self.namespace,
                "image": image,
                "workdir": str(workdir),
                "script": task.script is not None,
            },
        )

    def manifest(self, task: Task, workdir: Path, image: str) -> dict[str, Any]:
        """The Pod this runner would create for ``task`` (pure but for the bundle build and a stat)."""
        res, shm = self.limits(task.run_config.get("resources"), len(task.gpus))
        root = workdir.parent
        bundle = self._bundle(root)
        uid, gid = podspec.run_as(task.as_user, self.users, workdir)
        env = {k: v for k, v in task.env.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
        env["PYTHONPATH"] = podspec.BUNDLE_TARGET
        # the shipped code at the paths the pod sees (the entry puts them first on sys.path)
        code = [(self._code_host_path(root, Path(host)), target) for host, target in code_mounts(task)]
        env.update(code_path_env(code))
        env.update({mount_env_name(m): f"{MOUNT_TARGET}/{m}" for m in task.mounts})  # the pod's paths
        name = task_name(task)
        worker = str(task.labels.get("nymph.worker", ""))
        manifest = podspec.pod_manifest(
            self.options,
            name=name,
            image=image,
            script=task.script,
            env=env,
            host_workdir=self._host_path(root, workdir.name),
            host_bundle=self._host_path(root, f"{BUNDLE_DIR}/{bundle.name}"),
            uid=uid,
            gid=gid,
            pod_labels=podspec.labels(task.labels, task.invocation_id, task.attempt, worker),
            annotations={
                "nymph.workdir": str(workdir),
                "nymph.script": "1" if task.script is not None else "0",
            },
            container_resources=res,
            shm_bytes=shm,
            code_dirs=code,
            user_mounts=task.mounts,
        )
        if self.workdir_volume == "persistentVolumeClaim":
            subs = [self._code_sub_path(root, d) for d in task.code_dirs]
            _use_claim(manifest, str(self.workdir_claim), workdir.name, f"{BUNDLE_DIR}/{bundle.name}", subs)
        return manifest

    def _code_host_path(self, root: Path, code_dir: Path) -> str:
        """The node path of a code cache directory: under the workdir root it moves with it."""
        try:
            return self._host_path(root, str(code_dir.relative_to(root)))
        except ValueError:
            return str(code_dir)  # a code_cache outside the workdir: nymph sees the node's path

    def _code_sub_path(self, root: Path, code_dir: Path) -> str:
        try:
            return str(code_dir.relative_to(root))
        except ValueError:
            raise RunnerError(
                f"kube runner: code cache {code_dir} is outside the workdir {root}, so the workdir claim "
                "cannot carry it: leave code_cache unset (it defaults to {workdir}/.code)"
            ) from None

    def limits(self, resources: Any, gpus: int = 0) -> tuple[dict[str, Any], int | None]:
        """The container's ``resources`` and the /dev/shm size for a task's ``run_config.resources``.

        Read by :mod:`nymph.resources` over the runner's defaults; ``gpus`` is the number nymph
        assigned (the count when ``resources`` names none).
        """
        wanted = parse_resources(resources, self.name, unsupported=podspec.UNSUPPORTED_RESOURCES)
        return podspec.resources(wanted.over(self.default_resources), gpus)

    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        delay = _POLL_MIN_S
        while True:
            pod = self._client().get(_pod(handle))
            if pod is None:
                stopped = _pod(handle) in self._stopped
                return ExitStatus(
                    exit_code=-1,
                    reason="pod deleted by stop" if stopped else "pod gone (deleted outside nymph)",
                    logs=log_tail(handle_workdir(handle)),
                )
            if not podspec.is_running(pod):
                self._collect_logs(handle)
                return podspec.exit_status(
                    pod, script=bool(handle.data.get("script")), logs=log_tail(handle_workdir(handle))
                )
            if deadline is not None and time.monotonic() >= deadline:
                return None
            pause = delay * random.uniform(0.8, 1.2)
            if deadline is not None:
                pause = min(pause, max(deadline - time.monotonic(), 0.0))
            time.sleep(pause)
            delay = min(delay * 1.5, _POLL_MAX_S)

    def stop(self, handle: Handle, grace_s: float) -> None:
        """Delete the pod with ``gracePeriodSeconds`` = ``grace_s``: SIGTERM, grace, SIGKILL by the kubelet.

        The container log is copied first (a deleted pod's log is gone). Returns once the pod is
        gone or its container has terminated.
        """
        name = _pod(handle)
        pod = self._client().get(name)
        if pod is None:
            return
        if podspec.is_running(pod):
            self._collect_logs(handle)
        self._stopped.add(name)
        grace = max(1, math.ceil(grace_s))
        if not self._client().delete(name, grace):
            return
        deadline = time.monotonic() + grace + _GONE_WAIT_S
        delay = _POLL_MIN_S
        while time.monotonic() < deadline:
            pod = self._client().get(name)
            if pod is None or not podspec.is_running(pod):
                return
            time.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 1.5, _POLL_MAX_S)
        log.warning("invocation %s: pod %s still running after its grace", handle.invocation_id, name)

    def destroy(self, handle: Handle) -> None:
        """Delete the pod at once; a missing pod (404) is fine."""
        self._client().delete(_pod(handle), 0)
        self._stopped.discard(_pod(handle))

    def inspect(self, handle: Handle) -> str:
        pod = self._client().get(_pod(handle))
        if pod is None:
            return "gone"
        return "running" if podspec.is_running(pod) else "exited"

    def recover(self, handle: Handle) -> bool:
        """True when the pod still exists (running or finished): nymph then waits and reads outputs."""
        return self._client().get(_pod(handle)) is not None

    def list_labelled(self, worker_id: str | None = None) -> list[Handle]:
        """Handles of every pod this runner kind started in the namespace (of ``worker_id`` when given)."""
        selector = "nymph.runner=kube,nymph.invocation"
        if worker_id is not None:
            selector += f",nymph.worker={worker_id}"
        handles = []
        for pod in self._client().list(selector):
            meta = pod.get("metadata") or {}
            labels = meta.get("labels") or {}
            notes = meta.get("annotations") or {}
            try:
                attempt = int(labels.get("nymph.attempt", "0"))
            except ValueError:
                attempt = 0
            containers = (pod.get("spec") or {}).get("containers") or [{}]
            handles.append(
                Handle(
                    runner=self.name,
                    invocation_id=labels["nymph.invocation"],
                    attempt=attempt,
                    data={
                        "pod": meta.get("name", ""),
                        "namespace": meta.get("namespace", self.namespace),
                        "image": containers[0].get("image", ""),
                        "workdir": notes.get("nymph.workdir", ""),
                        "script": notes.get("nymph.script") == "1",
                    },
                )
            )
        return handles

    def close(self) -> None:
        """Close the API client (its connection pool); pods keep running."""
        with self._lock:
            pods, self._pods = self._pods, None
        if pods is not None:
            pods.close()

    # --- helpers --------------------------------------------------------------------------------

    def _adopt(self, name: str, task: Task, workdir: Path) -> bool:
        """Adopt the pod of this name an earlier start of the same attempt created; refuse any other.

        Pods are named after the invocation and attempt, so a start tried again after the create's
        answer was lost (the API created the pod, the reply never came) gets 409 AlreadyExists and
        finds the first pod here instead of making a second one. False when the pod is gone again
        (deleted between the 409 and the read): it may be created anew.
        """
        pod = self._client().get(name)
        if pod is None:
            return False
        meta = pod.get("metadata") or {}
        labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
        mine = (
            labels.get("nymph.invocation") == task.invocation_id
            and labels.get("nymph.attempt") == str(task.attempt)
            and labels.get("nymph.runner") == self.name
            and notes.get("nymph.workdir") == str(workdir)
        )
        if not mine:
            raise RunnerError(
                f"{self.name} runner: a pod named {self.namespace}/{name} exists and is not this task's "
                f"(labels {labels}); delete it (kubectl delete pod -n {self.namespace} {name})"
            )
        if meta.get("deletionTimestamp"):
            raise RunnerError(
                f"{self.name} runner: pod {self.namespace}/{name} of this attempt is being deleted; "
                f"the attempt cannot start again under the same name"
            )
        log.warning(
            "invocation %s: pod %s/%s of this attempt exists (an earlier start's answer was lost); "
            "adopting it",
            task.invocation_id,
            self.namespace,
            name,
        )
        return True

    def _client(self) -> api.Pods:
        with self._lock:
            if self._pods is None:
                core, host = api.connect(self.kubeconfig, self.context, f"{self.name} runner")
                self._pods = api.Pods(core, host, self.namespace, f"{self.name} runner")
            return self._pods

    def _bundle(self, root: Path) -> Path:
        """The entry bundle, built into ``{root}/.lakeshore-bundle/`` so the pod can mount it."""
        with self._lock:
            found = self._bundles.get(root)
        if found is not None and found.is_file():
            return found
        try:
            from dreamlake.lakeshore.daemon.bundle import bundle_path

            directory = root / BUNDLE_DIR
            directory.mkdir(mode=0o755, exist_ok=True)
            os.chmod(directory, 0o755)  # readable by pods running as another uid (as_user)
            path = bundle_path(directory)
        except (OSError, ImportError) as exc:
            raise RunnerUnavailable(
                f"{self.name} runner: cannot build the entry bundle in {root}: {exc}"
            ) from exc
        with self._lock:
            self._bundles[root] = path
        return path

    def _host_path(self, root: Path, relative: str) -> str:
        """Where ``{root}/{relative}`` is on the node (``host_workdir_root`` when nymph sees it elsewhere)."""
        base = Path(self.host_workdir_root) if self.host_workdir_root else root
        return str(base / relative)

    def _collect_logs(self, handle: Handle) -> None:
        """Append the container log (stdout and stderr interleaved) to ``stderr.log``, once; best
        effort. The task's own output is in the workdir's logs already (the entry and the script
        shim append it there as it is written): what the kubelet kept is what came before that
        (an interpreter or a mount that failed). A marker keeps a rerun from appending it twice."""
        workdir = handle_workdir(handle)
        if workdir is None or not workdir.is_dir() or safeio.exists_own(workdir, COLLECTED):
            return
        try:
            data = self._client().log(_pod(handle), podspec.CONTAINER, LOG_LIMIT_BYTES)
        except RunnerError as exc:  # e.g. 400: the container never started
            log.info("invocation %s: no pod log: %s", handle.invocation_id, exc)
            return
        if data is None:
            return
        try:  # the workdir is the task user's: a link planted there is refused, never written through
            safeio.append_stream(workdir, "stderr.log", (data,), 0o644)
            safeio.write_file(workdir, COLLECTED, b"")
        except OSError as exc:
            log.warning("cannot write %s: %s", workdir / "stderr.log", exc)


def _use_claim(
    manifest: dict[str, Any], claim: str, sub_workdir: str, sub_bundle: str, sub_code: list[str] | None = None
) -> None:
    """Swap the hostPath volumes for one ReadWriteMany claim mounted with subPaths (the workdir, the
    bundle, each code archive)."""
    spec = manifest["spec"]
    code = {f"code-{n}": sub for n, sub in enumerate(sub_code or [])}
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in ("workdir", "entry-bundle", *code)]
    spec["volumes"].insert(0, {"name": "workdir", "persistentVolumeClaim": {"claimName": claim}})
    spec.pop("nodeName", None)
    for mount in spec["containers"][0]["volumeMounts"]:
        if mount["name"] == "workdir":
            mount["subPath"] = sub_workdir
        elif mount["name"] == "entry-bundle":
            mount.update({"name": "workdir", "subPath": sub_bundle})
        elif mount["name"] in code:
            mount.update({"name": "workdir", "subPath": code[mount["name"]]})


def _pod(handle: Handle) -> str:
    return str(handle.data["pod"])
