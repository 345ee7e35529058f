"""Arguments and results by reference (issue 13): throughput and peak memory, against raw S3.

A ``LocalStack`` (``lakeshore server`` + ``nymph start``, process runner, real processes on
loopback) with its payload store: the embedded blob directory (``--tier local``, the default: no
bucket) or the S3 server of ``LAKESHORE_TEST_S3_ENDPOINT`` (``--tier s3``). For each size:

* **args**: a fresh SDK process makes a ``uint8`` numpy array of that size and times
  ``array_total.submit(arr)`` to ``q.result(inv)`` (the Envelope goes up by ``args_ref``, nymph
  streams it into the workdir, the task sums it; the result is small);
* **result**: a fresh SDK process times ``make_array.submit(n)`` to ``q.result(inv)`` returning
  the array (nymph uploads ``result.msgpack``, the SDK downloads it by ``result_ref``);
* **raw S3**: ``boto3`` ``put_object`` + ``get_object`` of the same bytes to the same S3 server,
  in the same run: the floor of one upload plus one download, which each row also pays.

Memory: the SDK process reports its peak RSS (``ru_maxrss``) over what it held before the call (the
array for args; nothing for a result, whose array it then holds itself), in copies of the payload;
nymph's RSS (and its task processes') is sampled every 20 ms, reported as its peak over its idle
RSS. Goals: throughput >= 0.5 x raw S3 PUT+GET, at most one extra copy in the SDK (<= 1.0) and in
nymph (<= 1.0; nymph streams blobs to disk, so it should stay near 0).

    .venv/bin/python bench/payloads.py                          # 1, 64 and 1024 MiB, 3 reps
    .venv/bin/python bench/payloads.py --sizes 1,64 --reps 2 --tier s3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from _stats import median_p90

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MiB = 1024 * 1024
GOAL_RATIO = 0.5
GOAL_COPIES = 1.0
S3_BUCKET = "lakeshore-bench"


# -- the SDK side, in a process of its own (its peak RSS is the payload's alone) -------------------


def _rss_now() -> int:
    return int(psutil.Process().memory_info().rss)


def child(direction: str, size: int, url: str, token: str) -> None:
    import numpy as np

    import dreamlake.lakeshore as dls
    from dreamlake.lakeshore.dispatch import HttpDispatch

    sys.path.insert(0, str(BENCH))
    import bench_fns

    plane = HttpDispatch(url, token, timeout=600.0)
    q = dls.SyncQueue("bench", plane)
    total = dls.udf(queue="bench")(bench_fns.array_total)
    make = dls.udf(queue="bench")(bench_fns.make_array)
    plane.namespace()  # the whoami call, outside the timing
    plane._client.bare()  # and the token-less client's SSL context: fixed costs, not copies
    import dreamlake.lakeshore.blobs  # noqa: F401
    from dreamlake.lakeshore import wire

    wire.unpack(wire.pack([np.zeros(1)]))  # the array codecs' first load

    if direction == "args":
        arr = np.full(size, 7, dtype=np.uint8)
        base = _rss_now()
        t0 = time.perf_counter()
        out = q.result(total.submit(arr, _dispatch=plane), timeout=900)
        seconds = time.perf_counter() - t0
        assert out["sum"] == 7 * size, out
        held = 0
    else:
        base = _rss_now()
        t0 = time.perf_counter()
        arr = q.result(make.submit(size, _dispatch=plane), timeout=900)
        seconds = time.perf_counter() - t0
        assert arr.nbytes == size and int(arr[-1]) == 7
        held = size  # the result array is the value itself, not an extra copy
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "extra_bytes": max(0, peak - base - held)}))
    plane.close()


# -- the parent: the stack, the samplers, the baseline ---------------------------------------------


class Sampler:
    """Peak RSS of a process (``peak``) and, apart, of its descendants (``tasks``), every 20 ms."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.tasks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        try:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            children = self.proc.children(recursive=True)
        except psutil.Error:
            return
        total = 0
        for p in children:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        self.tasks = max(self.tasks, total)

    def __enter__(self) -> Sampler:
        self._sample()
        self.idle = self.peak
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def s3_client() -> Any | None:
    endpoint = os.environ.get("LAKESHORE_TEST_S3_ENDPOINT")
    if not endpoint:
        return None
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=os.environ.get("LAKESHORE_TEST_S3_ACCESS_KEY"),
        aws_secret_access_key=os.environ.get("LAKESHORE_TEST_S3_SECRET_KEY"),
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )
    try:
        client.head_bucket(Bucket=S3_BUCKET)
    except Exception:
        client.create_bucket(Bucket=S3_BUCKET)
    return client


