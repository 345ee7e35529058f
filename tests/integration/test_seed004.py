"""Seed 004 (generators), end to end: every code block, on the local plane and over real HTTP.

L0, L2 and L3 are local-tier only and live in tests/unit/test_udf.py; here are L1, cursor
reconnect, topics, ERROR frames, live follow and cross-process resume. The HTTP plane is a real
control plane served on a loopback port, over SQLite and over PostgreSQL (``PLANES``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import ids
from dreamlake.lakeshore.default_dispatch import set_default_dispatch
from dreamlake.lakeshore.dispatch import Dispatch, Plane
from dreamlake.lakeshore.errors import DispatchError
from tests.conftest import ROOT
from tests.integration.planes_kit import PLANES, open_plane, worker_thread

# Bodies the HTTP plane runs by ref (it refuses pickles by default): module-level, importable.


@dls.udf(queue="render")
def render(n: int):
    for i in range(n):
        yield {"frame": i, "px": i * i}


@dls.udf(queue="render")
def paced(n: int, pause: float):
    for i in range(n):
        time.sleep(pause)
        yield i


@dls.udf(queue="render")
def explodes(after: int):
    yield from range(after)
    raise ValueError(f"bad frame {after}")


# -- planes -----------------------------------------------------------------------------------------


@pytest.fixture(params=PLANES)
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    if request.param == "local":
        p: Plane = Dispatch(":memory:")
        set_default_dispatch(p)  # what bodies that submit or read topics use
        yield p
        set_default_dispatch(None)
        p.close()
        return
    with open_plane(request.param, request, tmp_path) as (p, _spec):
        set_default_dispatch(p)
        yield p
        set_default_dispatch(None)


@pytest.fixture(params=PLANES)
def shared_plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Plane, list[str]]]:
    """A plane another process can open too, with the arguments to open it there."""
    with open_plane(request.param, request, tmp_path) as opened:
        yield opened


# -- L1: yields become journal frames ---------------------------------------------------------------


def test_seed004_l1_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    import dreamlake.lakeshore as dls
    from dreamlake.lakeshore.dispatch import Dispatch

    plane = Dispatch(":memory:")
    q = dls.SyncQueue("render", dispatch=plane)

    @dls.udf(queue="render")
    def render(n: int):
        for i in range(n):
            yield {"frame": i, "px": i * i}

    inv = render.submit(4, _dispatch=plane)  # durable string id
    dls.run_worker(q, once=True)  # yields -> VALUE frames -> END

    for frame in q.stream(inv, timeout=5.0):
        print(frame["frame"], frame["px"])

    assert ids.is_ulid(inv)
    assert capsys.readouterr().out == "0 0\n1 1\n2 4\n3 9\n"
    assert q.status(inv)["state"] == "succeeded"


def test_l1_and_cursor_reconnect_on_each_plane(plane: Plane) -> None:
    q = dls.SyncQueue("render", dispatch=plane)
    inv = render.submit(4, _dispatch=plane)
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    assert [(f["frame"], f["px"]) for f in q.stream(inv, timeout=5.0)] == [(0, 0), (1, 1), (2, 4), (3, 9)]

    # the seed's cursor block, verbatim
    cursor = 1  # last seq this consumer saw
    tail = list(q.stream(inv, since=cursor, timeout=5.0))
    assert [f["frame"] for f in tail] == [2, 3]  # frames 0, 1 skipped

    replay = list(q.stream(inv, since=-1, timeout=5.0))
    assert len(replay) == 4  # full history, any time

    frames = list(q.frames(inv, timeout=5.0))
    assert [f.seq for f in frames] == [0, 1, 2, 3, 4]  # 0-based; the END frame is seq 4
    assert q.result(inv, timeout=5.0) is None  # a generator's return value


def test_error_frame_raises_dispatch_error(plane: Plane) -> None:
    q = dls.SyncQueue("render", dispatch=plane)
    inv = explodes.submit(2, _dispatch=plane)
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "failed"
    got: list[int] = []
    with pytest.raises(DispatchError) as info:
        for v in q.stream(inv, timeout=5.0):
            got.append(v)
    assert got == [0, 1]  # the frames before the failure arrive first
    assert (info.value.type, info.value.message) == ("ValueError", "bad frame 2")
    assert "ValueError: bad frame 2" in str(info.value)
    with pytest.raises(DispatchError, match="ValueError: bad frame 2") as res:
        q.result(inv, timeout=5.0)
    assert "explodes" in (res.value.traceback or "")


def test_live_follow_while_the_body_yields(plane: Plane) -> None:
    q = dls.SyncQueue("render", dispatch=plane)
    inv = paced.submit(6, 0.05, _dispatch=plane)
    with worker_thread(q):
        assert list(q.stream(inv, timeout=10.0)) == [0, 1, 2, 3, 4, 5]
    assert q.status(inv)["state"] == "succeeded"


def test_stream_ends_on_terminal_state_without_frames(plane: Plane) -> None:
    q = dls.SyncQueue("render", dispatch=plane)
    inv = render.submit(3, _dispatch=plane)
    assert q.cancel(inv) == "cancelled"
    assert list(q.stream(inv, timeout=5.0)) == []
    with pytest.raises(DispatchError):
        q.result(inv, timeout=5.0)


def test_silence_raises_timeout_error(plane: Plane) -> None:
    q = dls.SyncQueue("render", dispatch=plane)
    inv = render.submit(3, _dispatch=plane)  # queued, no worker: the journal stays silent
    with pytest.raises(TimeoutError, match="since=-1"):
        list(q.stream(inv, timeout=0.3))
    with pytest.raises(TimeoutError, match="still"):
        q.result(inv, timeout=0.3)


# -- Topic ------------------------------------------------------------------------------------------


def test_seed004_topic_as_written(plane: Plane, capsys: pytest.CaptureFixture[str]) -> None:
    q = dls.SyncQueue("render", dispatch=plane)

    t = q.topic("progress")
    t.post({"done": 10, "of": 30})
    t.post({"done": 20, "of": 30})
    t.post({"done": 30, "of": 30})
    t.post(None, final=True)  # END frame closes the stream

    for msg in t.stream(since=-1):  # replay from the start
        print(msg)

    late = t.listen(since=0, timeout=5.0)  # next value after seq 0
    assert late == {"done": 20, "of": 30}
    assert capsys.readouterr().out == (
        "{'done': 10, 'of': 30}\n{'done': 20, 'of': 30}\n{'done': 30, 'of': 30}\n"
    )


def test_topic_names_listen_timeout_and_late_subscriber(plane: Plane) -> None:
    q = dls.SyncQueue("render", dispatch=plane)
    t = q.topic()
    assert t.name.startswith("topic-") and ids.is_ulid(t.name[len("topic-") :])
    assert t.listen(since=-1, timeout=0.2) is None  # nothing posted: None on timeout
    assert [t.post(i) for i in range(3)] == [0, 1, 2]
    assert t.listen(since=1, timeout=5.0) == 2
    with pytest.raises(TimeoutError):
        list(t.stream(since=-1, timeout=0.3))  # no END yet: silence after the replay
    with pytest.raises(ValueError, match="invalid topic name"):
        q.topic("no spaces allowed")


def test_two_way_flow_as_two_one_way_channels(plane: Plane) -> None:
    """L3's gap, spelled as the seed says: an invocation stream out, a Topic back in."""
    q = dls.SyncQueue("render", dispatch=plane)
    t = q.topic()
    for loss in [2.0, 0.8]:
        t.post(loss)
    t.post(None, final=True)
    inv = tune_from_topic.submit(t.name, _dispatch=plane)
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    assert list(q.stream(inv, timeout=5.0)) == pytest.approx([0.1, 0.05, 0.055])


