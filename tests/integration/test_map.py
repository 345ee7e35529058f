"""``UDF.map`` / ``starmap`` / ``dls.submit_all``: a sweep submitted in batches (``POST
/v1/producer/submit-batch`` over HTTP, one store transaction per batch locally), run by a real
worker, every result arriving once, in input order."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import Dispatch, HttpDispatch, Plane
from dreamlake.lakeshore.envelope import Envelope
from dreamlake.lakeshore.errors import BadRequest, DispatchError, PlaneError
from tests.integration.conftest import ControlPlane
from tests.integration.map_kit import Worker, odd_fails, square

SWEEP = 10_000


@pytest.fixture
def producer(control_plane: ControlPlane) -> Iterator[HttpDispatch]:
    plane = HttpDispatch(control_plane.url, control_plane.producer_token)
    yield plane
    plane.close()


@pytest.mark.slow
@pytest.mark.timeout(600)  # 10,000 round trips with the server, worker and producer in one process
def test_a_sweep_of_10000_calls_runs_each_once_and_every_result_arrives_once(
    control_plane: ControlPlane, producer: HttpDispatch
) -> None:
    cp = control_plane
    requests: list[str] = []
    send = producer._client.request  # every request of the plane goes through its one client

    def counting(method: str, path: str, body: Any = None, **kw: Any) -> Any:
        requests.append(path)
        return send(method, path, body, **kw)

    producer._client.request = counting  # type: ignore[method-assign]
    calls = square.map(range(SWEEP), _dispatch=producer)
    assert len(calls) == SWEEP and len(set(calls)) == SWEEP
    # 500 calls per request: 20 requests for the whole sweep, none of them a single submit
    assert requests.count("/v1/producer/submit-batch") == SWEEP // 500
    assert "/v1/producer/submit" not in requests
    with Worker(cp, "sweep"):
        values = list(calls.results(timeout=120))
    assert values == [x * x for x in range(SWEEP)]
    (sweep,) = [q for q in cp.store.queue_stats() if q.name == "sweep"]
    assert {k: n for k, n in sweep.counts.items() if n} == {"succeeded": SWEEP}  # each ran, once
    assert {cp.store.get(i).attempt for i in calls[:: SWEEP // 50]} == {1}  # type: ignore[union-attr]


def test_map_takes_several_iterables_and_starmap_tuples(
    control_plane: ControlPlane, producer: HttpDispatch
) -> None:
    calls = square.map([1, 2, 3], [10, 20], _dispatch=producer)  # the shortest input wins
    star = square.starmap([(4, 1), (5,)], _dispatch=producer)
    mixed = dls.submit_all([square.thunk(6), odd_fails.thunk(8), square.thunk(7, _key="seven")], producer)
    again = dls.submit_all([square.thunk(7, _key="seven")], producer)  # its key: the same call
    assert again == mixed[2:]
    with Worker(control_plane, "sweep", prefetch=8):
        assert list(calls.results(30)) == [11, 24]
        assert list(star.results(30)) == [17, 25]
        assert list(mixed.results(30)) == [36, 8, 49]
        failed = odd_fails.map(range(4), _dispatch=producer)
        got = list(failed.results(30, return_exceptions=True))
        with pytest.raises(DispatchError, match="odd 1"):
            list(failed.results(30))
    assert got[0] == 0 and got[2] == 2
    assert isinstance(got[1], DispatchError) and isinstance(got[3], DispatchError)


def test_a_refused_call_stops_the_map_and_says_what_was_submitted(
    control_plane: ControlPlane, producer: HttpDispatch
) -> None:
    cp = control_plane
    bad = dls.UDF(square.__lakeshore_fn__, queue="sweep", priority=1.0)
    bad.options["max_attempts"] = "many"  # a run_config the control plane refuses, per call
    with pytest.raises(BadRequest) as caught:
        bad.map(range(3), _dispatch=producer)
    err = caught.value
    assert err.status == 400 and "call 0 of the map" in str(err) and "max_attempts" in str(err)
    assert err.invocation_ids == [None, None, None]
    assert err.invocation_id is not None and cp.store.get(err.invocation_id) is None
    with pytest.raises(ValueError, match="every call of a map would be the same"):
        dls.UDF(square.__lakeshore_fn__, key="k").map(range(3), _dispatch=producer)


def test_the_local_plane_maps_in_one_transaction_per_batch(tmp_path: Any) -> None:
    plane = Dispatch(tmp_path / "local.db")
    writes: list[int] = []
    batch = plane.store.write_batch

    def counting(requests: Any) -> Any:
        writes.append(len(requests))
        return batch(requests)

    plane.store.write_batch = counting  # type: ignore[method-assign]
    calls = square.map(range(1200), _dispatch=plane)
    assert writes == [500, 500, 200]
    stop = threading.Event()
    worker = threading.Thread(
        target=dls.run_worker,
        args=("sweep",),
        kwargs={"dispatch": plane, "poll_timeout": 0.2, "stop": stop},
        daemon=True,
    )
    worker.start()
    try:
        assert list(calls.results(60)) == [x * x for x in range(1200)]
    finally:
        stop.set()
        worker.join(30)
    bad = dls.UDF(square.__lakeshore_fn__, queue="sweep")
    bad.options["max_attempts"] = 0
    with pytest.raises(PlaneError) as caught:
        bad.map(range(2), _dispatch=plane)
    assert caught.value.status == 400 and caught.value.invocation_ids == [None, None]
    plane.close()


def test_a_plane_without_batches_gets_single_submits() -> None:
    """A plane of the protocol without a ``submit_batch`` of its own (a user's, subclassing
    ``Plane``) still maps, call by call: the protocol's default sends one submit each."""

    class Plain(Plane):
        trusted = True

        def __init__(self) -> None:
            self.inner = Dispatch(":memory:")
            self.submitted = 0

        def submit(
            self,
            envelope: Envelope | bytes,
            queue: str,
            run_config: dict[str, Any],
            parent: str | None = None,
        ) -> str:
            self.submitted += 1
            return self.inner.submit(envelope, queue, run_config, parent)

    plane = Plain()
    calls = square.map(range(7), _dispatch=plane)
    assert plane.submitted == 7 and len(set(calls)) == 7
    assert all(plane.inner.store.get(i) is not None for i in calls)


def test_an_unanswered_batch_keeps_its_ids_for_a_status_check() -> None:
    """A control plane that never answers (nothing listens): the batch may or may not be stored,
    so the error keeps every call's id (never None, which means refused and not stored)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    plane = HttpDispatch(f"http://127.0.0.1:{port}", "lsk_unused", retry_window=0.2)
    with pytest.raises(PlaneError) as caught:
        square.map(range(3), _dispatch=plane)
    err = caught.value
    assert err.status is None or err.status >= 500
    assert err.invocation_ids is not None and len(err.invocation_ids) == 3
    assert all(isinstance(i, str) and len(i) == 26 for i in err.invocation_ids)
    assert "perhaps stored" in str(err) and "submit batch of 3 calls" in str(err)
    plane.close()
