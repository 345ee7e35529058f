"""A sampling profiler for the benches: where a server's threads spend their time, by stack.

``python bench/_sampler.py OUT -m module [args...]`` runs ``module`` as ``python -m`` would, taking
every thread's stack (``sys._current_frames``) each time the process has used another
``SAMPLER_INTERVAL_S`` (default 1 ms) of CPU (``ITIMER_PROF``: its SIGPROF handler runs in the main
thread, between two bytecodes of whatever it was running), and at exit (SIGINT's
KeyboardInterrupt, or a normal end) writes the counts to OUT as JSON (SIGUSR1 forgets the samples
so far, so a bench can sample its steady state alone): ``{"samples": {thread kind: {stack:
count}}}`` (a stack is ``file:function`` frames joined by ``;``, outermost first). Samples whose
innermost frame waits (selector, lock, condition, queue, uvloop's C loop) are dropped: what is left
is where CPU goes, thread by thread, in proportion to it. A thread that was busy when the signal
came shows where it let go of the GIL (the switch interval is set to 0.5 ms), so the split within
a thread is what to read. C code shows as the Python frame that called it (SQLite's work as
``do_execute``, a parser's as its Python callers). cProfile is no use here: it charges a coroutine
with the time it sits suspended, and sees one thread only. (A sampling *thread* saw almost nothing
of an event loop run by uvloop with httptools: it got the GIL mostly while that thread sat in
``epoll``.)

``report(path, top)`` prints the heaviest functions (self and inclusive) per thread kind.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import signal
import sys
import threading
import time
from typing import Any

IDLE = (
    "select",
    "poll",
    "epoll",
    "wait",
    "_wait",
    "acquire",
    "get",
    "sleep",
    "_worker",
    "run_forever",
    "_run_once",
    "accept",
    "recv",
    "readinto",
)


def _kind(name: str) -> str:
    for prefix in ("lakeshore-store", "lakeshore-writer", "MainThread"):
        if name.startswith(prefix):
            return prefix
    return "other"


def _stack(frame: Any) -> list[str]:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    out.reverse()
    return out


def _idle(frames: list[str]) -> bool:
    if not frames:
        return True
    top = frames[-1].rsplit(":", 1)[-1]
    # uvloop's loop is C: a thread parked in it shows asyncio's runner as its innermost frame
    return top in IDLE or top.startswith("<") or frames[-1] == "runners.py:run"


class Sampler:
    """Samples on the process's CPU clock (see the module docstring); call from the main thread."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def start(self) -> None:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self.interval, self.interval)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_IGN)

    def _sample(self, _signum: int, interrupted: Any) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        current = sys._current_frames()
        current[threading.main_thread().ident or 0] = interrupted  # not this handler's own frame
        for ident, frame in current.items():
            frames = _stack(frame)
            if _idle(frames):
                continue
            self.counts[_kind(names.get(ident, "other"))][";".join(frames)] += 1

    def reset(self) -> None:
        """Forget the samples so far (SIGUSR1: a bench marks the start of its steady state)."""
        self.counts.clear()

    def dump(self, path: str) -> None:
        """Stop sampling, then write the counts, whole or not at all."""
        self.stop()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"interval_s": self.interval, "samples": self.counts}, f)
        os.replace(tmp, path)


def report(path: str, top: int = 25, skip: tuple[str, ...] = ()) -> None:
    with open(path) as f:
        data = json.load(f)
    for kind, stacks in data["samples"].items():
        total = sum(stacks.values())
        own: collections.Counter[str] = collections.Counter()
        incl: collections.Counter[str] = collections.Counter()
        for stack, n in list(stacks.items()):
            if "_find_and_load" in stack:  # start-up and first-use imports: not the load's cost
                total -= n
                continue
            frames = stack.split(";")
            own[frames[-1]] += n
            for f in set(frames):
                incl[f] += n
        if total <= 0:
            continue
        print(f"\n[{kind}] {total} busy samples ({total * data['interval_s']:.2f} s)")
        print(f"  {'self %':>7}  function")
        for fn, n in own.most_common(top):
            print(f"  {100 * n / total:>6.1f}%  {fn}")
        print(f"  {'incl %':>7}  function")
        shown = 0
        for fn, n in incl.most_common():
            if any(s in fn for s in skip):
                continue
            print(f"  {100 * n / total:>6.1f}%  {fn}")
            shown += 1
            if shown >= top:
                break


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit("usage: python bench/_sampler.py OUT -m module [args...]")
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    sampler = Sampler(float(os.environ.get("SAMPLER_INTERVAL_S", "0.001")))
    sys.setswitchinterval(0.0005)  # the sampler gets the GIL sooner from a busy thread
    signal.signal(signal.SIGUSR1, lambda *_: sampler.reset())
    sampler.start()
    t0 = time.monotonic()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        sampler.dump(out)
        print(f"sampler: {time.monotonic() - t0:.1f} s sampled into {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