def test_send_into_a_one_way_stream_says_so(plane: Plane) -> None:
    """A body whose yields are statements is one-way: .send(x) says so instead of dropping x
    (two-way bodies: tests/integration/test_two_way.py)."""
    q = dls.SyncQueue("render", dispatch=plane)
    inv = render.submit(3, _dispatch=plane)
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    stream = q.stream(inv, timeout=5.0)
    assert next(stream)["frame"] == 0
    assert stream.send(None)["frame"] == 1  # send(None) pulls, as next() does
    with pytest.raises(NotImplementedError, match=r"one-way.*two_way=True.*Topic"):
        stream.send(0.5)
    assert [f["frame"] for f in stream] == [2]  # the refused send consumed nothing

    t = q.topic()
    t.post("a")
    t.post(None, final=True)
    values = t.stream(timeout=5.0)
    with pytest.raises(NotImplementedError, match=f"topic {t.name} is one-way"):
        values.send("back")
    assert list(values) == ["a"]


@dls.udf(queue="render")
def tune_from_topic(topic: str):
    lr = 0.1
    yield lr
    for loss in dls.Topic(topic).stream(timeout=5.0):
        lr = lr * 0.5 if loss > 1.0 else lr * 1.1
        yield lr


# -- cross-process resume ---------------------------------------------------------------------------

CONSUMER = """
import os, sys
from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch
import dreamlake.lakeshore as dls

kind, inv, since, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
plane = Dispatch(sys.argv[5]) if kind == "local" else HttpDispatch(sys.argv[5], sys.argv[6])
q = dls.SyncQueue("render", dispatch=plane)
n = 0
for f in q.frames(inv, since=since, timeout=20.0):
    if f.kind == wire.FRAME_VALUE:
        print(f.seq, wire.unpack(f.body), flush=True)
        n += 1
        if n == limit:
            os._exit(9)  # die mid-stream: no cleanup, no goodbye
print("end", f.seq, flush=True)
"""


