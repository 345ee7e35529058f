"""nymph's ``docker`` runner: each invocation is one container on a Docker engine.

Registered through the ``nymph.runners`` entry point exactly like a third-party runner. Modelled on
Nomad's docker driver: ``start`` creates and starts a labelled container, ``wait`` blocks on the
engine, ``stop`` is the cancellation ladder, ``destroy`` removes it, and the handle (container id)
lets a restarted nymph re-attach.

The container::

    image        run_config.image or the runner's default; refused unless allowed (allowed_images)
    command      python3 -m dreamlake.lakeshore.daemon.entry   (or bash -c SCRIPT; sh when no bash)
    /work/inv    the invocation's workdir, bind-mounted read-write, the working directory
    /opt/lakeshore/entry.zip   the entry bundle, read-only, first on PYTHONPATH: an image with a bare
                 python3 (and nothing of dreamlake) can run invocations
    code_dirs    host directories of user code, read-only at the same path, on PYTHONPATH; with
                 mount_pythonpath (default) also the existing entries of the task's PYTHONPATH (the
                 operator's code on nymph's own PYTHONPATH, as the process runner sees it)
    /opt/lakeshore/code/<sha256>   each code archive the call shipped (nymph's code cache), and
                 its pip environment (nymph.envcache, built for the image's python3), read-only,
                 first on the import path (LAKESHORE_CODE_PATH; the entry puts it there)
    /mnt/lakeshore/<name>   each operator mount the call asked for (--mount NAME=PATH[:ro]), its
                 path in LAKESHORE_MOUNT_<NAME>
    environment  only the task's variables (nymph.taskenv): the image's own PATH, HOME, ...
    user         as_user mapped to uid:gid (users option, else the host's passwd); else the owner of
                 the workdir, so the bind-mounted workdir stays writable
    security     cap_drop ALL, no-new-privileges, never privileged, network "none" by default,
                 an init process (tini) as PID 1 so SIGTERM reaches the entry
    limits       run_config.resources (read by nymph.resources: cpus, memory, pids, shm, gpus) over
                 the runner's defaults; memory also caps swap, so exceeding it ends with reason
                 "OOMKilled"; task.gpus (assigned by nymph) as a device request
    labels       nymph.invocation, nymph.attempt, nymph.worker, nymph.runner, nymph.workdir + task.labels
    name         nymph-<invocation id>-a<attempt>: a start tried again after a lost answer finds the
                 container the first one made (removed if it never started, else adopted), never a
                 second one

The task's output reaches ``stdout.log`` / ``stderr.log`` in the workdir while it runs (the entry,
and the script shim, append fd 1/2 there), so nymph streams it live. On exit, ``wait`` appends what
the container wrote before that (its engine log) to the same files, once, and returns their tail in
:class:`~nymph.runner.ExitStatus`.

Errors: an unreachable engine is :class:`~nymph.runner.RunnerUnavailable` from ``check`` and
``start`` (transient: nymph should keep the invocation and retry later); a refusal (image not
allowed, image missing and not pullable) is :class:`~nymph.runner.RunnerError`; bad resources are
its :class:`~nymph.resources.ResourceError`. ``close`` closes the engine client.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import docker
import docker.errors
from docker.types import DeviceRequest, Mount

from nymph.envcache import Interpreter, probe_source
from nymph.resources import Resources, parse_defaults, parse_resources
from nymph.runner import Capabilities, ExitStatus, Handle, RunnerError, RunnerUnavailable, Task
from nymph.runnerkit import (
    BUNDLE_TARGET,
    ENTRY_MODULE,
    MOUNT_TARGET,
    SCRIPT_SHIM,
    WORKDIR_TARGET,
    code_mounts,
    code_path_env,
    handle_workdir,
    log_tail,
    option_list,
    option_mapping,
    task_name,
)
from nymph.taskenv import mount_env_name
from nymph_docker import engine, policy
from nymph_docker.logs import collect_logs

log = logging.getLogger(__name__)

__all__ = [
    "BUNDLE_TARGET",
    "DEFAULT_IMAGE",
    "ENTRY_MODULE",
    "WORKDIR_TARGET",
    "DockerRunner",
]

DEFAULT_IMAGE = "lakeshore-python:bookworm"
PullPolicy = Literal["never", "if-not-present", "always"]
PULL_POLICIES = ("never", "if-not-present", "always")
_KILL_WAIT_S = 30.0


class DockerRunner:
    """Runs each invocation in its own container (see the module docstring for what it looks like)."""

    name: ClassVar[str] = "docker"
    capabilities: ClassVar[Capabilities] = Capabilities(
        as_user=True,
        gpus=True,
        resources=True,
        image=True,
        network=True,
        recover=True,
        list_labelled=True,
        task_offer=True,
    )

    def __init__(
        self,
        *,
        image: str = DEFAULT_IMAGE,
        allowed_images: Iterable[str] | str = (),
        pull: PullPolicy = "if-not-present",
        network: str = "none",
        allowed_networks: Iterable[str] | str = (),
        read_only: bool = False,
        tmpfs_tmp: bool | str = False,
        cpus: float | str | None = None,
        memory: int | str | None = None,
        pids: int | str | None = None,
        shm: int | str | None = None,
        users: Mapping[str, str] | str | None = None,
        runtime: str | None = None,
        code_dirs: Iterable[str] | str = (),
        mount_pythonpath: bool = True,
        docker_host: str | None = None,
        python: str = "python3",
        init: bool = True,
        bundle: str | None = None,
    ) -> None:
        if pull not in PULL_POLICIES:
            raise RunnerError(f"{self.name} runner: pull must be one of {PULL_POLICIES}, got {pull!r}")
        self.image = image
        self._interpreters: dict[str, Interpreter] = {}  # image id -> its python (pip environments)
        self.allowed_images = option_list(allowed_images)
        self.pull = pull
        self.network = network
        self.allowed_networks = (network, *option_list(allowed_networks))
        self.read_only = read_only
        self.tmpfs_tmp = tmpfs_tmp
        self.default_limits = parse_defaults(self.name, cpus=cpus, memory=memory, pids=pids, shm=shm)
        self.users = _users(users)
        self.runtime = runtime
        self.code_dirs = tuple(str(Path(d).resolve()) for d in option_list(code_dirs))
        self.mount_pythonpath = mount_pythonpath
        self.docker_host = docker_host
        self.python = python
        self.init = init
        self._bundle = Path(bundle) if bundle else None
        self._client: docker.DockerClient | None = None
        self._lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------

    def task_offer(self) -> dict[str, Any]:
        """The engine holds a container's memory and CPU limits: up to the host's."""
        import psutil

        return {"memory": int(psutil.virtual_memory().total), "cpus": os.cpu_count() or 1}

    def check(self) -> None:
        """Engine reachable, runtime registered, default image present (or pulled), bundle built."""
        client = self._engine()
        self._check_runtime(client)
        try:
            self._ensure_image(self.image)
        except RunnerUnavailable:
            raise
        except RunnerError as exc:
            raise RunnerUnavailable(str(exc)) from exc
        self._bundle_path()

    def start(self, task: Task) -> Handle:
        client = self._engine()
        image = str(task.run_config.get("image") or self.image)
        if not policy.image_allowed(image, self.image, self.allowed_images):
            raise RunnerError(
                f"{self.name} runner: image {image!r} is not allowed on this node "
                f"(default {self.image!r}; allowed_images {list(self.allowed_images)})"
            )
        network = str(task.run_config.get("network") or self.network)
        if network not in self.allowed_networks:
            raise RunnerError(
                f"{self.name} runner: network {network!r} is not allowed on this node "
                f"(allowed: {list(self.allowed_networks)})"
            )
        limits = self.limits(task.run_config.get("resources"))  # refused before any pull
        self._ensure_image(image)
        workdir = Path(task.workdir).resolve()
        kwargs = self._create_kwargs(task, workdir, image, network, limits)
        what = f"{self.name} runner: invocation {task.invocation_id}"
        for tries in range(2):
            existing = self._existing(kwargs["name"], task, workdir)
            if existing is not None:
                log.warning(
                    "invocation %s: container %s of this attempt exists (an earlier start's answer was "
                    "lost); adopting it",
                    task.invocation_id,
                    existing[:12],
                )
                return self._handle(task, existing, image, workdir, kwargs)
            try:
                with engine.translated(f"{what}: create container", self.docker_host):
                    try:
                        container = client.containers.create(image, **kwargs)
                    except docker.errors.NotFound as exc:
                        raise RunnerError(f"{what}: image {image!r} vanished: {engine.explain(exc)}") from exc
                break
            except RunnerUnavailable:
                raise
            except RunnerError as exc:
                # the name was taken since we looked (an earlier create of this attempt landed): again
                if tries or not engine.is_conflict(exc):
                    raise
        try:
            with engine.translated(f"{what}: start container", self.docker_host):
                container.start()
        except RunnerUnavailable:
            raise  # it may have started: kept for the start tried again, which finds it by name
        except RunnerError:
            self._remove(container.id)
            raise
        log.debug("invocation %s: started container %s (%s)", task.invocation_id, container.short_id, image)
        return self._handle(task, str(container.id), image, workdir, kwargs)

    def _handle(self, task: Task, cid: str, image: str, workdir: Path, kwargs: Mapping[str, Any]) -> Handle:
        return Handle(
            runner=self.name,
            invocation_id=task.invocation_id,
            attempt=task.attempt,
            data={
                "container_id": cid,
                "image": image,
                "workdir": str(workdir),
                "script": task.script is not None,
                "mem_limit": kwargs.get("mem_limit"),
            },
        )

    def _existing(self, name: str, task: Task, workdir: Path) -> str | None:
        """The id of this attempt's container when an earlier start already started it.

        Containers are named after the invocation and attempt, so a start tried again after an
        answer was lost (the engine created, or even started, the container, but the reply never
        came) finds the first one instead of making a second. One that never started is removed
        (created again below, from this task); a started one is this task, adopted: never twice.
        One of that name that is not this task's (other labels) is refused.
        """
        with engine.translated(f"{self.name} runner: inspect {name}", self.docker_host):
            try:
                info = self._engine().api.inspect_container(name)
            except docker.errors.NotFound:
                return None
        cid = str(info.get("Id") or name)
        labels = (info.get("Config") or {}).get("Labels") or {}
        mine = (
            labels.get("nymph.invocation") == task.invocation_id
            and labels.get("nymph.attempt") == str(task.attempt)
            and labels.get("nymph.runner") == self.name
            and labels.get("nymph.workdir") == str(workdir)
        )
        if not mine:
            raise RunnerError(
                f"{self.name} runner: a container named {name!r} ({cid[:12]}) exists and is not this "
                f"task's (labels {labels}); remove it (docker rm -f {name})"
            )
        state = info.get("State") or {}
        if state.get("Status") == "created":  # never started
            self._remove(cid)
            return None
        return cid

    def wait(self, handle: Handle, timeout: float | None = None) -> ExitStatus | None:
        state = self._state(handle)
        if state is None:
            return ExitStatus(
                exit_code=-1,
                reason="container gone (removed outside nymph)",
                logs=log_tail(handle_workdir(handle)),
            )
        if _is_running(state):
            if timeout is not None and timeout <= 0:
                return None
            if not self._block_until_exit(handle, timeout):
                return None
            state = self._state(handle)
            if state is None:
                return ExitStatus(exit_code=-1, reason="container gone while waiting", logs=None)
        return self._exit_status(handle, state)

    def stop(self, handle: Handle, grace_s: float) -> None:
        """SIGTERM (through the init process), ``grace_s`` to exit, then SIGKILL."""
        cid = str(handle.data["container_id"])
        handle.data["stopped_by_nymph"] = True  # a SIGKILL that follows is ours, not the OOM killer's
        if not self._signal(cid, "SIGTERM"):
            return
        if self._block_until_exit(handle, max(grace_s, 0.001)):
            return
        self._signal(cid, "SIGKILL")
        if not self._block_until_exit(handle, _KILL_WAIT_S):
            log.warning("invocation %s: container %s survived SIGKILL", handle.invocation_id, cid[:12])

    def destroy(self, handle: Handle) -> None:
        self._remove(str(handle.data["container_id"]))

    def inspect(self, handle: Handle) -> str:
        state = self._state(handle)
        if state is None:
            return "gone"
        return "running" if _is_running(state) else "exited"

    def recover(self, handle: Handle) -> bool:
        """True when the container still exists (running or exited): nymph then waits and reads outputs."""
        return self._state(handle) is not None

    def list_labelled(self, worker_id: str | None = None) -> list[Handle]:
        """Handles of every container this runner kind started (of ``worker_id`` when given).

        For start-up reconciliation: containers of a previous life whose workdir is gone can still
        be found, waited on or destroyed.
        """
        filters = [f"nymph.runner={self.name}", "nymph.invocation"]
        if worker_id is not None:
            filters.append(f"nymph.worker={worker_id}")
        client = self._engine()
        with engine.translated(f"{self.name} runner: list containers", self.docker_host):
            found = client.api.containers(all=True, filters={"label": filters})
        handles = []
        for row in found:
            labels = row.get("Labels") or {}
            try:
                attempt = int(labels.get("nymph.attempt", "0"))
            except ValueError:
                attempt = 0
            handles.append(
                Handle(
                    runner=self.name,
                    invocation_id=labels["nymph.invocation"],
                    attempt=attempt,
                    data={
                        "container_id": row["Id"],
                        "image": row.get("Image", ""),
                        "workdir": labels.get("nymph.workdir", ""),
                        "script": labels.get("nymph.script") == "1",
                    },
                )
            )
        return handles

    # --- hooks for subclasses (gvisor) ----------------------------------------------------------

    _runtime_hint = "register it in /etc/docker/daemon.json and reload dockerd"

    def pip_interpreter(self, run_config: Mapping[str, Any]) -> Interpreter:
        """The image's ``python3`` a pip environment is built for (nymph.envcache): asked once
        per image id, in a throwaway container with no network, no capabilities, as nobody."""
        image = str(run_config.get("image") or self.image)
        if not policy.image_allowed(image, self.image, self.allowed_images):
            raise RunnerError(f"{self.name} runner: image {image!r} is not allowed on this node")
        self._ensure_image(image)
        client = self._engine()
        what = f"{self.name} runner: image {image!r}: asking its python"
        with engine.translated(what, self.docker_host):
            image_id = str(client.api.inspect_image(image)["Id"])
            found = self._interpreters.get(image_id)
            if found is not None:
                return found
            out = client.containers.run(
                image,
                ["-I", "-c", probe_source()],
                entrypoint=[self.python],
                remove=True,
                network_mode="none",
                user="65534:65534",
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                **({"runtime": self.runtime} if self.runtime else {}),
            )
        import json

        try:
            found = Interpreter.from_probe(json.loads(bytes(out).decode()))
        except (ValueError, KeyError) as exc:
            raise RunnerError(f"{what}: no answer it could read ({exc}): {bytes(out)[:200]!r}") from exc
        self._interpreters[image_id] = found
        return found

    def _check_runtime(self, client: docker.DockerClient) -> None:
        """Raise RunnerUnavailable when ``self.runtime`` is not registered with the engine."""
        if self.runtime is None:
            return
        with engine.translated(f"{self.name} runner: docker info", self.docker_host):
            runtimes = client.info().get("Runtimes") or {}
        if self.runtime not in runtimes:
            raise RunnerUnavailable(
                f"{self.name} runner: the Docker engine at {engine.engine_location(self.docker_host)} has "
                f"no {self.runtime!r} runtime (it has {sorted(runtimes)}): {self._runtime_hint}"
            )

    def limits(self, resources: Any) -> dict[str, Any]:
        """docker SDK ``create`` keywords for a task's ``run_config.resources`` over the defaults."""
        wanted: Resources = parse_resources(resources, self.name).over(self.default_limits)
        return policy.limits(wanted)

    def close(self) -> None:
        """Close the engine client (its connection pool); containers keep running."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # --- helpers --------------------------------------------------------------------------------

    def _engine(self) -> docker.DockerClient:
        with self._lock:
            if self._client is None:
                self._client = engine.connect(self.docker_host, f"{self.name} runner")
            return self._client

    def _bundle_path(self) -> Path:
        if self._bundle is None:
            try:
                from dreamlake.lakeshore.daemon.bundle import bundle_path

                self._bundle = bundle_path()
            except (OSError, ImportError) as exc:
                raise RunnerUnavailable(f"{self.name} runner: cannot build the entry bundle: {exc}") from exc
        return self._bundle

    def _ensure_image(self, image: str) -> None:
        """Make ``image`` present per the pull policy, or raise RunnerError saying how to get it."""
        client = self._engine()
        what = f"{self.name} runner: image {image!r}"
        present = True
        if self.pull != "always":
            with engine.translated(what, self.docker_host):
                try:
                    client.api.inspect_image(image)
                except docker.errors.ImageNotFound:
                    present = False
        if present and self.pull != "always":
            return
        if self.pull == "never":
            raise RunnerError(
                f"{what} is not present on the engine and pull='never': load it on this node "
                f"(docker load / docker import; scripts/services/docker.sh builds {DEFAULT_IMAGE}) "
                f"or set pull='if-not-present'"
            )
        log.info("%s: pulling", what)
        try:
            with engine.translated(f"{what}: pull", self.docker_host):
                client.images.pull(image)
        except docker.errors.NotFound as exc:
            raise RunnerError(f"{what} cannot be pulled: {engine.explain(exc)}") from exc
        except RunnerUnavailable:
            raise
        except RunnerError as exc:
            raise RunnerError(
                f"{what} is not present and cannot be pulled ({exc}); load it on this node"
            ) from exc

    def _create_kwargs(
        self, task: Task, workdir: Path, image: str, network: str, limits: Mapping[str, Any]
    ) -> dict[str, Any]:
        env = {k: v for k, v in task.env.items() if k != "PYTHONPATH"}
        task_path = task.env.get("PYTHONPATH")
        code = policy.code_paths(self.code_dirs, task_path if self.mount_pythonpath else None)
        env["PYTHONPATH"] = policy.pythonpath(BUNDLE_TARGET, code, task_path)
        mounts = [
            Mount(target=WORKDIR_TARGET, source=str(workdir), type="bind", read_only=False),
            Mount(target=BUNDLE_TARGET, source=str(self._bundle_path()), type="bind", read_only=True),
        ]
        mounts += [Mount(target=d, source=d, type="bind", read_only=True) for d in code]
        shipped = code_mounts(task)  # the code archives the call shipped, first on the import path
        mounts += [Mount(target=target, source=host, type="bind", read_only=True) for host, target in shipped]
        env.update(code_path_env(shipped))
        for name, (source, read_only) in task.mounts.items():  # the operator's, asked for by name
            if source.startswith("pvc:"):
                raise RunnerError(
                    f"{self.name} runner: mount {name!r} is a PersistentVolumeClaim ({source}), which only "
                    "the kube runner mounts; declare a host path for it on this worker"
                )
            mounts.append(
                Mount(target=f"{MOUNT_TARGET}/{name}", source=source, type="bind", read_only=read_only)
            )
            env[mount_env_name(name)] = f"{MOUNT_TARGET}/{name}"
        kwargs: dict[str, Any] = {
            "environment": env,
            "working_dir": WORKDIR_TARGET,
            "mounts": mounts,
            "user": policy.container_user(task.as_user, self.users, workdir),
            "labels": self._labels(task, workdir),
            "network_mode": network,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "privileged": False,
            "read_only": self.read_only,
            "init": self.init,
            "stdin_open": False,
            "tty": False,
            "name": task_name(task),  # one per attempt: a start tried again finds it
        }
        if task.script is not None:
            kwargs["entrypoint"] = ["sh"]
            kwargs["command"] = ["-c", SCRIPT_SHIM, "sh", task.script]
        else:
            kwargs["entrypoint"] = [self.python]
            kwargs["command"] = ["-m", ENTRY_MODULE]
        if self.tmpfs_tmp:
            size = "" if self.tmpfs_tmp is True else f",size={self.tmpfs_tmp}"
            kwargs["tmpfs"] = {"/tmp": f"rw,nosuid,nodev,mode=1777{size}"}
        if self.runtime:
            kwargs["runtime"] = self.runtime
        kwargs.update(limits)
        if task.gpus:
            kwargs["device_requests"] = [DeviceRequest(device_ids=list(task.gpus), capabilities=[["gpu"]])]
            env["CUDA_VISIBLE_DEVICES"] = _container_gpu_ids(task.gpus)
        return kwargs

    def _labels(self, task: Task, workdir: Path) -> dict[str, str]:
        labels = {str(k): str(v) for k, v in task.labels.items()}
        labels.update(
            {
                "nymph.invocation": task.invocation_id,
                "nymph.attempt": str(task.attempt),
                "nymph.runner": self.name,
                "nymph.workdir": str(workdir),
                "nymph.script": "1" if task.script is not None else "0",
            }
        )
        labels.setdefault("nymph.worker", "")
        return labels

    def _state(self, handle: Handle) -> dict[str, Any] | None:
        """The container's ``State`` from the engine, None when it does not exist."""
        return engine.state(self._engine(), str(handle.data["container_id"]), self._where())

    def _block_until_exit(self, handle: Handle, timeout: float | None) -> bool:
        return engine.wait_exit(self._engine(), str(handle.data["container_id"]), timeout, self._where())

    def _signal(self, cid: str, signal: str) -> bool:
        return engine.send_signal(self._engine(), cid, signal, self._where())

    def _remove(self, cid: str) -> None:
        engine.remove(self._engine(), cid, self._where())

    def _where(self) -> engine.Where:
        return engine.Where(f"{self.name} runner", self.docker_host)

    def _exit_status(self, handle: Handle, state: Mapping[str, Any]) -> ExitStatus:
        code = int(state.get("ExitCode", -1))
        reason: str | None = None
        if state.get("OOMKilled"):
            reason = "OOMKilled"
        elif code == 137 and handle.data.get("mem_limit") and not handle.data.get("stopped_by_nymph"):
            # Under runsc the sandbox itself may kill the task at the limit, and the engine does not
            # always flag that: a SIGKILL nobody here sent, under a memory limit, is the limit.
            reason = (
                f"OOMKilled (inferred: SIGKILL under the memory limit of {handle.data['mem_limit']} bytes)"
            )
        elif code > 128 and not handle.data.get("script"):
            reason = f"signal {code - 128}"  # the entry itself only exits 0, 1 or 2
        if state.get("Error"):
            reason = f"{reason}; {state['Error']}" if reason else str(state["Error"])
        workdir = handle_workdir(handle)
        logs: str | None = None
        client = self._engine()
        with engine.translated(f"{self.name} runner: logs", self.docker_host):
            try:
                collect_logs(client.api, str(handle.data["container_id"]), workdir)
            except docker.errors.NotFound:
                pass
        logs = log_tail(workdir)
        return ExitStatus(exit_code=code, reason=reason, logs=logs)


def _users(value: Mapping[str, str] | str | None) -> dict[str, str]:
    """The ``users`` option; a string is ``name=uid:gid,name2=uid:gid``."""
    users = option_mapping(value, "users")
    for name, ids_ in users.items():
        if not ids_:
            raise RunnerError(f"users: expected name=uid:gid, got {name!r} with no uid:gid")
    return users


def _is_running(state: Mapping[str, Any]) -> bool:
    return bool(state.get("Running")) or state.get("Status") in ("restarting", "paused")


def _container_gpu_ids(gpus: Iterable[str]) -> str:
    """CUDA_VISIBLE_DEVICES inside the container: UUIDs stay, host indices renumber from 0."""
    ids = list(gpus)
    if all(g.startswith(("GPU-", "MIG-")) for g in ids):
        return ",".join(ids)
    return ",".join(str(i) for i in range(len(ids)))
