"""NVIDIA GPU discovery and the pool nymph assigns devices from.

Discovery tries NVML (``pynvml``, optional) and falls back to ``nvidia-smi``; a host without a GPU,
a driver or either tool has no GPUs, which is not an error. An operator can override what nymph
offers with a list of device indices (``NYMPH_GPUS="0,1"``; ``""`` or ``"none"`` for none), passed
in by the CLI as ``discover_gpus(override=...)``.

Devices are identified by their index as a string ("0", "1", ...), which is what
``CUDA_VISIBLE_DEVICES`` takes (:func:`visible_devices`). :class:`GpuPool` hands out whole devices
to invocations, thread-safely.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SMI_QUERY = ["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
SMI_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_mib: int

    @property
    def id(self) -> str:
        """The identifier the pool and CUDA_VISIBLE_DEVICES use: the index as a string."""
        return str(self.index)


def parse_smi_csv(text: str) -> list[Gpu]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits``."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            log.warning("ignoring unparseable nvidia-smi line %r", line)
            continue
        index, uuid, memory = parts[0], parts[1], parts[-1]
        name = ", ".join(parts[2:-1])  # a name with a comma in it survives
        try:
            idx = int(index)
        except ValueError:
            log.warning("ignoring nvidia-smi line with a bad index %r", line)
            continue
        try:
            mem = int(float(memory))
        except ValueError:  # "[N/A]" on some devices
            mem = 0
        gpus.append(Gpu(idx, uuid, name, mem))
    return sorted(gpus, key=lambda g: g.index)


def _from_nvml() -> list[Gpu] | None:
    """GPUs through NVML, or None when pynvml or the driver is not there."""
    try:
        import pynvml
    except ImportError:
        return None
    nvml: Any = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError: no driver, no device
        log.debug("NVML unavailable: %s", exc)
        return None
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name, uuid = nvml.nvmlDeviceGetName(h), nvml.nvmlDeviceGetUUID(h)
            gpus.append(
                Gpu(
                    index=i,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024),
                )
            )
        return gpus
    except Exception as exc:
        log.warning("NVML query failed, trying nvidia-smi: %s", exc)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _from_smi(smi: str) -> list[Gpu]:
    exe = shutil.which(smi)
    if exe is None:
        log.debug("%s not found: no GPUs", smi)
        return []
    try:
        proc = subprocess.run(
            [exe, *SMI_QUERY], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("%s failed, assuming no GPUs: %s", exe, exc)
        return []
    if proc.returncode != 0:
        # No driver loaded or no device: nvidia-smi exits non-zero with a message.
        log.warning("%s exited %d, assuming no GPUs: %s", exe, proc.returncode, proc.stderr.strip()[-300:])
        return []
    return parse_smi_csv(proc.stdout)


def parse_override(override: str) -> list[int] | None:
    """Parse ``NYMPH_GPUS``: "0,1" -> [0, 1]; "" or "none" -> []; "all" -> None (everything found)."""
    text = override.strip().lower()
    if text == "all":
        return None
    if text in ("", "none"):
        return []
    indices: list[int] = []
    for token in text.split(","):
        token = token.strip()
        if not token:
            continue
        if not token.isdigit():
            raise ValueError(
                f"NYMPH_GPUS must be device indices like '0,1', 'none' or 'all'; got {override!r}"
            )
        if int(token) not in indices:
            indices.append(int(token))
    return indices


def discover_gpus(smi: str = "nvidia-smi", override: str | None = None) -> list[Gpu]:
    """The GPUs nymph may hand out, sorted by index; [] when there are none.

    ``override`` is the operator's list (``NYMPH_GPUS``). Indices that discovery does not find are
    still offered (with an unknown name), so an override works where discovery cannot, and a
    warning says so.
    """
    wanted = parse_override(override) if override is not None else None
    if wanted == []:
        return []
    found = _from_nvml()
    if found is None:
        found = _from_smi(smi)
    if wanted is None:
        return found
    by_index = {g.index: g for g in found}
    chosen = []
    for idx in wanted:
        gpu = by_index.get(idx)
        if gpu is None:
            log.warning("NYMPH_GPUS lists device %d, which discovery did not find; offering it anyway", idx)
            gpu = Gpu(idx, "", "unknown", 0)
        chosen.append(gpu)
    return sorted(chosen, key=lambda g: g.index)


def visible_devices(ids: Iterable[str]) -> str:
    """The CUDA_VISIBLE_DEVICES value for the devices ``ids``."""
    return ",".join(ids)


class GpuPool:
    """Whole devices handed to invocations; thread-safe. Ids are the devices' index strings."""

    def __init__(self, gpus: Iterable[Gpu]) -> None:
        self.devices = sorted(gpus, key=lambda g: g.index)  # what registration reports
        self._all = [g.id for g in self.devices]
        self._free = list(self._all)
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return len(self._all)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def acquire(self, n: int) -> list[str] | None:
        """Take ``n`` free devices (lowest indices first); None when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot acquire {n} GPUs")
        with self._lock:
            if len(self._free) < n:
                return None
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def claim(self, ids: Iterable[str]) -> bool:
        """Take exactly ``ids`` (re-attaching after a restart); False, taking nothing, if one is busy."""
        wanted = list(ids)
        self._check_known(wanted)
        with self._lock:
            if any(i not in self._free for i in wanted):
                return False
            self._free = [i for i in self._free if i not in wanted]
            return True

    def release(self, ids: Iterable[str]) -> None:
        """Give devices back. Releasing a device that is already free does nothing."""
        given = list(ids)
        self._check_known(given)
        with self._lock:
            for i in given:
                if i not in self._free:
                    self._free.append(i)
            self._free.sort(key=self._all.index)

    def _check_known(self, ids: list[str]) -> None:
        unknown = [i for i in ids if i not in self._all]
        if unknown:
            raise ValueError(
                f"GPU(s) {', '.join(unknown)} are not in this pool ({', '.join(self._all) or 'empty'})"
            )


def capacity(pool: GpuPool | None) -> list[dict[str, Any]]:
    """The devices of ``pool`` as registration reports them (index, model, memory)."""
    if pool is None:
        return []
    return [{"index": g.index, "model": g.name, "memory_mib": g.memory_mib} for g in pool.devices]
