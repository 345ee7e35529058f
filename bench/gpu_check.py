"""Check GPU discovery and assignment on a real NVIDIA machine; prints what it finds.

Run from the repository root on a GPU host (only the standard library and the driver are needed)::

    python3 bench/gpu_check.py            # or NYMPH_GPUS=0 python3 bench/gpu_check.py

It runs :func:`nymph.gpus.discover_gpus`, then, for each device set the pool hands out (every
single device, all devices at once, and none), spawns a child with ``CUDA_VISIBLE_DEVICES`` set the
way nymph sets it and asks the CUDA driver itself (``libcuda`` through ctypes: no NVML, no
``nvidia-smi``, which ignores ``CUDA_VISIBLE_DEVICES``) which devices the child sees, by UUID. It
exits 0 when every child saw exactly the devices it was assigned, 1 otherwise, 2 with no GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nymph.gpus import Gpu, GpuPool, discover_gpus, visible_devices

# Runs in the child: list the devices the CUDA driver exposes, as nvidia-smi-style UUIDs.
CHILD = r"""
import ctypes, json, os
out = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "devices": [], "error": None}
try:
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuInit(0)
    if rc == 100:  # CUDA_ERROR_NO_DEVICE: nothing visible
        pass
    elif rc != 0:
        out["error"] = "cuInit returned %d" % rc
    else:
        n = ctypes.c_int()
        cuda.cuDeviceGetCount(ctypes.byref(n))
        for i in range(n.value):
            dev = ctypes.c_int()
            cuda.cuDeviceGet(ctypes.byref(dev), i)
            name = ctypes.create_string_buffer(256)
            cuda.cuDeviceGetName(name, 256, dev)
            raw = ctypes.create_string_buffer(16)
            get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
            get_uuid(raw, dev)
            h = raw.raw.hex()
            uuid = "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])
            out["devices"].append({"ordinal": i, "name": name.value.decode(), "uuid": uuid})
except OSError as exc:
    out["error"] = "cannot load libcuda.so.1: %s" % exc
print(json.dumps(out))
"""


def child_sees(ids: list[str]) -> dict[str, object]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible_devices(ids))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        return {"devices": [], "error": f"child exited {proc.returncode}: {proc.stderr[-500:]}"}
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def check(assigned: list[str], by_id: dict[str, Gpu]) -> bool:
    seen = child_sees(assigned)
    devices = seen.get("devices") or []
    assert isinstance(devices, list)
    want = [by_id[i].uuid for i in assigned]
    got = [d["uuid"] for d in devices]
    # An override may name a device discovery could not see (empty uuid): compare counts then.
    ok = seen.get("error") is None and (got == want if all(want) else len(got) == len(want))
    print(
        f"{'ok  ' if ok else 'FAIL'} CUDA_VISIBLE_DEVICES={visible_devices(assigned)!r:12} "
        f"want={want} child_sees={[(d['ordinal'], d['name'], d['uuid']) for d in devices]}"
        + (f" error={seen['error']}" if seen.get("error") else "")
    )
    return ok


def main() -> int:
    print(f"python {sys.version.split()[0]}, nvidia-smi at {shutil.which('nvidia-smi')}")
    if shutil.which("nvidia-smi"):
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
        print("nvidia-smi -L (ignores CUDA_VISIBLE_DEVICES):\n" + listing.stdout.rstrip())
    gpus = discover_gpus(override=os.environ.get("NYMPH_GPUS"))
    print(f"discover_gpus() -> {len(gpus)} GPU(s)")
    for g in gpus:
        print(f"  index={g.index} uuid={g.uuid} name={g.name!r} memory_mib={g.memory_mib}")
    if not gpus:
        print("no GPU found")
        return 2

    by_id = {g.id: g for g in gpus}
    pool = GpuPool(gpus)
    sets: list[list[str]] = []
    for _ in gpus:  # every device alone, in the order the pool hands them out
        ids = pool.acquire(1)
        assert ids is not None
        sets.append(ids)
    assert pool.acquire(1) is None, "the pool handed out more devices than it has"
    for ids in sets:
        pool.release(ids)
    everything = pool.acquire(len(gpus))
    assert everything is not None
    pool.release(everything)
    sets += [everything, []]

    results = [check(ids, by_id) for ids in sets]
    print(f"{sum(results)}/{len(results)} assignments seen as assigned")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
