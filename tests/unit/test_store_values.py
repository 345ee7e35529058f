"""store/values.py and store/placement.py: what a submit's JSON columns and needs become."""

from __future__ import annotations

import math

import pytest

from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.store.placement import NO_NEEDS, needs_of
from dreamlake.lakeshore.store.values import json_safe


def test_json_data_is_kept_and_non_finite_floats_are_spelled() -> None:
    plain = {"queue": "q", "priority": 1.5, "tags": ["a", None, True], "n": {"deep": [0]}}
    assert json_safe(plain, "run_config") == plain
    odd = {"lr": math.nan, "bounds": (-math.inf, [math.inf, 1.0]), "name": "x"}
    assert json_safe(odd, "run_config") == {"lr": "nan", "bounds": ["-inf", ["inf", 1.0]], "name": "x"}


@pytest.mark.parametrize("bad", [{"s": {1, 2}}, {"b": b"bytes"}, {"f": object()}, [math.nan, {"x": {2}}]])
def test_what_is_not_json_data_is_a_400_that_says_so(bad: object) -> None:
    with pytest.raises(PlaneError, match="run_config must hold JSON data only") as err:
        json_safe(bad, "run_config")
    assert err.value.status == 400


def test_a_call_that_asks_nothing_has_no_needs_in_any_namespace() -> None:
    for rc in ({}, {"queue": "q", "priority": 0.0, "key": None, "env": {"A": "1"}}):
        assert needs_of(rc, "team-a") is NO_NEEDS and NO_NEEDS.key() == ""
    asked = needs_of({"resources": {"gpus": 1}, "concurrency_key": "k"}, "team-a")
    assert (asked.gpus, asked.concurrency_key) == (1, "team-a/k") and asked.key() != ""
    with pytest.raises(PlaneError, match="needs a concurrency_key"):
        needs_of({"max_concurrency": 2}, "team-a")
