"""The one backoff (dreamlake/lakeshore/backoff.py): exponential, capped, jittered two ways."""

from __future__ import annotations

import pytest

from dreamlake.lakeshore.backoff import backoff_s


@pytest.mark.parametrize("tries", [0, 1, 2, 5, 40])
def test_half_jitter_stays_between_half_and_all_of_the_capped_pause(tries: int) -> None:
    pause = min(10.0, 0.5 * 2 ** min(tries, 10))
    for _ in range(200):
        assert pause / 2 <= backoff_s(tries, base=0.5, cap=10.0, doublings=10) <= pause


def test_added_jitter_is_at_most_half_a_second_over_the_pause() -> None:
    for tries, pause in ((0, 0.1), (3, 0.8), (30, 10.0)):
        for _ in range(200):
            assert pause <= backoff_s(tries, base=0.1, cap=10.0, jitter="add") <= pause + 0.5


def test_doublings_bound_the_exponent_below_the_cap() -> None:
    assert backoff_s(50, base=1.0, cap=1e9, doublings=3, jitter="half") <= 8.0


def test_an_unknown_jitter_is_refused() -> None:
    with pytest.raises(ValueError, match="use 'half' or 'add'"):
        backoff_s(1, base=1.0, cap=2.0, jitter="full")
