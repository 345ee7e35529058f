"""The client side's protocol package: the one by-reference rule, the server's limits as a client
reads them (from an answer of any control plane, older ones included), and one home for routes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dreamlake.lakeshore.protocol import routes
from dreamlake.lakeshore.protocol.limits import DEFAULT_INLINE_THRESHOLD, ServerLimits, by_reference

ROOT = Path(__file__).resolve().parents[2]


def test_a_payload_goes_by_reference_only_over_a_threshold_that_exists() -> None:
    assert not by_reference(100, 100)  # at the threshold: inline
    assert by_reference(101, 100)
    assert not by_reference(10**9, None)  # no payload store: everything inline
    assert by_reference(1, 0)


def test_limits_are_read_from_a_register_or_info_answer() -> None:
    limits = ServerLimits.from_answer({"limits": {"acks_per_poll": 32, "inline_threshold_bytes": 1024}})
    assert (limits.acks_per_poll, limits.inline_threshold_bytes) == (32, 1024)
    assert limits.submit_batch_max == ServerLimits().submit_batch_max  # not said: the default
    # a control plane without a payload store says its threshold is None
    assert (
        ServerLimits.from_answer({"limits": {"inline_threshold_bytes": None}}).inline_threshold_bytes is None
    )


def test_an_older_control_plane_without_limits_is_read_as_before() -> None:
    # its register answer names the threshold alone, and leaves it out without a payload store
    assert ServerLimits.from_answer({"inline_threshold_bytes": 4096}).inline_threshold_bytes == 4096
    assert ServerLimits.from_answer({"lease_s": 30}).inline_threshold_bytes is None
    assert ServerLimits.from_answer(None) == ServerLimits(inline_threshold_bytes=None)
    assert ServerLimits().inline_threshold_bytes == DEFAULT_INLINE_THRESHOLD


def test_a_value_not_understood_keeps_the_default() -> None:
    given = {"acks_per_poll": True, "submit_batch_max": -1, "await_batch_max": "many", "unknown": 3}
    assert ServerLimits.from_answer({"limits": given}) == ServerLimits()


def test_the_daemon_routes_are_spelled_in_one_client_side_file() -> None:
    out = subprocess.run(
        ["grep", "-rln", '"/v1/daemon/', "dreamlake", "nymph", "runners"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    client_side = sorted(p for p in out if "/server/" not in p)
    assert client_side == ["dreamlake/lakeshore/protocol/routes.py"], client_side
    assert all(r.startswith("/v1/daemon/") for r in routes.DAEMON_ROUTES)
