"""nymph's ``gvisor`` runner: the docker runner with gVisor's ``runsc`` runtime, for untrusted code.

Each invocation runs in a container whose kernel is gVisor's user-space kernel (``runsc``), so the
function's system calls never reach the host kernel directly. Everything else is the
:class:`~nymph_docker.DockerRunner` (mounts, entry bundle, labels, handle, stop ladder); only the
defaults differ, towards untrusted code:

- ``runtime="runsc"``; :meth:`GVisorRunner.check` verifies the engine lists it (``docker info``
  Runtimes) and otherwise says exactly how to register it.
- ``network="none"``, ``cap_drop ALL``, ``no-new-privileges`` (as for docker, never relaxed here).
- ``read_only=True`` root filesystem with an explicit tmpfs on ``/tmp``: under runsc a read-only root
  still leaves ``/tmp`` writable on the root filesystem unless a tmpfs is mounted there.
- ``pids >= 1024``: gVisor's own threads (about 40) count against the pids cgroup, and a lower limit
  crashes the sandbox; lower values (the default or ``run_config.resources.pids``) are raised to
  :data:`MIN_PIDS` and logged.

Register runsc with the engine (``/etc/docker/daemon.json``; ``--network=none`` is needed on hosts
where runsc mistakes its network namespace for the host's), then reload dockerd with SIGHUP::

    {"runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}}}

Never use ``--platform=kvm`` without hardware virtualisation: the sandbox spins and cannot be removed.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from nymph_docker import DockerRunner

log = logging.getLogger(__name__)

__all__ = ["MIN_PIDS", "REGISTER_HINT", "GVisorRunner"]

MIN_PIDS = 1024
RUNTIME = "runsc"
REGISTER_HINT = (
    'add {"runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}}} to '
    "/etc/docker/daemon.json (merge with what is there; scripts/services/docker.sh does it), then "
    "reload the engine with `kill -HUP $(pidof dockerd)`; install runsc with `apt-get install runsc`"
)


class GVisorRunner(DockerRunner):
    """The docker runner under gVisor (runsc), with untrusted-code defaults."""

    name: ClassVar[str] = "gvisor"
    _runtime_hint = REGISTER_HINT

    def __init__(
        self,
        *,
        runtime: str = RUNTIME,
        read_only: bool = True,
        tmpfs_tmp: bool | str = "256m",
        pids: int | None = MIN_PIDS,
        **options: Any,
    ) -> None:
        super().__init__(runtime=runtime, read_only=read_only, tmpfs_tmp=tmpfs_tmp, pids=pids, **options)
        if read_only and not tmpfs_tmp:
            log.warning("gvisor runner: read_only without tmpfs_tmp leaves /tmp writable under runsc")

    def limits(self, resources: Any) -> dict[str, Any]:
        out = super().limits(resources)
        pids = out.get("pids_limit")
        if pids is None or pids < MIN_PIDS:
            if pids is not None:
                log.info(
                    "gvisor runner: pids limit %d raised to %d (gVisor's own threads count against it)",
                    pids,
                    MIN_PIDS,
                )
            out["pids_limit"] = MIN_PIDS
        return out
