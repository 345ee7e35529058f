"""The warning a submit to a queue nobody serves carries (server/liveness.py)."""

from __future__ import annotations

from dreamlake.lakeshore.server.liveness import no_worker_warning


def test_with_no_worker_anywhere_it_says_how_to_start_one_without_a_token_on_the_command_line() -> None:
    """The README and ``nymph start --help`` keep the daemon token off the command line (``ps``
    shows it to every local user): the hint does too."""
    said = no_worker_warning("gpu", {})
    assert said == (
        "no worker has polled queue 'gpu' in the last 5 min; known queues: none "
        "(start one: NYMPH_TOKEN=DAEMON_TOKEN nymph start --server URL --queue gpu)"
    )
    assert "--token" not in said


def test_with_other_queues_served_it_names_them() -> None:
    assert no_worker_warning("mnie", {"gpu": 1, "demo": 2}).endswith("known queues: demo, gpu")
