"""A submit's documents (``run_config``, ``function``, ``code_context``) within their bounds.

``http.bound_document`` refuses a document that nests too deep or weighs too much with a 400
naming the field, before it reaches the store's JSON encoder. A flat map, the common case, is
weighed in one pass; these pin that it weighs exactly as the full walk does, so a flat map is
refused at the same byte a nested one is.
"""

from __future__ import annotations

from typing import Any

import pytest

from dreamlake.lakeshore.server.http import HTTPError, bound_document


def _weight(doc: dict[str, Any]) -> int:
    """The weight the bound counts: 8 for the map, each key's length, each string's or bytes'
    length, 8 for any other value."""
    return 8 + sum(len(k) + (len(v) if isinstance(v, (str, bytes)) else 8) for k, v in doc.items())


@pytest.mark.parametrize("value", ["x", b"x", 1, 1.5, None, True])
def test_a_flat_map_at_the_limit_passes_and_one_byte_over_is_refused(value: Any) -> None:
    doc = {"queue": "gpu", "pad": value}
    limit = _weight(doc)
    assert bound_document(doc, "run_config", size=limit) is doc
    with pytest.raises(HTTPError) as err:
        bound_document(doc, "run_config", size=limit - 1)
    assert err.value.status == 400
    assert f"field 'run_config' is over the limit of {limit - 1} bytes" in err.value.message


def test_a_flat_map_and_the_same_map_nested_weigh_alike() -> None:
    flat = {"a": "x" * 100, "b": 7}
    nested = {"outer": {"a": "x" * 100, "b": 7}}
    # the nested one weighs its outer map (8) and key (5) more
    assert bound_document(flat, "doc", size=_weight(flat)) is flat
    assert bound_document(nested, "doc", size=_weight(flat) + 13) is nested
    with pytest.raises(HTTPError):
        bound_document(nested, "doc", size=_weight(flat) + 12)


def test_a_map_that_nests_too_deep_is_refused_naming_its_first_level_key() -> None:
    doc: dict[str, Any] = {"ok": 1}
    inner: dict[str, Any] = doc
    for _ in range(40):
        inner["deeper"] = {}
        inner = inner["deeper"]
    with pytest.raises(HTTPError) as err:
        bound_document(doc, "run_config", depth=32)
    assert err.value.status == 400
    assert "field 'run_config.deeper' nests deeper than 32 levels" in err.value.message


def test_non_string_keys_weigh_eight() -> None:
    doc = {1: "abc", "k": 2}
    assert bound_document(doc, "doc", size=8 + 8 + 3 + 1 + 8) is doc
    with pytest.raises(HTTPError):
        bound_document(doc, "doc", size=8 + 8 + 3 + 1 + 7)


def test_a_list_at_the_top_is_walked() -> None:
    with pytest.raises(HTTPError):
        bound_document(["x" * 50], "doc", size=40)
    assert bound_document(["x" * 10], "doc", size=40) == ["x" * 10]
