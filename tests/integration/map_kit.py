"""The map tests' functions (a sweep queue's udfs) and a worker thread that serves them over HTTP."""

from __future__ import annotations

import threading

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import HttpDispatch
from tests.integration.conftest import ControlPlane


@dls.udf(queue="sweep")
def square(x: int, plus: int = 0) -> int:
    return x * x + plus


@dls.udf(queue="sweep")
def odd_fails(x: int) -> int:
    if x % 2:
        raise ValueError(f"odd {x}")
    return x


class Worker:
    """``run_worker`` over HTTP in a thread: the warm path, many claims per poll."""

    def __init__(self, cp: ControlPlane, queue: str, prefetch: int = 64) -> None:
        self.stop = threading.Event()
        self.plane = HttpDispatch(cp.url, cp.daemon_token)
        self.thread = threading.Thread(
            target=dls.run_worker,
            args=(queue,),
            kwargs={
                "dispatch": self.plane,
                "allow_pickled": False,
                "poll_timeout": 0.5,
                "stop": self.stop,
                "prefetch": prefetch,
            },
            daemon=True,
        )

    def __enter__(self) -> Worker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        self.plane.close()
        assert not self.thread.is_alive()
