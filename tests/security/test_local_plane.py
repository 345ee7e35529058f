"""The local plane keeps the control plane's rules (issue 11): namespaces, submit limits, lease
holders and frame order, on two ``Dispatch`` planes over one store file."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.dispatch import Dispatch
from dreamlake.lakeshore.envelope import Envelope, fn_for
from dreamlake.lakeshore.errors import AuthError, Conflict, NotFound, PlaneError
from dreamlake.lakeshore.ids import new_ulid


@pytest.fixture
def planes(tmp_path: Path) -> Iterator[tuple[Dispatch, Dispatch]]:
    path = tmp_path / "shared.db"
    with Dispatch(path, namespace="team-a") as a, Dispatch(path, namespace="team-b") as b:
        yield a, b


def _submit(plane: Dispatch, queue: str = "q", **run_config: object) -> str:
    return plane.submit(Envelope.create(fn_for(len)), queue, dict(run_config))


def test_a_plane_sees_and_claims_its_namespace_only(planes: tuple[Dispatch, Dispatch]) -> None:
    a, b = planes
    inv = _submit(a)
    for call in (
        b.status,
        b.cancel,
        lambda i: b.await_result(i, 0),
        lambda i: next(iter(b.frames(i, timeout=0))),
    ):
        with pytest.raises(NotFound, match=f"unknown invocation {inv}"):
            call(inv)
    assert b.claim(new_ulid(), ["q"], 0) is None
    assert a.status(inv)["state"] == "queued"
    claim = a.claim(new_ulid(), ["q"], 0)
    assert claim is not None and claim.invocation_id == inv


@pytest.mark.parametrize(
    "run_config,field",
    [
        ({"timeout_s": -1}, "timeout_s"),
        ({"max_attempts": -5}, "max_attempts"),
        ({"priority": math.nan}, "priority"),
    ],
)
def test_bad_submit_values_are_refused(
    planes: tuple[Dispatch, Dispatch], run_config: dict[str, object], field: str
) -> None:
    with pytest.raises(PlaneError, match=f"run_config.{field} must be") as err:
        _submit(planes[0], **run_config)
    assert err.value.status == 400


def test_only_the_lease_holder_posts_frames_in_order(planes: tuple[Dispatch, Dispatch]) -> None:
    a, _ = planes
    inv, holder = _submit(a), new_ulid()
    claim = a.claim(holder, ["q"], 0)
    assert claim is not None

    def frame(seq: int) -> bytes:
        return wire.encode_frame(wire.FRAME_VALUE, seq, wire.pack(seq), {})

    a.append_frame(inv, 0, frame(0), False, claim.attempt, worker_id=holder)
    with pytest.raises(AuthError, match="held by another worker"):
        a.append_frame(inv, 1, frame(1), False, claim.attempt, worker_id=new_ulid())
    with pytest.raises(Conflict, match="skips ahead: the next frame is 1"):
        a.append_frame(inv, 2, frame(2), False, claim.attempt, worker_id=holder)
    assert not a.ack(inv, "succeeded", attempt=claim.attempt, worker_id=new_ulid())
    assert a.ack(inv, "succeeded", attempt=claim.attempt, worker_id=holder)
