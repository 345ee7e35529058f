"""Two-way generators across the wire (seed 004, L3's named gap, now built): ``send``, ``throw``
and ``close`` reach a paused remote body, on the local plane, through ``lakeshore worker``'s code
path over HTTP, and through a real nymph over HTTP; a consumer that dies and resumes from its
cursor loses and repeats nothing in the body; only the invocation's owner may send."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.devstack import LocalStack
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch, Plane
from dreamlake.lakeshore.errors import Conflict, DispatchError, NotFound
from dreamlake.lakeshore.twoway import takes_sends
from tests.conftest import ROOT
from tests.integration.conftest import running_control_plane
from tests.integration.planes_kit import worker_thread
from tests.twoway_fns import echo, impatient, one_way, resilient, tuner

LOSSES = [2.0, 0.8, 0.5, 3.0]


def local_tuner() -> list[float]:
    g = tuner.__lakeshore_fn__()
    out = [next(g)] + [g.send(loss) for loss in LOSSES]
    g.close()
    return out


@pytest.fixture(params=["local", "http-sqlite", "http-postgresql"])
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    """The local plane, or the control plane over HTTP (the SDK worker's path) on either store."""
    if request.param == "local":
        p = Dispatch(":memory:")
        yield p
        p.close()
        return
    store = str(tmp_path / "cp.db") if request.param == "http-sqlite" else request.getfixturevalue("_pg_url")
    with running_control_plane(store) as cp:
        http = HttpDispatch(cp.url, cp.admin_token)
        yield http
        http.close()


def test_two_way_is_decided_from_the_body() -> None:
    assert tuner.options.get("two_way") is True
    assert "two_way" not in one_way.options  # its yields are statements: it streams ahead
    assert takes_sends(echo.__lakeshore_fn__) and not takes_sends(one_way.__lakeshore_fn__)

    @dls.udf(two_way=False)
    def forced(n: int) -> Iterator[Any]:
        x = yield n
        yield x

    assert "two_way" not in forced.options
    with pytest.raises(ValueError, match="generator body"):
        dls.udf(two_way=True)(lambda: 1)


def test_tuner_on_a_plane_gives_the_local_sequence(plane: Plane) -> None:
    q = dls.SyncQueue("tune", dispatch=plane)
    with worker_thread(q):
        inv = tuner.submit(_dispatch=plane)
        s = q.stream(inv, timeout=20)
        got = [next(s)] + [s.send(loss) for loss in LOSSES]
        s.close()
        assert q.result(inv, timeout=20) is None
    assert got == pytest.approx(local_tuner())


def test_throw_and_close_reach_the_body(plane: Plane) -> None:
    q = dls.SyncQueue("tune", dispatch=plane)
    with worker_thread(q):
        inv = resilient.submit(_dispatch=plane)
        s = q.stream(inv, timeout=20)
        assert next(s) == "ready"
        assert s.send(1) == "got 1"
        assert s.throw(ValueError("bad loss")) == "caught ValueError: bad loss"
        assert s.send(2) == "got 2"  # the body goes on after a throw it caught
        s.close()
        assert q.result(inv, timeout=20) is None  # GeneratorExit at the yield: the body ended
        inv2 = resilient.submit(_dispatch=plane)
        s2 = q.stream(inv2, timeout=20)
        next(s2)
        with pytest.raises(DispatchError, match="KeyError"):
            s2.throw(KeyError("missing"))  # not caught by the body: it fails with that type
    assert q.status(inv)["state"] == "succeeded"
    assert q.status(inv2)["state"] == "failed"


def test_a_send_timeout_surfaces_in_the_body(plane: Plane) -> None:
    q = dls.SyncQueue("tune", dispatch=plane)
    with worker_thread(q):
        inv = impatient.submit(_dispatch=plane)
        assert q.result(inv, timeout=20) == "timed out"


def test_sends_are_ordered_windowed_and_idempotent() -> None:
    plane = Dispatch(":memory:")
    try:
        inv = echo.submit(40, _dispatch=plane)  # queued: nothing has run yet
        assert plane.send(inv, 0, "value", dls_pack(1)) is False
        assert plane.send(inv, 0, "value", dls_pack(1)) is True  # a repeat: ignored
        with pytest.raises(Conflict, match="already sent a different value"):
            plane.send(inv, 0, "value", dls_pack(2))
        with pytest.raises(Conflict, match="skips ahead: the next is 1"):
            plane.send(inv, 5, "value", dls_pack(5))
        for i in range(1, 16):
            plane.send(inv, i, "value", dls_pack(i))
        with pytest.raises(Conflict, match="send window full"):
            plane.send(inv, 16, "value", dls_pack(16))
        plane.cancel(inv)
        with pytest.raises(Conflict, match="has ended"):
            plane.send(inv, 16, "value", dls_pack(16))
        one = one_way.submit(3, _dispatch=plane)
        with pytest.raises(Conflict, match="not a two-way generator"):
            plane.send(one, 0, "value", dls_pack(0))
        q = dls.SyncQueue("tune", dispatch=plane)
        with worker_thread(q):
            s = q.stream(one, timeout=20)
            assert next(s) == 0
            with pytest.raises(NotImplementedError, match=r"one-way.*Topic"):
                s.send(5)
            assert list(s) == [1, 2]
    finally:
        plane.close()


def test_a_refused_send_leaves_the_stream_at_its_yield() -> None:
    """A send the plane refuses (here that yield already has another answer, as a replayed yield
    has after a restart) raises Conflict and leaves the stream waiting at the same yield: the
    right answer then goes on, as the consumer of a restarted stream needs."""
    plane = Dispatch(":memory:")
    try:
        inv = echo.submit(2, _dispatch=plane)
        plane.send(inv, 0, "value", dls_pack("first"))
        q = dls.SyncQueue("tune", dispatch=plane)
        with worker_thread(q):
            s = q.stream(inv, timeout=20)
            assert next(s) == 0
            with pytest.raises(Conflict, match="already sent a different value"):
                s.send("other")
            assert s.send("first") == 1  # the same answer again: a no-op, and the body goes on
            with pytest.raises(StopIteration):
                s.send("second")
        assert q.result(inv, timeout=20) == ["first", "second"]
    finally:
        plane.close()


def dls_pack(value: Any) -> bytes:
    from dreamlake.lakeshore import wire

    return wire.pack(value)


def test_only_the_owner_may_send(tmp_path: Path) -> None:
    with running_control_plane(str(tmp_path / "cp.db")) as cp:
        a = HttpDispatch(cp.url, cp.store.create_token("producer", "a", "team-a"))
        b = HttpDispatch(cp.url, cp.store.create_token("producer", "b", "team-b"))
        try:
            inv = echo.submit(3, _dispatch=a)
            with pytest.raises(NotFound):
                b.send(inv, 0, "value", dls_pack("forged"))
            assert a.send(inv, 0, "value", dls_pack("mine")) is False
        finally:
            a.close()
            b.close()


# -- through a real nymph over HTTP -----------------------------------------------------------------

CONSUMER = """
import os, sys
import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import HttpDispatch
url, token, inv = sys.argv[1:4]
q = dls.SyncQueue("tune", dispatch=HttpDispatch(url, token))
s = q.stream(inv, timeout=30)
next(s)
for v in ("a", "b"):
    s.send(v)
print(s.cursor, flush=True)
os._exit(9)  # killed after its second send: no close, no goodbye
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(
        queues=["tune"],
        concurrency=2,
        pythonpath=[ROOT],
        quiet=True,
        data_dir=tmp_path_factory.mktemp("stack"),
    ) as s:
        yield s


def test_tuner_through_nymph(stack: LocalStack) -> None:
    plane = stack.plane()
    q = dls.SyncQueue("tune", dispatch=plane)
    inv = tuner.submit(_dispatch=plane)
    s = q.stream(inv, timeout=30)
    got = [next(s)] + [s.send(loss) for loss in LOSSES]
    s.close()
    assert got == pytest.approx(local_tuner())
    assert q.result(inv, timeout=30) is None


def test_throw_and_close_through_nymph(stack: LocalStack) -> None:
    plane = stack.plane()
    q = dls.SyncQueue("tune", dispatch=plane)
    inv = resilient.submit(_dispatch=plane)
    s = q.stream(inv, timeout=30)
    assert next(s) == "ready"
    assert s.throw(ValueError("bad loss")) == "caught ValueError: bad loss"
    assert s.send([1, 2]) == "got [1, 2]"
    s.close()
    q.result(inv, timeout=30)
    assert "finally ran" in "".join(c.text for c in q.logs(inv))
    with pytest.raises(DispatchError, match="KeyError"):
        inv2 = resilient.submit(_dispatch=plane)
        s2 = q.stream(inv2, timeout=30)
        next(s2)
        s2.throw(KeyError("missing"))  # not caught by the body: it fails with that type


def test_a_consumer_killed_after_its_second_send_resumes_from_its_cursor(stack: LocalStack) -> None:
    plane = stack.plane()
    q = dls.SyncQueue("tune", dispatch=plane)
    inv = echo.submit(5, _dispatch=plane)
    out = subprocess.run(
        [sys.executable, "-c", CONSUMER, stack.url, stack.tokens["admin"], inv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 9, out.stderr
    cursor = int(out.stdout.split()[-1])
    s = q.stream(inv, since=cursor, timeout=30)
    assert s.send("c") == 3  # into the yield at its cursor: the body's 3rd, with no value lost
    assert s.send("d") == 4
    with pytest.raises(StopIteration):
        s.send("e")
    assert q.result(inv, timeout=30) == ["a", "b", "c", "d", "e"]  # none lost, none repeated


@pytest.mark.parametrize("where", ["local", "nymph"])
def test_the_example_runs_as_written(where: str, tmp_path: Path) -> None:
    """examples/08_two_way.py, seed 004's tuner with @dls.udf added, as a user runs it."""
    args = [
        sys.executable,
        str(ROOT / "examples" / "08_two_way.py"),
        *(["--nymph"] if where == "nymph" else []),
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    want = ", ".join(f"{lr:.4f}" for lr in local_tuner()[:4])
    assert out.stdout.strip() == f"learning rates: {want}"
