"""Hosts come and go (issue 30): real ``lakeshore server`` and ``nymph start`` processes, on SQLite
and PostgreSQL.

- SIGTERM to nymph A under a running call (``max_attempts=1``, ``--grace-s 2``): the attempt is
  acked ``preempted``, the call runs again on nymph B (attempt 2) and succeeds; ``lakeshore show``
  lists attempt 1 as preempted. The time from the SIGTERM to the call running on B is printed.
- ``nymph drain`` with 3 running calls: all 3 succeed on attempt 1, nymph exits 0, nothing submitted
  after the drain began runs there.
- A function's ``finally`` runs when its call is cancelled, timed out or preempted, and
  ``dls.Interrupted`` says which.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner

from dreamlake.lakeshore.cli import main as lakeshore_main
from tests import preempt_fns
from tests.integration.conftest import ControlPlane
from tests.stack.nymph import NYMPH, Nymph
from tests.stack.procs import child_env
from tests.stack.producer import await_result, call, envelope, status_of, submit
from tests.stack.wait import LIMIT_S, until


def _base(path: Path) -> Path:
    path.mkdir()
    return path


def _show(cp: ControlPlane, invocation_id: str) -> str:
    env = {
        "LAKESHORE_URL": cp.url,
        "LAKESHORE_TOKEN": cp.admin_token,
        "LAKESHORE_CONFIG": "/nonexistent.toml",
    }
    result = CliRunner().invoke(lakeshore_main, ["show", invocation_id], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_sigterm_preempts_the_call_and_another_nymph_runs_it_on_attempt_2(
    control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = control_plane
    a = nymph_factory(cp.url, cp.daemon_token, "--grace-s", "2", base=_base(tmp_path / "a"))
    inv = submit(cp.url, cp.producer_token, envelope(preempt_fns.sleepy, 20), max_attempts=1)
    until(lambda: (a.workdir / inv / "handle.json").exists(), "attempt 1 to start on nymph A")
    b = nymph_factory(cp.url, cp.daemon_token, base=_base(tmp_path / "b"))
    until(lambda: "registered as worker" in b.output(), "nymph B to register")
    sent = time.monotonic()
    a.signal(15)
    until(
        lambda: (s := status_of(cp.url, cp.producer_token, inv))["attempt"] == 2 and s["state"] == "running",
        "attempt 2 to run on nymph B",
    )
    again = time.monotonic() - sent
    print(f"\nSIGTERM to the call running again elsewhere: {again:.2f}s (grace 2s; figure, not a bound)")
    assert a.wait() == 0
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", b.output()[-3000:]
    status = status_of(cp.url, cp.producer_token, inv)
    (first, second) = status["attempts"]
    assert (first["attempt"], first["state"], first["error"]["type"]) == (1, "preempted", "Preempted")
    assert (second["attempt"], second["state"]) == (2, "succeeded")
    assert first["worker_id"] != second["worker_id"]
    assert (status["max_attempts"], status["preemptions"]) == (1, 1)
    shown = _show(cp, inv)
    assert "#1: preempted (Preempted: daemon shutdown grace expired)" in shown, shown
    assert "#2: succeeded" in shown, shown
    assert "attempts    2 of 2, final (+1 preempted, not counted)" in shown, shown


def test_nymph_drain_lets_running_calls_finish_claims_nothing_new_and_exits_0(
    control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    cp = control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--concurrency", "3", "--grace-s", "1")
    calls = [submit(cp.url, cp.producer_token, envelope(preempt_fns.sleepy, 4)) for _ in range(3)]
    for inv in calls:
        until(lambda inv=inv: (n.workdir / inv / "handle.json").exists(), f"{inv} to start")
    drain = subprocess.Popen(
        [*NYMPH, "drain", "--state-dir", str(n.state_dir), "--drain-timeout", "60"],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        until(lambda: "draining" in n.output(), "nymph to start draining")
        late = submit(cp.url, cp.producer_token, envelope(preempt_fns.sleepy, 0))
        out, _ = drain.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        print(n.output()[-5000:])
        raise
    finally:
        drain.kill()
        drain.wait()
    assert drain.returncode == 0, (out, n.output()[-4000:])
    assert b"exited" in out
    assert n.wait() == 0
    for inv in calls:
        result = await_result(cp.url, cp.producer_token, inv)
        assert result["state"] == "succeeded"
        assert status_of(cp.url, cp.producer_token, inv)["attempt"] == 1
    late_status = status_of(cp.url, cp.producer_token, late)
    assert late_status["state"] == "queued" and late_status["attempt"] == 0, late_status  # never claimed
    assert not (n.workdir / late).exists()


def test_finally_runs_when_the_call_is_cancelled_timed_out_or_preempted(
    control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    cp = control_plane
    n = nymph_factory(
        cp.url, cp.daemon_token, "--concurrency", "2", "--stop-grace-s", "5", base=_base(tmp_path / "a")
    )
    marks = {k: tmp_path / f"{k}.marker" for k in ("cancelled", "timeout", "preempted")}
    # each stop comes once the function runs (it touches ``started`` inside its try): the runner's
    # handle is written as the process starts, and a stop before the function began has no
    # finally to run (on a loaded machine the entry's start-up took that long)
    began = {k: tmp_path / f"{k}.started" for k in marks}
    cancelled = submit(
        cp.url,
        cp.producer_token,
        envelope(preempt_fns.interruptible, str(marks["cancelled"]), started=str(began["cancelled"])),
    )
    until(began["cancelled"].exists, "the cancelled call's function to start")
    call(cp.url, cp.producer_token, f"/v1/producer/invocations/{cancelled}/cancel", {})
    assert await_result(cp.url, cp.producer_token, cancelled)["state"] == "killed"
    assert marks["cancelled"].read_text() == "cancelled"
    timed = submit(
        cp.url,
        cp.producer_token,
        envelope(preempt_fns.interruptible, str(marks["timeout"]), started=str(began["timeout"])),
        timeout_s=5,  # from the start of the process: room for the entry's start-up on a loaded machine
    )
    assert await_result(cp.url, cp.producer_token, timed)["state"] == "timeout"
    assert began["timeout"].exists()  # the function ran, so its finally did
    assert marks["timeout"].read_text() == "timeout"
    pre = submit(
        cp.url,
        cp.producer_token,
        envelope(preempt_fns.interruptible, str(marks["preempted"]), started=str(began["preempted"])),
        max_attempts=1,
    )
    until(began["preempted"].exists, "the preempted call's function to start")
    n.signal(15)
    assert n.wait() == 0
    until(lambda: marks["preempted"].exists(), "the preempted call's finally")
    assert marks["preempted"].read_text() == "preempted"
    assert status_of(cp.url, cp.producer_token, pre)["attempts"][0]["state"] == "preempted"


def test_a_call_a_poll_in_flight_claims_as_nymph_stops_is_handed_back_spending_nothing(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph]
) -> None:
    """A long poll waits in the control plane as nymph gets SIGTERM; a call submitted then is
    claimed by it and handed back before it starts: ``handbacks`` 1, no preemption counted, so a
    call with ``max_preemptions=0`` stays queued. Before, it failed ``Preempted`` without running."""
    cp = sqlite_control_plane
    n = nymph_factory(cp.url, cp.daemon_token, "--poll-timeout-s", "30", "--grace-s", "5")
    until(lambda: cp.app.state.ctx.polls.waiting >= 1, "nymph's long poll to wait")
    n.signal(15)
    until(lambda: "no new claims" in n.output(), "nymph to take the SIGTERM")
    inv = submit(cp.url, cp.producer_token, envelope(preempt_fns.sleepy, 0), max_preemptions=0)
    assert n.wait() == 0
    status = status_of(cp.url, cp.producer_token, inv)
    assert (status["state"], status["preemptions"], status["handbacks"]) == ("queued", 0, 1), status
    [first] = status["attempts"]
    assert (first["state"], first["error"]["started"]) == ("preempted", False)
    assert not (n.workdir / inv).exists()  # it never started


def test_a_nymph_restarted_between_the_claim_and_the_start_hands_the_attempt_back_at_once(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], tmp_path: Path
) -> None:
    """A previous life of nymph (same worker id, same state dir) claimed attempt 1 and made its
    workdir, then died before the start (restoring a checkpoint, say). The restarted nymph hands
    the attempt back at once, spending nothing, and runs attempt 2 of a ``max_attempts=1`` call.
    Before, it acked nothing: the lease lapsed and the call failed ``LeaseExpired``."""
    import nymph.workdir as wd
    from dreamlake.lakeshore.ids import new_ulid

    cp = sqlite_control_plane
    base = _base(tmp_path / "a")
    worker = new_ulid()
    (base / "state").mkdir()
    (base / "state" / "worker_id").write_text(worker + "\n")
    inv = submit(cp.url, cp.producer_token, envelope(preempt_fns.sleepy, 0), max_attempts=1)
    body = {"worker_id": worker, "queues": ["default"], "timeout_s": 5}
    assert cp.call("/v1/daemon/register", body, cp.daemon_token)[0] == 200
    status, out = cp.call("/v1/daemon/poll", body, cp.daemon_token)
    assert status == 200 and [c["body"]["invocation_id"] for c in out["commands"]] == [inv], out
    (base / "work").mkdir()
    meta = {"invocation_id": inv, "attempt": 1, "worker_id": worker, "started_at": time.time()}
    wd.create(base / "work", inv, b"", meta, None, write_args=False)  # what the claim left, no task
    n = nymph_factory(cp.url, cp.daemon_token, base=base)
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "succeeded", n.output()[-3000:]
    status_now = status_of(cp.url, cp.producer_token, inv)
    assert [(a["attempt"], a["state"]) for a in status_now["attempts"]] == [
        (1, "preempted"),
        (2, "succeeded"),
    ]
    assert status_now["attempts"][0]["error"]["started"] is False
    assert (status_now["preemptions"], status_now["handbacks"]) == (0, 1)
    assert "handed back before it started" in n.output()
