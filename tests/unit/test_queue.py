"""SyncQueue / Topic: bad input fails at the call, with what to pass instead; cancel and descendants."""

from __future__ import annotations

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.default_dispatch import set_default_dispatch
from dreamlake.lakeshore.dispatch import Dispatch
from dreamlake.lakeshore.errors import InvalidId, PlaneError


@pytest.fixture
def q() -> dls.SyncQueue:
    return dls.SyncQueue("render", dispatch=Dispatch(":memory:"))


def test_bad_ids_cursors_and_timeouts_are_refused(q: dls.SyncQueue) -> None:
    with pytest.raises(InvalidId, match="26-character ULID"):
        q.stream("not-an-id")
    inv = "01" + "A" * 24
    with pytest.raises(ValueError, match="since must be"):
        q.stream(inv, since=-2)
    with pytest.raises(ValueError, match="timeout must be"):
        q.stream(inv, timeout=0)
    with pytest.raises(ValueError, match="timeout must be"):
        q.topic("t").listen(timeout=-1)
    with pytest.raises(ValueError, match="queue name"):
        dls.SyncQueue("")


def test_queue_without_a_plane_uses_the_process_default() -> None:
    set_default_dispatch(None)
    q = dls.SyncQueue("render")
    with pytest.raises(PlaneError, match="set_default_dispatch"):
        q.topic("t").post(1)
    plane = Dispatch(":memory:")
    set_default_dispatch(plane)
    try:
        assert q.topic("t").post(1) == 0
        assert q.topic("t").listen(since=-1, timeout=1.0) == 1
    finally:
        set_default_dispatch(None)
        plane.close()


def test_seed_defaults_for_cursor_and_patience() -> None:
    """since=-1 replays everything; streams wait 30 s of silence, topics 5 s (the seed's numbers)."""
    import inspect

    def defaults(fn: object) -> dict[str, object]:
        return {k: v.default for k, v in inspect.signature(fn).parameters.items() if k != "self"}  # type: ignore[arg-type]

    assert defaults(dls.SyncQueue.stream) == {"inv": inspect.Parameter.empty, "since": -1, "timeout": 30.0}
    assert defaults(dls.Topic.stream) == {"since": -1, "timeout": 5.0}
    assert defaults(dls.Topic.listen) == {"since": -1, "timeout": 5.0}
    assert defaults(dls.SyncQueue.topic) == {"name": None}


def test_cancel_reaches_descendants_unless_told_not_to(q: dls.SyncQueue) -> None:
    from dreamlake.lakeshore.envelope import Envelope

    plane = q.dispatch

    def submit(parent: str | None = None) -> str:
        env = Envelope.create({"kind": "ref", "module": "m", "qualname": "f", "src_hash": None}, ())
        return plane.submit(env, "render", {"queue": "render"}, parent)

    root = submit()
    child = submit(root)
    grandchild = submit(child)
    assert q.cancel(root, descendants=False) == "cancelled"
    assert [q.status(i)["state"] for i in (child, grandchild)] == ["queued", "queued"]
    assert q.cancel(child) == "cancelled"  # the default reaches the grandchild
    assert q.status(grandchild)["state"] == "cancelled"