def _consume(spec: list[str], inv: str, since: int, limit: int) -> tuple[list[tuple[int, int]], str | None]:
    kind, *where = spec
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CONSUMER, kind, inv, str(since), str(limit), *where],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    seen, end = [], None
    for line in out.stdout.splitlines():
        a, b = line.split()
        if a == "end":
            end = b
        else:
            seen.append((int(a), int(b)))
    assert out.returncode == (9 if limit else 0), out.stderr  # 9: it died mid-stream, as told
    return seen, end


def test_cross_process_resume_no_loss_no_duplicates(shared_plane: tuple[Plane, list[str]]) -> None:
    plane, spec = shared_plane
    q = dls.SyncQueue("render", dispatch=plane)
    inv = paced.submit(12, 0.02, _dispatch=plane)
    with worker_thread(q):
        first, end1 = _consume(spec, inv, since=-1, limit=5)  # reads 5 frames, then dies
        assert end1 is None and [v for _, v in first] == [0, 1, 2, 3, 4]
        cursor = first[-1][0]
        rest, end2 = _consume(spec, inv, since=cursor, limit=0)  # a new process resumes
    assert [v for _, v in first + rest] == list(range(12))  # no loss, no duplicates
    assert [s for s, _ in first + rest] == list(range(12))
    assert end2 == "12"  # the END frame follows the last VALUE


# -- queue semantics seen by run_worker ------------------------------------------------------------


@dls.udf(queue="jobs")
def whoami(tag: str) -> dict[str, Any]:
    return {"tag": tag, "id": dls.run.id, "prefix": dls.run.prefix, "key": dls.run.key("out.png")}


def test_scope_prefix_reaches_dls_run_in_the_worker(plane: Plane) -> None:
    q = dls.SyncQueue("jobs", dispatch=plane)
    with dls.scope("scenes"), dls.scope("0007"):
        inv = whoami.submit("a", _dispatch=plane)
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    assert q.result(inv, timeout=5.0) == {
        "tag": "a",
        "id": inv,
        "prefix": "scenes/0007",
        "key": "scenes/0007/out.png",
    }


def test_idempotency_key_queues_once(plane: Plane) -> None:
    q = dls.SyncQueue("jobs", dispatch=plane)
    a = whoami.submit("x", _dispatch=plane, _key="scene-7")
    b = whoami.submit("x", _dispatch=plane, _key="scene-7")
    c = whoami.submit("x", _dispatch=plane, _key="scene-8")
    assert a == b != c
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    assert dls.run_worker(q, once=True, poll_timeout=0.2) is None  # nothing else was queued


def test_priority_order_seen_by_run_worker(plane: Plane) -> None:
    q = dls.SyncQueue("jobs", dispatch=plane)
    invs = {p: whoami.submit(f"p{p}", _dispatch=plane, _priority=p) for p in (0, 5, -1, 9)}
    for _ in invs:
        assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    started = sorted(invs, key=lambda p: q.status(invs[p])["started_at"])
    assert started == [9, 5, 0, -1]


def test_pickled_body_refused_over_http_allowed_locally(plane: Plane) -> None:
    q = dls.SyncQueue("jobs", dispatch=plane)
    inv = dls.udf(queue="jobs")(lambda: 42).submit(_dispatch=plane)
    state = dls.run_worker(q, once=True, poll_timeout=5.0)
    if plane.trusted:
        assert state == "succeeded" and q.result(inv, timeout=5.0) == 42
    else:
        assert state == "failed"
        with pytest.raises(DispatchError) as info:
            q.result(inv, timeout=5.0)
        assert info.value.type == "PickleRefused"
        assert "--allow-pickled" in info.value.message
        with pytest.raises(DispatchError, match="PickleRefused"):  # a stream does not end silently
            list(q.stream(inv, timeout=5.0))


def test_child_submitted_inside_an_invocation_records_its_parent(plane: Plane) -> None:
    q = dls.SyncQueue("jobs", dispatch=plane)
    parent = spawn_child.submit(_dispatch=plane)
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    child = q.result(parent, timeout=5.0)
    assert q.status(child)["parent_invocation_id"] == parent
    assert dls.run_worker(q, once=True, poll_timeout=5.0) == "succeeded"
    assert q.result(child, timeout=5.0)["prefix"] == "sub"


@dls.udf(queue="jobs")
def spawn_child() -> str:
    with dls.scope("sub"):
        return whoami.submit("child")


def test_example_05_runs_zero_infra() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "05_streams_topics.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("0 0\n1 1\n2 4\n3 9\n")
    assert "stream raised: RuntimeError: GPU fell off the bus" in out.stdout
    assert out.stdout.endswith("late subscriber got {'done': 20, 'of': 30}\n")
