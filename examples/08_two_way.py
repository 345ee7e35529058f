"""Seed 004's L3 trampoline, remotely: a tuner that yields a learning rate and receives a loss.

The body is the seed's ``tuner`` as written there, with ``@dls.udf`` added. Because it uses the
value of its ``yield`` (``loss = yield lr``), it is a two-way generator: ``next(s)`` primes it,
``s.send(loss)`` delivers ``loss`` into the paused body wherever it runs and returns the next
``lr``, and ``s.close()`` ends it, as with a local generator.

Zero-infra (the local plane, a worker thread in this process)::

    python examples/08_two_way.py

Through a real control plane and nymph on loopback (``lakeshore server`` + ``nymph start``, started
and torn down here; the body runs in a task process nymph spawned)::

    python examples/08_two_way.py --nymph
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # importable by reference, as `08_two_way`

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import Dispatch

LOSSES = [2.0, 0.8, 0.5]


@dls.udf(queue="tune", code=None)
def tuner():
    lr = 0.1
    while True:
        loss = yield lr  # value OUT, measurement IN
        if loss is None:
            return
        lr = lr * 0.5 if loss > 1.0 else lr * 1.1


def drive(plane: dls.Dispatch | dls.HttpDispatch) -> list[float]:
    """The seed's driver loop, against a remote tuner. Run as a script, this module is __main__,
    and a function of __main__ would travel pickled (a nymph refuses that unless --allow-pickled):
    the tuner submitted is this file's, imported under its module name, so it travels by reference."""
    from importlib import import_module

    remote = import_module(Path(__file__).stem).tuner
    q = dls.SyncQueue("tune", dispatch=plane)
    inv = remote.submit(_dispatch=plane)
    g = q.stream(inv, timeout=60)
    lr = next(g)  # prime: first suggestion
    seen = [lr]
    for loss in LOSSES:
        lr = g.send(loss)  # send the measurement, get the next lr
        seen.append(lr)
    g.close()
    return seen


def main() -> None:
    if "--nymph" in sys.argv[1:]:
        from dreamlake.lakeshore.devstack import LocalStack

        with LocalStack(queues=["tune"], pythonpath=[Path(__file__).resolve().parent], quiet=True) as stack:
            seen = drive(stack.plane())
    else:
        plane = Dispatch(":memory:")
        stop = threading.Event()
        worker = threading.Thread(
            target=dls.run_worker,
            args=(dls.SyncQueue("tune", dispatch=plane),),
            kwargs={"stop": stop, "poll_timeout": 0.5},
            daemon=True,
        )
        worker.start()
        try:
            seen = drive(plane)
        finally:
            stop.set()
            worker.join(10)
            plane.close()
    print("learning rates:", ", ".join(f"{lr:.4f}" for lr in seen))


if __name__ == "__main__":
    main()
