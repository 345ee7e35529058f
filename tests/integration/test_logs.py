"""An invocation's stdout and stderr end to end (issue 14): a real control plane, ``nymph start``
(process runner) as a real process, and the user's three ways to read the output: ``q.logs()``,
``lakeshore logs [-f]`` (CliRunner and a subprocess) and the route under them. Live (a line printed
before a long wait is readable before the function ends), after the end, bounded by the cap, and
beside the values of a generator without disturbing them or the backpressure window.

The same capture on the other runners is in the conformance suite
(``tests/contract/test_runner_conformance.py``: the output reaches the workdir logs live on each);
the docker/gvisor path through nymph is in ``tests/integration/test_nymph_docker.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.cli import main
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.queue import LogChunk, SyncQueue
from tests import nymph_fns
from tests.conftest import ROOT
from tests.integration.conftest import ControlPlane
from tests.stack.nymph import Nymph
from tests.stack.ports import free_port
from tests.stack.producer import await_result, envelope, frames_of, state_of, submit
from tests.stack.wait import until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def queue(sqlite_control_plane: ControlPlane) -> Iterator[SyncQueue]:
    plane = HttpDispatch(sqlite_control_plane.url, sqlite_control_plane.producer_token)
    try:
        yield SyncQueue("default", plane)
    finally:
        plane.close()


def _text(chunks: Iterator[LogChunk] | list[LogChunk], stream: str = "stdout") -> str:
    return "".join(c.text for c in chunks if c.stream == stream)


def _cli(cp: ControlPlane, *args: str) -> Any:
    env = {"LAKESHORE_URL": cp.url, "LAKESHORE_TOKEN": cp.producer_token, "LAKESHORE_CONFIG": "/nonexistent"}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def test_print_is_readable_while_the_function_runs_and_after_it_ended(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], queue: SyncQueue
) -> None:
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.chatty, "release"))

    # live: the function waits for its release file; its output is already on the control plane
    until(lambda: "from a child process" in _text(queue.logs(inv)), "the output while it runs", 90)
    assert state_of(cp.url, cp.producer_token, inv) == "running"
    chunks = list(queue.logs(inv))
    assert _text(chunks) == "hello from print\nfrom a child process\n"
    assert _text(chunks, "stderr") == "careful, stderr\n"
    assert all(c.ts is not None and not c.truncated for c in chunks)
    result = _cli(cp, "logs", inv)
    assert result.exit_code == 0, result.output
    assert result.stdout == "hello from print\nfrom a child process\n"
    assert result.stderr == "careful, stderr\n"

    # `lakeshore logs -f` in a process of its own follows until the invocation ends
    env = {**os.environ, "LAKESHORE_URL": cp.url, "LAKESHORE_TOKEN": cp.producer_token,
           "LAKESHORE_CONFIG": "/nonexistent", "PYTHONPATH": str(ROOT)}  # fmt: skip
    follower = subprocess.Popen(
        [sys.executable, "-m", "dreamlake.lakeshore.cli", "logs", "-f", inv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert follower.stdout is not None and follower.stderr is not None
        assert follower.stdout.readline() == b"hello from print\n"  # it prints what is there
        assert follower.stdout.readline() == b"from a child process\n"
        assert follower.poll() is None  # ... then waits for more
        (n.workdir / inv / "release").touch()
        assert follower.stdout.readline() == b"after the gate\n"
        assert follower.wait(90) == 0  # and ends with the invocation
        assert follower.stdout.read() == b"" and follower.stderr.read() == b"careful, stderr\n"
    finally:
        if follower.poll() is None:
            follower.kill()

    assert queue.result(inv) == "talked"  # a plain function's result is untouched by its LOG frames
    assert list(queue.stream(inv)) == []  # and its stream has no values: LOG frames are skipped
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert {f.kind for f in frames} == {wire.FRAME_LOG}
    # after the end, for as long as the invocation is kept (the workdir is gone: this is the journal)
    until(lambda: not (n.workdir / inv).exists(), "the workdir to be removed")
    assert _text(queue.logs(inv)) == "hello from print\nfrom a child process\nafter the gate\n"
    follow = list(queue.logs(inv, follow=True))
    assert _text(follow) == "hello from print\nfrom a child process\nafter the gate\n"
    assert _text(queue.logs(inv, since=follow[0].seq)) == "from a child process\nafter the gate\n"


def test_a_generator_s_prints_ride_beside_its_values(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], queue: SyncQueue
) -> None:
    cp = sqlite_control_plane
    nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.noisy_count, 50, 3))
    assert list(queue.stream(inv)) == list(range(50))  # the values alone, in order
    assert await_result(cp.url, cp.producer_token, inv)["state"] == "succeeded"
    frames = frames_of(cp.url, cp.producer_token, inv)
    assert [f.seq for f in frames] == list(range(len(frames)))  # one seq space, no gap
    assert frames[-1].kind == wire.FRAME_END  # nothing after the END
    assert [wire.unpack(f.body) for f in frames if f.kind == wire.FRAME_VALUE] == list(range(50))  # type: ignore[arg-type]
    lines = _text(queue.logs(inv)).splitlines()
    assert lines == [f"value {i} line {j}" for i in range(50) for j in range(3)]
    assert _text(queue.logs(inv), "stderr") == "noisy_count done\n"


def _metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_flood_of_prints_is_cut_at_the_cap_and_never_starves_the_values(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], queue: SyncQueue
) -> None:
    """2 MB of prints between 2000 yields, a window of 100 frames and a cap of 256 KiB: every
    value arrives once, in order, on attempt 1; the output stops at the cap with one line that
    says so; the task ran to its end; nymph's undelivered bytes stay within window + cap."""
    cp = sqlite_control_plane
    cap, window = 256 * 1024, 100
    port = free_port()
    n = nymph_factory(
        cp.url, cp.daemon_token, "--stream-window-frames", str(window),
        "--stream-log-max-bytes", str(cap), "--metrics-port", str(port),
    )  # fmt: skip
    count = 2000
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.noisy_count, count, 1, 1000))
    assert list(queue.stream(inv, timeout=120)) == list(range(count))
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", n.output()[-3000:]
    assert cp.store.get(inv).attempt == 1  # type: ignore[union-attr]
    chunks = list(queue.logs(inv))
    kept = sum(len(c.text.encode()) for c in chunks if not c.truncated)
    assert kept == cap
    notes = [c for c in chunks if c.truncated]
    assert len(notes) == 1 and notes[0] is chunks[-1] and notes[0].stream == "stderr"
    assert "output truncated" in notes[0].text and f"log_max_bytes={cap}" in notes[0].text
    metrics = _metrics(port)
    peak = metrics["nymph_stream_undelivered_bytes_peak"]
    assert 0 < peak <= window * 64 + cap + 64 * 1024, peak
    assert metrics["nymph_output_bytes_sent_total"] == cap
    assert metrics["nymph_output_truncated_total"] == 1


def test_the_control_plane_counts_log_frames_and_claim_latency(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], queue: SyncQueue
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    cp = sqlite_control_plane
    nymph_factory(cp.url, cp.daemon_token)
    inv = submit(cp.url, cp.producer_token, envelope(nymph_fns.noisy_count, 5, 2))
    assert list(queue.stream(inv)) == list(range(5))
    token = cp.store.create_token("metrics", "prometheus")
    text = httpx.get(cp.url + "/metrics", headers={"Authorization": f"Bearer {token}"}).text
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    frames = frames_of(cp.url, cp.producer_token, inv)
    logs = sum(1 for f in frames if f.kind == wire.FRAME_LOG)
    assert got[("lakeshore_frames_appended_total", (("kind", "log"), ("owner", "invocation")))] == logs
    assert got[("lakeshore_frames_appended_total", (("kind", "value"), ("owner", "invocation")))] == 5
    assert got[("lakeshore_claim_latency_seconds_count", (("queue", "default"),))] == 1
