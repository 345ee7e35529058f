"""Concurrency slots and GPU assignment.

nymph claims work only while a slot is free: the poll asks for at most :meth:`Slots.free`
invocations, and each claimed invocation holds one slot until it is acked. GPUs are a second,
finer resource: each poll offers the devices free now (:meth:`Slots.free_gpus`) and the control
plane hands out only calls that fit (docs/protocol.md "Placement"), so an invocation whose
``run_config.resources.gpus`` (or ``nvidia.com/gpu``) is N takes N devices of the
:class:`nymph.gpus.GpuPool` when its run command arrives (:meth:`Slots.take_gpus`, before the next
poll offers them again) and gets them as ``CUDA_VISIBLE_DEVICES``. It never waits for devices
another call holds: one that finds too few free (a control plane older than placement) fails at
once with NotEnoughGpus.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from dreamlake.lakeshore.gpucount import gpus_of
from nymph.errors import NotEnoughGpus as NotEnoughGpus  # re-exported: raised here

log = logging.getLogger(__name__)


class GpuPoolLike(Protocol):
    def acquire(self, n: int) -> list[str] | None: ...
    def release(self, ids: list[str]) -> None: ...


def gpus_requested(run_config: dict[str, Any]) -> int:
    """The devices a call asks for, read as the control plane placed it (``gpus`` or its alias
    ``nvidia.com/gpu``: :func:`dreamlake.lakeshore.gpucount.gpus_of`); 0 for a value that is no
    count (the runner refuses it, naming the field)."""
    try:
        return gpus_of(run_config.get("resources"))
    except ValueError:
        return 0


class Slots:
    """A counter of free slots plus the GPU pool; thread-safe."""

    def __init__(self, concurrency: int, gpu_pool: GpuPoolLike | None = None, gpu_total: int = 0) -> None:
        self.concurrency = concurrency
        self._busy = 0
        self._cond = threading.Condition()
        self._gpus = gpu_pool
        self.gpu_total = gpu_total

    def free(self) -> int:
        with self._cond:
            return self.concurrency - self._busy

    def take(self) -> bool:
        """Take one slot if one is free."""
        with self._cond:
            if self._busy >= self.concurrency:
                return False
            self._busy += 1
            return True

    def force_take(self) -> None:
        """Take a slot even when none is free (re-attached work, a late claim)."""
        with self._cond:
            self._busy += 1

    def put(self) -> None:
        with self._cond:
            self._busy = max(0, self._busy - 1)
            self._cond.notify_all()

    def wait_free(self, timeout_s: float) -> bool:
        """Block until a slot is free (True) or the timeout passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy < self.concurrency, timeout_s)

    def free_gpus(self) -> int:
        """Devices free now (what a poll offers)."""
        if self._gpus is None:
            return 0
        with self._cond:
            return int(getattr(self._gpus, "free", 0))

    def take_gpus(self, n: int) -> list[str] | None:
        """N free device ids now, or None when fewer are free (nothing taken)."""
        if n <= 0:
            return []
        if self._gpus is None:
            return None
        with self._cond:
            return self._gpus.acquire(n)

    def acquire_gpus(self, n: int) -> list[str]:
        """N device ids free now; NotEnoughGpus when the host has fewer, or they are held."""
        if n == 0:
            return []
        if self._gpus is None or n > self.gpu_total:
            raise NotEnoughGpus(f"asks for {n} GPU(s), this host offers {self.gpu_total}")
        got = self.take_gpus(n)
        if got is None:
            raise NotEnoughGpus(
                f"asks for {n} GPU(s); {self.free_gpus()} of this host's {self.gpu_total} are free"
            )
        return got

    def claim_gpus(self, ids: list[str]) -> bool:
        """Take exactly ``ids`` again (a task re-attached after a restart keeps its devices)."""
        if not ids or self._gpus is None:
            return not ids
        with self._cond:
            claim = getattr(self._gpus, "claim", None)
            return bool(claim(ids)) if claim is not None else False

    def release_gpus(self, ids: list[str]) -> None:
        if ids and self._gpus is not None:
            with self._cond:
                self._gpus.release(ids)
                self._cond.notify_all()
