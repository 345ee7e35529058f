"""One rule for a placement label (dreamlake/lakeshore/labels.py): a selector entry no nymph label
could be is refused by the SDK, at submit and by nymph for its own labels, and shown escaped."""

from __future__ import annotations

from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.labels import RULE
from dreamlake.lakeshore.server.liveness import placement_warning
from dreamlake.lakeshore.store.placement import Needs, needs_of
from nymph.config import ConfigError, resolve

# each can never equal a label nymph holds: it splits --label at the first '=' and strips each side
NEVER = [
    ("a=b", "x"),
    (" pool", "a"),
    ("pool ", "a"),
    ("pool", " a"),
    ("pool", "a "),
    ("pool", "a\nFAKE log line"),
    ("po\nol", "a"),
    ("pool", "a\x1b[2J"),
    ("pool", "a\u2028b"),
    ("pool", "\t"),
    ("", "a"),
    ("pool", ""),
    ("p" * 129, "a"),
]
FINE = [("pool", "a"), ("gpu_model", "NVIDIA H100 80GB HBM3"), ("expr", "a=b"), ("zone", "eu-1,eu-2")]


def body(x: int) -> int:
    return x


@pytest.mark.parametrize(("name", "value"), NEVER)
def test_a_selector_no_label_could_match_is_refused_at_submit(name: str, value: str) -> None:
    with pytest.raises(PlaneError) as err:
        needs_of({"selector": {"pool": "ok", name: value}}, "default")
    assert err.value.status == 400
    message = str(err.value)
    assert message.startswith(f"run_config.selector entry {name!r:.60}={value!r:.60} is not a label")
    assert message.endswith(RULE) and "\n" not in message and "\x1b" not in message


@pytest.mark.parametrize(("name", "value"), NEVER)
def test_the_sdk_refuses_it_at_decoration_and_per_call(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=r"^selector entry .* is not a label a nymph can have"):
        dls.udf(queue="q", selector={name: value})(body)
    udf = dls.udf(queue="q")(body)
    with pytest.raises(ValueError, match=r"^selector entry .* is not a label a nymph can have"):
        udf.thunk(1, _selector={name: value})


@pytest.mark.parametrize(
    ("name", "value"), [(n, v) for n, v in NEVER if (n.strip(), v.strip()) != ("pool", "a")]
)
def test_nymph_refuses_a_label_of_its_own_no_selector_could_name(name: str, value: str) -> None:
    """(nymph strips each side of a label, as it always has: `` pool`` is its label ``pool``)"""
    flags: dict[str, Any] = {"server": "http://x", "token": "t", "labels": {name: value}}
    if name == name.strip() and value == value.strip() and "=" not in name and name:  # as a k=v too
        flags = {**flags, "labels": (f"{name}={value}",)}
    with pytest.raises(ConfigError, match=r"^labels entry .* is not a label a nymph can have"):
        resolve(flags, {})


@pytest.mark.parametrize(("name", "value"), FINE)
def test_a_label_nymph_can_have_is_selected_by_it(name: str, value: str) -> None:
    cfg = resolve({"server": "http://x", "token": "t", "labels": (f" {name} = {value} ",)}, {})
    assert dict(cfg.labels) == {name: value}
    assert needs_of({"selector": {name: value}}, "default").selector == ((name, value),)
    dls.udf(queue="q", selector={name: value})(body)


def test_the_warning_writes_a_label_plainly_and_an_odd_one_escaped() -> None:
    fleet = [{"capacity": {}, "labels": {"pool": "b"}}]
    plain = placement_warning("q", Needs(selector=(("pool", "a"),)), fleet)
    assert plain == "no live worker of queue 'q' has the labels pool=a"
    odd = placement_warning("q", Needs(selector=(("pool", "a\nINFO forged"),)), fleet)
    assert odd == "no live worker of queue 'q' has the labels 'pool'='a\\nINFO forged'"


def test_nymphs_automatic_labels_are_ones_a_selector_can_name() -> None:
    """A driver's padded GPU model (``"NVIDIA H100 80GB HBM3 "``) was offered as the label value
    with its trailing space, which no selector may name (the rule refuses it at submit): a call
    selecting the model as shown waited for ever. Automatic labels keep to the rule: stripped, and
    one that still breaks it left out."""
    from nymph.placement import auto_labels

    padded = {"arch": "x86_64 ", "os": "linux", "gpus": [{"model": " NVIDIA H100 80GB HBM3 "}] * 2}
    labels = auto_labels(padded)
    assert labels == {"arch": "x86_64", "os": "linux", "gpu_model": "NVIDIA H100 80GB HBM3"}
    needs = needs_of({"selector": {"gpu_model": "NVIDIA H100 80GB HBM3"}}, "default")
    assert dict(needs.selector).items() <= labels.items()
    odd = auto_labels({"arch": "x86_64", "os": "linux", "gpus": [{"model": "GPU\x1b[2J"}]})
    assert odd == {"arch": "x86_64", "os": "linux"}  # never offered raw
    assert auto_labels({"arch": "", "os": None, "gpus": [{"model": "unknown"}]}) == {}
