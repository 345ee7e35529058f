"""The peers' figures for issue 34's table, measured in the same run as ``bench/hotpaths.py``.

Optional: each peer runs only when its package is importable in this venv (none of them is a
dependency of the project; install them by hand to compare), else one skip line is printed for
it. Each measures what issue 34's table quotes for it, on this machine, one call at a time:

- Ray: ``ray.get(f.remote())`` round trip p50 (a warm worker), tasks/s submitted asynchronously
  (``[f.remote() for ...]`` then one ``ray.get``), and a streaming generator's first item;
- RQ: a ``SimpleWorker`` (no fork) in a separate process, enqueue-to-result round trip p50, and
  the forking ``Worker``'s jobs/s (a fork per job: what nymph's isolated noop is compared with);
- Celery: a prefork worker in a separate process, ``delay().get()`` round trip p50.

RQ and Celery need Redis: ``--redis URL`` or ``LAKESHORE_TEST_REDIS_URL``.

Run: ``python bench/peers.py [--calls 200] [--redis URL]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent


@dataclass
class PeerFigures:
    ray_p50_ms: float | None = None
    ray_tasks_s: float | None = None
    ray_first_ms: float | None = None
    rq_simple_p50_ms: float | None = None
    rq_fork_s: float | None = None
    celery_p50_ms: float | None = None
    lines: list[str] = field(default_factory=list)  # what was run or skipped, one line each


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _noop() -> None:
    return None


def _ray(calls: int, out: PeerFigures) -> None:
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="ERROR")
    # this module is imported from bench/ (not on Ray's workers' path): its functions travel by
    # value, as a driver script's own do
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        f = ray.remote(_noop)

        @ray.remote
        def gen(n: int):  # type: ignore[no-untyped-def]
            for i in range(n):
                yield (i, time.time())

        ray.get([f.remote() for _ in range(20)])  # warm-up: workers started
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            ray.get(f.remote())
            times.append(time.perf_counter() - t)
        out.ray_p50_ms = statistics.median(times) * 1e3
        t = time.perf_counter()
        ray.get([f.remote() for _ in range(calls * 5)])
        out.ray_tasks_s = calls * 5 / (time.perf_counter() - t)
        firsts = []
        for _ in range(10):
            t = time.time()
            ref = next(iter(gen.options(num_returns="streaming").remote(10)))
            ray.get(ref)
            firsts.append(time.time() - t)
        out.ray_first_ms = statistics.median(firsts) * 1e3
        out.lines.append(
            f"Ray {ray.__version__}: ray.get(f.remote()) p50 {out.ray_p50_ms:.2f} ms; "
            f"{out.ray_tasks_s:,.0f} tasks/s async; streaming first item {out.ray_first_ms:.1f} ms"
        )
    finally:
        ray.shutdown()


def _worker_proc(args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _rq(calls: int, redis_url: str, out: PeerFigures) -> None:
    import redis
    import rq

    conn = redis.Redis.from_url(redis_url)
    name = f"peers-{os.getpid()}"
    q = rq.Queue(name, connection=conn)
    for worker_class, fork in (("rq.worker.SimpleWorker", False), ("rq.Worker", True)):
        proc = _worker_proc(
            [sys.executable, "-m", "rq.cli", "worker", "-u", redis_url, "-w", worker_class, name]
        )
        try:
            job = q.enqueue("peers._noop")
            while job.get_status(refresh=True) != "finished":
                time.sleep(0.01)
            if not fork:
                times = []
                for _ in range(calls):
                    t = time.perf_counter()
                    job = q.enqueue("peers._noop")
                    while job.get_status(refresh=True) != "finished":
                        time.sleep(0.0005)
                    times.append(time.perf_counter() - t)
                out.rq_simple_p50_ms = statistics.median(times) * 1e3
            else:
                n = max(20, calls // 4)
                t = time.perf_counter()
                jobs = [q.enqueue("peers._noop") for _ in range(n)]
                while jobs[-1].get_status(refresh=True) != "finished":
                    time.sleep(0.01)
                out.rq_fork_s = n / (time.perf_counter() - t)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    out.lines.append(
        f"RQ {rq.__version__}: SimpleWorker round trip p50 {out.rq_simple_p50_ms:.2f} ms; "
        f"fork worker {out.rq_fork_s:,.1f} jobs/s"
    )


def _celery(calls: int, redis_url: str, out: PeerFigures) -> None:
    import celery

    app = celery.Celery("peers_app", broker=redis_url, backend=redis_url)
    noop = app.task(name="peers.noop")(_noop)
    proc = _worker_proc(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "peers:celery_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "-l",
            "ERROR",
        ]
    )
    try:
        noop.delay().get(timeout=60)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            noop.delay().get(timeout=30)
            times.append(time.perf_counter() - t)
        out.celery_p50_ms = statistics.median(times) * 1e3
        out.lines.append(f"Celery {celery.__version__} prefork: delay().get() p50 {out.celery_p50_ms:.2f} ms")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def __getattr__(name: str) -> object:
    """``peers.celery_app``: the app a Celery worker started by ``_celery`` loads (``-A
    peers:celery_app``; Celery wants the app itself, not a factory), made on first access so that
    importing this module needs no Celery."""
    if name == "celery_app":
        return _celery_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _celery_app():  # type: ignore[no-untyped-def]
    import celery

    url = os.environ.get("LAKESHORE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    app = celery.Celery("peers_app", broker=url, backend=url)
    app.task(name="peers.noop")(_noop)
    return app


def measure(calls: int = 200, redis_url: str | None = None) -> PeerFigures:
    """Every installed peer's figures; a skip line for each one that is not installed (or not
    runnable here: no Redis for RQ and Celery, or a failure, with its one-line cause)."""
    out = PeerFigures()
    redis_url = redis_url or os.environ.get("LAKESHORE_TEST_REDIS_URL")
    for name, module, fn, needs_redis in (
        ("Ray", "ray", _ray, False),
        ("RQ", "rq", _rq, True),
        ("Celery", "celery", _celery, True),
    ):
        if not installed(module):
            out.lines.append(f"{name}: skipped (not installed in this venv: pip install {module})")
            continue
        if needs_redis and not redis_url:
            out.lines.append(f"{name}: skipped (needs Redis: --redis URL or LAKESHORE_TEST_REDIS_URL)")
            continue
        try:
            if needs_redis:
                fn(calls, redis_url, out)  # type: ignore[operator]
            else:
                fn(calls, out)  # type: ignore[operator]
        except Exception as exc:
            out.lines.append(f"{name}: failed ({type(exc).__name__}: {str(exc)[:200]})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--redis", default=None)
    args = ap.parse_args()
    got = measure(args.calls, args.redis)
    print(f"peers, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}:")
    for line in got.lines:
        print(f"  {line}")


if __name__ == "__main__":
    main()