def raw_s3(client: Any, size: int) -> float:
    data = bytes(size)
    t0 = time.perf_counter()
    client.put_object(Bucket=S3_BUCKET, Key=f"bench/raw-{size}", Body=data)
    got = client.get_object(Bucket=S3_BUCKET, Key=f"bench/raw-{size}")["Body"].read()
    seconds = time.perf_counter() - t0
    assert len(got) == size
    return seconds


def run_child(
    direction: str, size: int, url: str, token: str, nymph_pid: int
) -> tuple[dict[str, Any], int, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(BENCH)])}
    cmd = [
        sys.executable,
        __file__,
        "--child",
        direction,
        "--size",
        str(size),
        "--url",
        url,
        "--token",
        token,
    ]
    with Sampler(nymph_pid) as sampler:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the SDK process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), max(0, sampler.peak - sampler.idle), sampler.tasks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,64,1024", help="payload sizes in MiB (default 1,64,1024)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tier", choices=["local", "s3"], default="local")
    parser.add_argument("--child", choices=["args", "result"], help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.size, opts.url, opts.token)
        return

    from dreamlake.lakeshore.devstack import LocalStack

    sizes = [int(float(s) * MiB) for s in opts.sizes.split(",") if s]
    s3 = s3_client()
    if opts.tier == "s3" and s3 is None:
        raise SystemExit("--tier s3 needs LAKESHORE_TEST_S3_ENDPOINT (and its keys): source /tmp/svc_env")
    os.environ["MAX_PAYLOAD_BYTES"] = str(max(sizes) + 16 * MiB)  # the seed's 100 MiB, raised for 1 GiB
    if opts.tier == "s3":
        os.environ.update(
            LAKESHORE_BLOBS_BUCKET=S3_BUCKET,
            LAKESHORE_S3_ENDPOINT=os.environ["LAKESHORE_TEST_S3_ENDPOINT"],
            LAKESHORE_S3_ACCESS_KEY=os.environ.get("LAKESHORE_TEST_S3_ACCESS_KEY", ""),
            LAKESHORE_S3_SECRET_KEY=os.environ.get("LAKESHORE_TEST_S3_SECRET_KEY", ""),
        )
    print(f"payload store: {'S3 ' + os.environ['LAKESHORE_TEST_S3_ENDPOINT'] if opts.tier == 's3' else 'embedded blob directory'}; "
          f"{opts.reps} rep(s); {os.cpu_count()} CPUs (figures are noisy on a shared, loaded machine)")  # fmt: skip
    header = (
        f"{'size':>8} {'what':>7} {'median s':>9} {'p90 s':>7} {'MiB/s':>8} {'raw S3 MiB/s':>13} "
        f"{'ratio':>6} {'goal':>6} {'SDK extra':>10} {'nymph extra':>12} {'goal':>5} {'task peak':>10}"
    )
    with LocalStack(queues=["bench"], pythonpath=[BENCH], quiet=True, concurrency=1) as stack:
        assert stack.nymph is not None
        token = stack.tokens["admin"]
        print(header)
        for size in sizes:
            raw = [raw_s3(s3, size) for _ in range(opts.reps)] if s3 is not None else []
            raw_mib_s = size / MiB / median_p90(raw)[0] if raw else None
            for direction in ("args", "result"):
                runs = [
                    run_child(direction, size, stack.url, token, stack.nymph.pid) for _ in range(opts.reps)
                ]
                med, p90 = median_p90([r["seconds"] for r, _, _ in runs])
                sdk = max(r["extra_bytes"] for r, _, _ in runs) / size
                nymph = max(n for _, n, _ in runs) / size
                task = max(t for _, _, t in runs) / size
                mib_s = size / MiB / med
                ratio = f"{mib_s / raw_mib_s:.2f}" if raw_mib_s else "n/a"
                raw_text = f"{raw_mib_s:.1f}" if raw_mib_s else "n/a"
                mib = f" ({sdk * size / MiB:.0f} / {nymph * size / MiB:.0f} MiB)"
                print(
                    f"{size / MiB:>6.0f}Mi {direction:>7} {med:>9.3f} {p90:>7.3f} {mib_s:>8.1f} {raw_text:>13} "
                    f"{ratio:>6} {'>=' + str(GOAL_RATIO):>6} {sdk:>9.2f}x {nymph:>11.2f}x {'<=' + str(GOAL_COPIES):>5} "
                    f"{task:>9.2f}x{mib}",
                    flush=True,
                )
    print(
        "SDK / nymph extra: peak RSS over what the process held before the call, in copies of the payload "
        "(the SDK's result array itself not counted); task peak: the entry process's whole peak RSS "
        "(it holds the value itself: 1.0x is the floor), for information"
    )


if __name__ == "__main__":
    main()
