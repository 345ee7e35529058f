"""Seed 004, L1: a generator body streams its yields as journal frames; topics are the same journal.

Zero infrastructure: the local plane (``Dispatch(":memory:")``) runs in this process.

    python examples/05_streams_topics.py
"""

from __future__ import annotations

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import Dispatch
from dreamlake.lakeshore.errors import DispatchError

plane = Dispatch(":memory:")
q = dls.SyncQueue("render", dispatch=plane)


@dls.udf(queue="render")
def render(n: int):
    for i in range(n):
        yield {"frame": i, "px": i * i}


@dls.udf(queue="render")
def flaky(n: int):
    yield from range(n)
    raise RuntimeError("GPU fell off the bus")


def main() -> None:
    # L1: yields become journal frames
    inv = render.submit(4, _dispatch=plane)  # durable string id
    dls.run_worker(q, once=True)  # yields -> VALUE frames -> END
    for frame in q.stream(inv, timeout=5.0):
        print(frame["frame"], frame["px"])

    # cursor reconnect: since is the last seq you saw; -1 replays from the start
    cursor = 1
    tail = list(q.stream(inv, since=cursor, timeout=5.0))
    assert [f["frame"] for f in tail] == [2, 3]  # frames 0, 1 skipped
    replay = list(q.stream(inv, since=-1, timeout=5.0))
    assert len(replay) == 4  # full history, any time
    print("resumed after seq 1:", [f["frame"] for f in tail], "- replayed:", len(replay))

    # an ERROR frame re-raises on the consumer side
    bad = flaky.submit(2, _dispatch=plane)
    dls.run_worker(q, once=True)
    try:
        for value in q.stream(bad, timeout=5.0):
            print("flaky yielded", value)
    except DispatchError as exc:
        print("stream raised:", exc)

    # Topic: the same journal, spelled pub/sub
    t = q.topic("progress")
    t.post({"done": 10, "of": 30})
    t.post({"done": 20, "of": 30})
    t.post({"done": 30, "of": 30})
    t.post(None, final=True)  # END frame closes the stream
    for msg in t.stream(since=-1):  # replay from the start
        print(msg)
    late = t.listen(since=0, timeout=5.0)  # next value after seq 0
    assert late == {"done": 20, "of": 30}
    print("late subscriber got", late)


if __name__ == "__main__":
    main()
