"""GPU discovery through a fake ``nvidia-smi`` (a real executable on PATH), and the device pool."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from nymph.gpus import Gpu, GpuPool, discover_gpus, parse_override, visible_devices

SMI_OUTPUT = """\
0, GPU-11111111-2222-3333-4444-555555555555, NVIDIA H200, 143771
1, GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee, NVIDIA H200, 143771
"""


@pytest.fixture(autouse=True)
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    # Discovery prefers NVML when pynvml is installed; these tests are about the nvidia-smi path.
    monkeypatch.setitem(sys.modules, "pynvml", None)


def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stdout: str, rc: int = 0) -> Path:
    """Put an executable ``nvidia-smi`` first on PATH that records its args and prints ``stdout``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "out.txt").write_text(stdout)
    script = bindir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > "{tmp_path}/args.txt"\n'
        f'cat "{tmp_path}/out.txt"\n'
        f'[ {rc} -eq 0 ] || echo "NVIDIA-SMI has failed because it couldn\'t communicate" >&2\n'
        f"exit {rc}\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return tmp_path / "args.txt"


def test_discovers_gpus_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = fake_smi(tmp_path, monkeypatch, SMI_OUTPUT)
    gpus = discover_gpus()
    assert gpus == [
        Gpu(0, "GPU-11111111-2222-3333-4444-555555555555", "NVIDIA H200", 143771),
        Gpu(1, "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "NVIDIA H200", 143771),
    ]
    assert "--query-gpu=index,uuid,name,memory.total" in args.read_text()
    assert "--format=csv,noheader,nounits" in args.read_text()


def test_odd_lines_are_tolerated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, "1, GPU-b, Tesla T4, [N/A]\n\ngarbage\n0, GPU-a, Weird, Name, 16000\n")
    assert discover_gpus() == [Gpu(0, "GPU-a", "Weird, Name", 16000), Gpu(1, "GPU-b", "Tesla T4", 0)]


def test_no_driver_means_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, "", rc=9)
    assert discover_gpus() == []


def test_no_nvidia_smi_means_no_gpus(tmp_path: Path) -> None:
    assert discover_gpus(smi=str(tmp_path / "absent-nvidia-smi")) == []


def test_operator_override_selects_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, SMI_OUTPUT)
    assert [g.id for g in discover_gpus(override="1")] == ["1"]
    assert discover_gpus(override="none") == []
    assert discover_gpus(override="") == []
    assert [g.id for g in discover_gpus(override="all")] == ["0", "1"]


def test_override_offers_devices_discovery_cannot_see(tmp_path: Path) -> None:
    gpus = discover_gpus(smi=str(tmp_path / "absent"), override="0, 2")
    assert [g.id for g in gpus] == ["0", "2"]


def test_override_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="NYMPH_GPUS"):
        parse_override("0,gpu1")


def test_pool_hands_out_distinct_devices_until_empty() -> None:
    pool = GpuPool([Gpu(i, f"u{i}", "g", 1) for i in (2, 0, 1)])
    assert pool.free == 3
    first = pool.acquire(2)
    assert first == ["0", "1"]
    assert pool.acquire(2) is None  # not enough: nothing taken
    assert pool.free == 1
    assert pool.acquire(1) == ["2"]
    assert pool.acquire(0) == []
    pool.release(first)
    pool.release(first)  # idempotent
    assert pool.free == 2
    assert pool.acquire(2) == ["0", "1"]
    with pytest.raises(ValueError, match="not in this pool"):
        pool.release(["7"])


def test_claim_reattaches_specific_devices() -> None:
    pool = GpuPool([Gpu(i, "", "g", 1) for i in range(3)])
    assert pool.claim(["1"])
    assert not pool.claim(["0", "1"])  # 1 is busy: nothing taken
    assert pool.free == 2
    assert pool.acquire(2) == ["0", "2"]


def test_pool_never_gives_a_device_twice_under_contention() -> None:
    pool = GpuPool([Gpu(i, "", "g", 1) for i in range(8)])
    got: list[str] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(50):
            ids = pool.acquire(1)
            if ids:
                with lock:
                    got.extend(ids)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [str(i) for i in range(8)]
    assert pool.free == 0


def test_visible_devices() -> None:
    assert visible_devices(["0", "3"]) == "0,3"
    assert visible_devices([]) == ""
