"""Throughput of the value codec beside pickle (protocol 5) and raw msgpack, measured in one run.

Cases: a small dict, numpy float32 arrays of 1 KiB .. 64 MiB, and a mixed payload (dicts, tuples,
datetimes, a 256 KiB array). For arrays, "msgpack" is ``packb(arr.tobytes())`` / ``unpackb`` and
"memcpy" is ``bytearray(buffer)``, the floor. Each cell is the median (p90) time of one operation;
the ratio columns are wire / pickle and wire / msgpack (lower is better for wire).

    .venv/bin/python bench/wire.py          # about 30-60 s
    .venv/bin/python bench/wire.py --quick  # a few seconds, smaller arrays, fewer repetitions
    .venv/bin/python bench/wire.py --baseline-root /tmp/before  # also time another tree's wire.py

With ``--baseline-root`` (a copy of the tree before a change: ``cp -r dreamlake /tmp/before``) the
"vs base" columns are this wire's median over that wire's, both measured in this run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from dreamlake.lakeshore import wire


def measure(fn: Callable[[], Any], budget_s: float, min_reps: int) -> tuple[float, float]:
    """Median and p90 seconds per call; small calls are batched so a timing is at least ~1 ms."""
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    batch = max(1, int(1e-3 / once))
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch)
        if len(samples) >= 200:
            break
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def fmt(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def mixed_payload() -> Any:
    return {
        "rows": [{"id": i, "name": f"row-{i}", "pos": (i, i + 1), "score": i / 3} for i in range(200)],
        "when": dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        "tags": {"a", "b", "c"},
        "image": np.arange(64 * 1024, dtype=np.float32),
    }


def cases(quick: bool) -> list[tuple[str, Any, bool]]:
    sizes = [1 << 10, 64 << 10, 1 << 20] + ([] if quick else [16 << 20, 64 << 20])
    out: list[tuple[str, Any, bool]] = [("small dict", {"a": 1, "b": "two", "c": [1.5, None, True]}, False)]
    for n in sizes:
        label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
        out.append((f"ndarray {label}", np.random.default_rng(0).random(n // 4, dtype=np.float32), True))
    out.append(("mixed", mixed_payload(), False))
    return out


def load_baseline(root: Path) -> Any:
    """The wire module of another checkout, loaded beside this one under another name."""
    path = root / "dreamlake" / "lakeshore" / "wire.py"
    spec = importlib.util.spec_from_file_location("baseline_wire", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no wire.py at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_wire"] = module
    spec.loader.exec_module(module)
    return module


def row(name: str, value: Any, is_array: bool, budget: float, reps: int, base: Any = None) -> list[str]:
    p5 = pickle.dumps(value, protocol=5)
    w = wire.pack(value)
    raw = msgpack.packb(value.tobytes() if is_array else value, default=_raw_default)
    res = {
        "wire pack": measure(lambda: wire.pack(value), budget, reps),
        "wire unpack": measure(lambda: wire.unpack(w), budget, reps),
        "pickle pack": measure(lambda: pickle.dumps(value, protocol=5), budget, reps),
        "pickle unpack": measure(lambda: pickle.loads(p5), budget, reps),
        "msgpack pack": measure(
            (lambda: msgpack.packb(value.tobytes()))
            if is_array
            else (lambda: msgpack.packb(value, default=_raw_default)),
            budget,
            reps,
        ),
        "msgpack unpack": measure(lambda: msgpack.unpackb(raw, strict_map_key=False), budget, reps),
    }
    cells = [name, f"{len(w):,}"]
    for op in ("pack", "unpack"):
        wm = res[f"wire {op}"]
        cells += [f"{fmt(wm[0])} ({fmt(wm[1])})"]
        cells += [f"{fmt(res[f'pickle {op}'][0])}", f"{fmt(res[f'msgpack {op}'][0])}"]
        cells += [f"{wm[0] / res[f'pickle {op}'][0]:.2f}", f"{wm[0] / res[f'msgpack {op}'][0]:.2f}"]
    if is_array:
        buf = memoryview(value).cast("B")
        memcpy = measure(lambda: bytearray(buf), budget, reps)[0]
        cells.append(f"{fmt(memcpy)} ({len(w) / res['wire pack'][0] / 1e9:.1f} GB/s pack)")
    else:
        cells.append("")
    if base is not None:
        bp = measure(lambda: base.pack(value), budget, reps)[0]
        bu = measure(lambda: base.unpack(w), budget, reps)[0]
        cells += [
            f"{res['wire pack'][0] / bp:.2f} of {fmt(bp)}",
            f"{res['wire unpack'][0] / bu:.2f} of {fmt(bu)}",
        ]
    return cells


def _raw_default(obj: Any) -> Any:
    """Raw msgpack has no codecs: the nearest it can do with the mixed payload's extras."""
    if isinstance(obj, np.ndarray):
        return obj.tobytes()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, dt.datetime):
        return obj.isoformat()
    raise TypeError(type(obj))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller arrays, shorter budget")
    parser.add_argument("--baseline-root", type=Path, help="another checkout whose wire.py to time too")
    args = parser.parse_args()
    base = load_baseline(args.baseline_root) if args.baseline_root else None
    budget, reps = (0.05, 5) if args.quick else (0.4, 7)
    header = [
        "case",
        "wire bytes",
        "pack wire med (p90)",
        "pickle5",
        "msgpack",
        "x pickle",
        "x msgpack",
        "unpack wire med (p90)",
        "pickle5",
        "msgpack",
        "x pickle",
        "x msgpack",
        "memcpy",
    ] + (["pack vs base", "unpack vs base"] if base is not None else [])
    rows = [header] + [row(n, v, a, budget, reps, base) for n, v, a in cases(args.quick)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, r in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
