"""A claim of more (queue, shape) heads than one statement merges (``MERGED_QUEUES_MAX``) picks
them in groups (store/claims.py): every head in exactly one group, in order, each group of 2 to
``MERGED_QUEUES_MAX`` heads (a pick of one head returns no sort columns), and no pick statement
of more heads can be built (the old one read and sorted every queued row of its heads)."""

from __future__ import annotations

import pytest

from dreamlake.lakeshore.store.claims import (
    MERGED_QUEUES_MAX,
    claim_statement,
    head_groups,
    merged_picks,
    pick_statement,
)


@pytest.mark.parametrize(
    "n", [MERGED_QUEUES_MAX + 1, 2 * MERGED_QUEUES_MAX, 2 * MERGED_QUEUES_MAX + 1, 1249, 4000]
)
def test_heads_are_grouped_in_order_evenly_and_never_alone(n: int) -> None:
    heads = [(f"q{i}", "plain") for i in range(n)]
    groups = head_groups(heads)
    assert [h for g in groups for h in g] == heads
    assert all(2 <= len(g) <= MERGED_QUEUES_MAX for g in groups), [len(g) for g in groups]
    assert max(map(len, groups)) - min(map(len, groups)) <= 1


def test_no_pick_or_claim_statement_of_more_heads_than_merged() -> None:
    pick_statement(MERGED_QUEUES_MAX)
    for build in (pick_statement, claim_statement):
        with pytest.raises(ValueError, match="head_groups"):
            build(MERGED_QUEUES_MAX + 1)


def test_groups_picks_merge_in_claim_order() -> None:
    first = [("b", "q1", "plain", 5, 2.0), ("c", "q2", "plain", 0, 1.0)]
    second = [("a", "q40", "plain", 5, 2.0), ("d", "q41", "plain", 9, 3.0)]
    assert [r[0] for r in merged_picks([first, second])] == ["d", "a", "b", "c"]
