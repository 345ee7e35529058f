"""A consumer of a requeued generator sees an explicit restart, never a splice (issue 12, item 5).

Over real HTTP (SQLite and PostgreSQL): a worker journals seq 0-33 and dies (its lease lapses),
attempt 2 runs the generator again from its start, 0-99 and END. Before, the consumer got 0-33 of
attempt 1 then 34-99 of attempt 2. Now ``q.stream(inv)`` yields 0-33, raises ``StreamRestarted``
(attempt 2), then yields attempt 2's 0-99; a cursor taken anywhere resumes without loss or repeat.
On the local plane, a generator whose failure is retried (``retry_on``) restarts the same way and
its first attempt's ERROR does not end the stream.
"""

from __future__ import annotations

import threading
from typing import Any

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch
from dreamlake.lakeshore.errors import StreamRestarted
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.queue import Stream
from tests.integration.conftest import ControlPlane
from tests.integration.daemon_kit import poll
from tests.integration.planes_kit import worker_thread

CHUNKS = "/v1/daemon/result-chunks"
FUTURE = 10**10


def _post(cp: ControlPlane, inv: str, worker: str, attempt: int, frames: list[bytes]) -> None:
    body = {"invocation_id": inv, "attempt": attempt, "worker_id": worker, "frames": frames}
    status, out = cp.daemon(CHUNKS, body)
    assert status == 200 and out["ok"], out


def _values(n: int, prefix: str, end: bool = False) -> list[bytes]:
    frames = [wire.encode_frame(wire.FRAME_VALUE, s, wire.pack(f"{prefix}{s}")) for s in range(n)]
    if end:
        frames.append(wire.encode_frame(wire.FRAME_END, n, wire.pack(None)))
    return frames


def consume(stream: Stream) -> list[Any]:
    """Every value, and ``("restart", attempt, seq)`` where the stream restarted."""
    seen: list[Any] = []
    while True:
        try:
            for value in stream:
                seen.append(value)
            return seen
        except StreamRestarted as restart:
            seen.append(("restart", restart.attempt, restart.seq))


def test_a_consumer_sees_the_restart_of_a_requeued_generator(control_plane: ControlPlane) -> None:
    cp = control_plane
    inv = cp.submit("gen")
    w1, w2 = new_ulid(), new_ulid()
    assert poll(cp, w1, ["gen"])["commands"][0]["body"]["attempt"] == 1
    _post(cp, inv, w1, 1, _values(34, "a1-"))
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("gen", dispatch=plane)
    got: list[Any] = []
    live = threading.Thread(target=lambda: got.extend(consume(q.stream(inv, timeout=60))), daemon=True)
    live.start()  # a consumer following live, across the restart
    assert cp.store.expire_leases(now=FUTURE) == [inv]  # the worker died at seq 33
    assert poll(cp, w2, ["gen"])["commands"][0]["body"]["attempt"] == 2
    _post(cp, inv, w2, 2, _values(100, "a2-", end=True))
    status, _ = cp.daemon("/v1/daemon/ack", {"invocation_id": inv, "state": "succeeded", "attempt": 2,
                                             "worker_id": w2, "result_blob": wire.pack(None)})  # fmt: skip
    assert status == 200
    live.join(60)
    expected = [f"a1-{s}" for s in range(34)] + [("restart", 2, 34)] + [f"a2-{s}" for s in range(100)]
    assert got == expected  # no splice: attempt 2 from its own first value
    assert consume(q.stream(inv)) == expected  # a replay from the start says the same
    assert consume(q.stream(inv, since=34)) == expected[35:]  # a cursor after the marker
    assert consume(q.stream(inv, since=20)) == expected[21:]  # a cursor before it
    positions = [f.seq for f in q.frames(inv)]
    assert positions == list(range(136))  # cursors never go back
    plane.close()


@dls.udf(queue="flaky-gen", max_attempts=2, retry_on=(TimeoutError,), backoff_s=0)
def flaky_gen(n: int, marker: str) -> Any:
    from pathlib import Path

    first = not Path(marker).exists()
    Path(marker).touch()
    for i in range(n):
        if first and i == 3:
            raise TimeoutError("the first attempt times out at 3")
        yield i


def test_a_retried_generator_restarts_its_stream_on_the_local_plane(tmp_path: Any) -> None:
    plane = Dispatch(":memory:")
    q = dls.SyncQueue("flaky-gen", dispatch=plane)
    with worker_thread(q):
        inv = flaky_gen.submit(5, str(tmp_path / "ran"), _dispatch=plane)
        seen = consume(q.stream(inv, timeout=30))
    assert seen[:3] == [0, 1, 2] and seen[3][:2] == ("restart", 2) and seen[4:] == [0, 1, 2, 3, 4]
    status = q.status(inv)
    assert status["state"] == "succeeded" and [a["state"] for a in status["attempts"]] == [
        "failed",
        "succeeded",
    ]
