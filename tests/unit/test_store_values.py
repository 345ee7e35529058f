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


def test_the_encoders_made_once_write_what_json_dumps_writes() -> None:
    """``json_encoded`` and ``canonical`` encode with encoders made once: the same text as
    ``json.dumps`` for every kind of value, the same errors for what JSON cannot hold, and a
    value that holds itself ends in a RecursionError, as it did (the ValueError's fix recursed)."""
    import json
    import math

    from dreamlake.lakeshore.store import values

    cases: list[object] = [
        {"b": 1, "a": [1, 2.5, None, True, 'é\n"x\u0001'], "c": {"z": {}, "y": []}},
        {9: "int keys", 10: "sort apart", "s": 1.0},
        [1e300, -0.0, 2**70, ("t", "u")],
        "a str",
        7,
        None,
        {},
    ]
    for value in cases:
        assert values.json_encoded(value, "v")[1] == json.dumps(value, allow_nan=False)
        if not (isinstance(value, dict) and any(isinstance(k, int) for k in value) and "s" in value):
            want = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
            assert values.canonical(value) == want
    assert values.json_encoded({"x": math.inf}, "v") == ({"x": "inf"}, '{"x": "inf"}')  # spelled
    for bad in [{"x": object()}, {(1, 2): "tuple key"}, [b"bytes"]]:
        with pytest.raises(PlaneError):
            values.json_encoded(bad, "v")
    with pytest.raises(ValueError):
        values.canonical([math.nan])
    with pytest.raises(TypeError):
        values.canonical({1: "a", "b": 2})  # keys of two kinds cannot be sorted
    loop: dict[str, object] = {}
    loop["self"] = loop
    with pytest.raises(RecursionError):
        values.json_encoded(loop, "v")
